"""Fixtures shared by the training tests (tests/recipe/test_train.py, training/test_accumulation.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipe.synthetic import write_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 synthetic training pairs and 24 held-out ones, 32-pixel images."""
    out = tmp_path_factory.mktemp("synthetic")
    write_dataset(str(out), 64, n_val=24, image_size=32, seed=0)
    return out

"""Zero-shot classification prompts: class names and templates, and where to find them.

A ``zeroshot.json`` next to a dataset (``{"classnames": [...], "templates": [...]}``) names
class ``i`` at index ``i`` of ``classnames``; every template holds a ``{}`` (or ``{c}``)
placeholder for the class name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

from recipe.data.formats import expand_paths

#: File name of the zero-shot class names and prompt templates next to a dataset.
ZEROSHOT_FILENAME = "zeroshot.json"


@dataclass
class ZeroShotPrompts:
    """Class names and prompt templates for zero-shot classification.

    Attributes:
        classnames: Name of class ``i`` at index ``i``.
        templates: Prompt templates with a ``{}`` (or ``{c}``) placeholder for the class name.
    """

    classnames: list[str]
    templates: list[str] = field(default_factory=lambda: ["a photo of a {}."])

    def prompts(self) -> list[list[str]]:
        """``prompts()[i]`` are the prompts of class ``i``, one per template."""
        return [[t.replace("{c}", c).replace("{}", c) for t in self.templates] for c in self.classnames]


def load_zeroshot_prompts(path: str | os.PathLike) -> ZeroShotPrompts:
    """Read a ``zeroshot.json`` (``{"classnames": [...], "templates": [...]}``).

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: Missing or malformed fields.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"zero-shot prompt file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    names, templates = spec.get("classnames"), spec.get("templates")
    if not names or not all(isinstance(c, str) and c for c in names):
        raise ValueError(f"{path}: 'classnames' must be a non-empty list of strings")
    if not templates or not all(isinstance(t, str) and ("{}" in t or "{c}" in t) for t in templates):
        raise ValueError(f"{path}: 'templates' must be a non-empty list of strings with a '{{}}' placeholder")
    return ZeroShotPrompts(list(names), list(templates))


def find_zeroshot_file(data_path: str | os.PathLike | Sequence[str]) -> str | None:
    """Look for :data:`ZEROSHOT_FILENAME` next to a dataset: in its folder or up to two levels up."""
    first = expand_paths(data_path)[0]
    folder = first if os.path.isdir(first) else os.path.dirname(first)
    for _ in range(3):
        p = os.path.join(folder, ZEROSHOT_FILENAME)
        if os.path.exists(p):
            return p
        folder = os.path.dirname(folder)
    return None


__all__ = ["ZEROSHOT_FILENAME", "ZeroShotPrompts", "find_zeroshot_file", "load_zeroshot_prompts"]

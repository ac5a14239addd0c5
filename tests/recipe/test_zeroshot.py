"""recipe.zeroshot: finding and reading a dataset's zero-shot class names and prompt templates."""

from __future__ import annotations

import json
import os

import pytest

from recipe import synthetic
from recipe.zeroshot import ZEROSHOT_FILENAME, ZeroShotPrompts, find_zeroshot_file, load_zeroshot_prompts


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    synthetic.write_dataset(str(root), 24, n_val=10, seed=3, image_size=20, shard_size=4)
    return root


def test_zeroshot_prompts_from_the_synthetic_set(syn, tmp_path):
    for data_path in (os.path.join(syn, "val.csv"), os.path.join(syn, "wds", "val", "00000.tar")):
        found = find_zeroshot_file(data_path)
        assert found == os.path.join(syn, ZEROSHOT_FILENAME)
    assert find_zeroshot_file([os.path.join(syn, "wds", "val")]) == found  # a list, a directory
    zs = load_zeroshot_prompts(found)
    assert zs.classnames == synthetic.class_names(synthetic.DEFAULT_COLOURS, synthetic.DEFAULT_SHAPES)
    prompts = zs.prompts()
    assert len(prompts) == 12 and all(len(p) == len(synthetic.ZEROSHOT_TEMPLATES) for p in prompts)
    assert prompts[0][0] == "a photo of a red circle."
    bad = tmp_path / "zs.json"
    bad.write_text(json.dumps({"classnames": ["a"], "templates": ["no placeholder"]}))
    with pytest.raises(ValueError, match="placeholder"):
        load_zeroshot_prompts(bad)
    with pytest.raises(FileNotFoundError):
        load_zeroshot_prompts(tmp_path / "absent.json")


def test_no_zeroshot_file_and_both_placeholders(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "val.csv").write_text("filepath,title\n")
    (tmp_path / ZEROSHOT_FILENAME).write_text("{}")  # three levels up: too far
    assert find_zeroshot_file(str(deep / "val.csv")) is None
    zs = ZeroShotPrompts(["cat", "dog"], ["a {}.", "the {c}!"])
    assert zs.prompts() == [["a cat.", "the cat!"], ["a dog.", "the dog!"]]
    assert ZeroShotPrompts(["cat"]).prompts() == [["a photo of a cat."]]

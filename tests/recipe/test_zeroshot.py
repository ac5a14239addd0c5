"""recipe.zeroshot: finding and reading a dataset's zero-shot class names and prompt templates; the
built-in ImageNet-1k lists."""

from __future__ import annotations

import json
import os

import pytest

from recipe import synthetic
from recipe.zeroshot import (
    IMAGENET_CLASSNAMES,
    IMAGENET_WNIDS,
    OPENAI_IMAGENET_TEMPLATES,
    ZEROSHOT_FILENAME,
    ZeroShotPrompts,
    find_zeroshot_file,
    get_zeroshot_prompts,
    imagenet_class_index,
    imagenet_prompts,
    load_zeroshot_prompts,
)


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


def test_imagenet_lists():
    assert len(IMAGENET_WNIDS) == 1000 and len(set(IMAGENET_WNIDS)) == 1000
    assert list(IMAGENET_WNIDS) == sorted(IMAGENET_WNIDS)
    assert IMAGENET_WNIDS[0] == "n01440764" and IMAGENET_WNIDS[-1] == "n15075141"
    assert all(len(w) == 9 and w[0] == "n" and w[1:].isdigit() for w in IMAGENET_WNIDS)
    assert len(IMAGENET_CLASSNAMES) == 1000 and all(c and c == c.strip() for c in IMAGENET_CLASSNAMES)
    # spot checks against the published list; its two names given to two classes each are kept
    assert (IMAGENET_CLASSNAMES[0], IMAGENET_CLASSNAMES[1], IMAGENET_CLASSNAMES[999]) == (
        "tench", "goldfish", "toilet paper")
    assert IMAGENET_CLASSNAMES[207] == "Golden Retriever" and IMAGENET_CLASSNAMES[409] == "analog clock"
    repeated = sorted({c for c in IMAGENET_CLASSNAMES if IMAGENET_CLASSNAMES.count(c) > 1})
    assert repeated == ["missile", "sunglasses"] and len(set(IMAGENET_CLASSNAMES)) == 998
    assert [i for i, c in enumerate(IMAGENET_CLASSNAMES) if c in repeated] == [657, 744, 836, 837]
    assert len(OPENAI_IMAGENET_TEMPLATES) == 80 and len(set(OPENAI_IMAGENET_TEMPLATES)) == 80
    assert all(t.count("{}") == 1 for t in OPENAI_IMAGENET_TEMPLATES)
    first_last = (OPENAI_IMAGENET_TEMPLATES[0], OPENAI_IMAGENET_TEMPLATES[-1])
    assert first_last == ("a bad photo of a {}.", "a tattoo of the {}.")

    zs = imagenet_prompts()
    assert zs.name == "imagenet" and len(zs.prompts()) == 1000 and len(zs.prompts()[0]) == 80
    assert zs.prompts()[1][0] == "a bad photo of a goldfish."
    index = zs.class_index()
    assert index["n01440764"] == 0 and index["n15075141"] == 999 and imagenet_class_index("n01443537") == 1
    assert get_zeroshot_prompts("imagenet") == zs
    with pytest.raises(KeyError, match="'n00000000' is not an ImageNet-1k class"):
        imagenet_class_index("n00000000")


def test_open_clip_agrees_with_the_built_in_lists():
    """The lists are literals here; open_clip (a test extra) ships the same facts."""
    import open_clip.zero_shot_metadata as z
    assert list(IMAGENET_CLASSNAMES) == list(z.IMAGENET_CLASSNAMES)
    assert list(OPENAI_IMAGENET_TEMPLATES) == [t("{}") for t in z.OPENAI_IMAGENET_TEMPLATES]


def test_class_names_by_folder_and_named_templates(tmp_path):
    path = tmp_path / "classes.json"
    path.write_text(json.dumps({"classnames": {"n02": "dog", "n01": "cat"}, "templates": "openai"}))
    zs = load_zeroshot_prompts(path)
    assert zs.classnames == ["dog", "cat"] and zs.folders == ["n02", "n01"] and zs.class_index() == {"n02": 0, "n01": 1}
    assert zs.templates == list(OPENAI_IMAGENET_TEMPLATES) and zs.name == "zeroshot"
    assert ZeroShotPrompts(["a"]).class_index() is None
    for bad, error in (({"classnames": {"": "x"}, "templates": ["{}"]}, "folder names"),
                       ({"classnames": [], "templates": ["{}"]}, "classnames"),
                       ({"classnames": ["a"], "templates": "clip"}, "templates"),
                       (["a"], "JSON object")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=error):
            load_zeroshot_prompts(path)

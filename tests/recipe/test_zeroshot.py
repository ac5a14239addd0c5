"""recipe.zeroshot: finding and reading a dataset's zero-shot class names and prompt templates; the
built-in ImageNet-1k lists; the classifier (recipe.zeroshot.classifier) shared out over two gloo ranks,
bit-identical to one process's, and its tokenised prompts cached per run."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

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


# ---------------------------------------------------------------------------------------------------
# The classifier: classes shared out over the ranks, tokenised prompts cached

#: A one-layer text tower: the classifier tests embed a few dozen prompts.
SMALL_TEXT = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
TEMPLATES = ["a photo of a {}.", "the {}!"]
#: name -> (class count, max_prompts): the chunks of classes (one forward each) and the blocks of the
#: two ranks. seven: chunks of 2 -> 4 chunks, blocks of 4 and 3 classes; five: chunks of 1, blocks of 2
#: and 3 classes (uneven); one: one class for two ranks, rank 0 embeds none.
CASES = {"seven": (7, 4), "five": (5, 2), "one": (1, 2048)}
NAMES = ["cat", "dog", "fish", "bird", "cow", "horse", "sheep"]


class CountingTokenizer:
    """A tokenizer that counts its calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def __call__(self, texts):
        self.calls += 1
        return self.tok(texts)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A directory with a small tokenizer and the weights of a ``tiny`` model with a one-layer text tower."""
    from recipe.model import create_model
    from recipe.model.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    tok = train_tokenizer(iter([t.replace("{}", c) for c in NAMES for t in OPENAI_IMAGENET_TEMPLATES]), 300,
                          context_length=16)
    tok.save(root / "tokenizer")
    torch.manual_seed(0)
    torch.save(create_model("tiny", tokenizer=tok, text_overrides=SMALL_TEXT).state_dict(), root / "weights.pt")
    return str(root)


def _load_tiny(root: str):
    from recipe.model import create_model
    from recipe.model.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(root) / "tokenizer")
    model = create_model("tiny", tokenizer=tok, text_overrides=SMALL_TEXT, text_load_weights=False)
    model.load_state_dict(torch.load(Path(root) / "weights.pt", weights_only=True))
    return model.eval(), tok


def _count_forwards(model) -> list[int]:
    forwards, encode = [0], model.encode_text

    def counted(*args, **kw):
        forwards[0] += 1
        return encode(*args, **kw)

    model.encode_text = counted
    return forwards


def _classifier_worker(rank: int, world: int, root: str) -> dict:
    """Every case built twice on this rank (tokenizer calls and forwards counted), then in lockstep."""
    from recipe.zeroshot.classifier import zero_shot_classifier

    model, tok = _load_tiny(root)
    forwards = _count_forwards(model)
    out: dict = {}
    for name, (n, max_prompts) in CASES.items():
        prompts = ZeroShotPrompts(NAMES[:n], TEMPLATES)
        counting = CountingTokenizer(tok)
        first = zero_shot_classifier(model, prompts, counting, max_prompts=max_prompts)
        calls_first, forwards[0] = counting.calls, 0
        second = zero_shot_classifier(model, prompts, counting, max_prompts=max_prompts)
        out[name] = {"classifier": first, "same_twice": torch.equal(first, second), "forwards": forwards[0],
                     "calls": (calls_first, counting.calls)}
        forwards[0] = 0
        locked = zero_shot_classifier(model, prompts, counting, max_prompts=max_prompts, lockstep=True)
        out[name].update(lockstep_forwards=forwards[0], lockstep_equal=torch.equal(locked, first))
        # a ZeRO-3 partitioned tower (DeepSpeed marks its parameters with ds_id) runs in lockstep by itself
        param = next(model.parameters())
        param.ds_id, forwards[0] = 0, 0
        try:
            detected = zero_shot_classifier(model, prompts, counting, max_prompts=max_prompts)
        finally:
            del param.ds_id
        out[name].update(zero3_forwards=forwards[0], zero3_equal=torch.equal(detected, first))
    return out


def test_two_ranks_build_the_classifier_of_one(tiny):
    """Each rank embeds a contiguous block of whole classes (uneven blocks, and a rank without any),
    the gathered classifier equals one process's bit for bit; a rank tokenises its prompts once over
    two builds; in lockstep (ZeRO-3) every rank runs as many forwards as the busiest."""
    from tests.dist_utils import run_distributed

    ranks = run_distributed(_classifier_worker, 2, tiny, threads_per_rank=1, env={"TOKENIZERS_PARALLELISM": "false"})
    single = _classifier_worker(0, 1, tiny)
    chunks = {"seven": (2, 2), "five": (2, 3), "one": (0, 1)}  # forwards (chunks) of rank 0 and rank 1
    for name, (n, _) in CASES.items():
        assert single[name]["classifier"].shape == (n, 64) and single[name]["classifier"].dtype == torch.float32
        assert single[name]["calls"] == (sum(chunks[name]),) * 2, "the second build tokenised again"
        for rank, r in enumerate(ranks):
            assert torch.equal(r[name]["classifier"], single[name]["classifier"]), (name, rank)
            assert r[name]["same_twice"] and r[name]["lockstep_equal"] and r[name]["zero3_equal"]
            assert r[name]["forwards"] == chunks[name][rank], (name, rank)
            assert r[name]["calls"] == (chunks[name][rank],) * 2, (name, rank, "tokenised again")
            assert r[name]["lockstep_forwards"] == r[name]["zero3_forwards"] == max(chunks[name]), (name, rank)


def test_classifier_is_the_normalised_mean_of_normalised_prompt_embeddings(tiny):
    """One process against a direct computation, one class a forward; any chunk size gives the same."""
    from recipe.zeroshot.classifier import class_chunks, rank_block, zero_shot_classifier

    model, tok = _load_tiny(tiny)
    prompts = ZeroShotPrompts(NAMES, TEMPLATES + ["{} in the wild."])
    with torch.no_grad():
        rows = []
        for class_prompts in prompts.prompts():
            t = tok(class_prompts)
            rows.append(F.normalize(F.normalize(model.encode_text(t["input_ids"], t["attention_mask"]), dim=-1)
                                    .float().mean(0), dim=-1))
    expected = torch.stack(rows)
    for max_prompts in (1, 3, 7, 2048):
        torch.testing.assert_close(zero_shot_classifier(model, prompts, tok, max_prompts=max_prompts), expected,
                                   atol=1e-6, rtol=0)
    assert class_chunks(7, 3, 7) == [(0, 2), (2, 4), (4, 6), (6, 7)] and class_chunks(2, 80, 10) == [(0, 1), (1, 2)]
    assert [rank_block(5, r, 2) for r in range(2)] == [(0, 2), (2, 5)]
    assert [rank_block(1, r, 3) for r in range(3)] == [(0, 0), (0, 0), (0, 1)]
    with pytest.raises(ValueError, match="without classes"):
        zero_shot_classifier(model, ZeroShotPrompts([]), tok)


def test_tokenised_prompts_are_cached_across_evaluations(tiny):
    """Two evaluations of the same prompts tokenise them once; other prompts, another tokenizer are
    tokenised anew; the cache goes with its tokenizer."""
    from recipe.evaluate import evaluate
    from recipe.zeroshot import classifier as C

    model, tok = _load_tiny(tiny)
    counting = CountingTokenizer(tok)
    prompts = ZeroShotPrompts(NAMES[:3], TEMPLATES)
    torch.manual_seed(1)
    loader = [{"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.tensor([0, 1, 2, 1])}]
    first = evaluate(model, loader, counting, prompts)
    assert counting.calls == 1 and "zeroshot_top1" in first
    assert evaluate(model, loader, counting, prompts) == first
    assert counting.calls == 1, "the second evaluation tokenised the prompts again"

    C.zero_shot_classifier(model, ZeroShotPrompts(NAMES[:3], TEMPLATES[:1]), counting)  # other templates
    C.zero_shot_classifier(model, ZeroShotPrompts(NAMES[:4], TEMPLATES), counting)  # other classes
    assert counting.calls == 3
    other = CountingTokenizer(tok)
    C.zero_shot_classifier(model, prompts, other)
    assert other.calls == 1 and counting.calls == 3
    for k in range(C.CACHED_PROMPT_SETS):  # the least recently used sets are dropped
        C.zero_shot_classifier(model, ZeroShotPrompts(NAMES[:1], [f"{k} {{}}"]), counting)
    C.zero_shot_classifier(model, prompts, counting)
    assert counting.calls == 4 + C.CACHED_PROMPT_SETS
    held = len(C._TOKENS)
    del other
    gc.collect()
    assert len(C._TOKENS) == held - 1
    C.clear_token_cache()
    C.zero_shot_classifier(model, prompts, counting)
    assert counting.calls == 5 + C.CACHED_PROMPT_SETS

    class Owner:  # a bound method is a new object at every access: cached by its object and function
        calls = 0

        def tokenize(self, texts):
            self.calls += 1
            return tok(texts)

    owner = Owner()
    for _ in range(2):
        C.zero_shot_classifier(model, prompts, owner.tokenize)
    assert owner.calls == 1 and len(C._TOKENS[owner]) == 1

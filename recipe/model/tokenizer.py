"""Text tokenisation without network access.

* :func:`train_tokenizer` trains a byte-level BPE tokenizer with ``tokenizers`` on an iterator of
  captions; :meth:`Tokenizer.save` writes it to a directory (to keep with the run).
* :func:`load_tokenizer` loads one from a local directory: one this module saved, any transformers
  tokenizer directory (``AutoTokenizer`` with ``local_files_only=True``), or a bare ``tokenizer.json``.
* :class:`Tokenizer` is called on a string or a list of strings and returns ``input_ids`` and
  ``attention_mask`` LongTensors of shape ``[B, context_length]``. Every row holds the end-of-text
  token at its last attended position, also when the caption was truncated.

Example::

    tok = train_tokenizer(captions, vocab_size=4096, context_length=32)
    tok.save(run_dir / "tokenizer")
    batch = tok(["a red circle", "a blue square"])
    model = create_model("tiny", tokenizer=tok)      # vocab size and token ids follow the tokenizer
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from tokenizers import Tokenizer as _HFTokenizer

logger = logging.getLogger(__name__)

__all__ = ["Tokenizer", "SpecialTokens", "train_tokenizer", "load_tokenizer", "METADATA_FILE"]

METADATA_FILE = "recipe_tokenizer.json"
"""File next to ``tokenizer.json`` recording the context length and special tokens."""

DEFAULT_CONTEXT_LENGTH = 77


@dataclass(frozen=True)
class SpecialTokens:
    """Special token strings.

    Attributes:
        bos: Start-of-text token, prepended to every sequence.
        eos: End-of-text token, the last attended token of every sequence.
        pad: Padding token.
    """

    bos: str = "<|startoftext|>"
    eos: str = "<|endoftext|>"
    pad: str = "<pad>"


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the CLIP conventions: fixed context, kept end-of-text token.

    Args:
        backend: The ``tokenizers.Tokenizer``. It is copied; its own truncation and padding are
            switched off (this class does both).
        special: Special token strings; each must be in the vocabulary.
        context_length: Length of every returned row.

    Raises:
        ValueError: a special token missing from the vocabulary or a context length below 2.
    """

    def __init__(self, backend: _HFTokenizer, special: SpecialTokens, context_length: int = DEFAULT_CONTEXT_LENGTH):
        if context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {context_length}")
        self.backend = _HFTokenizer.from_str(backend.to_str())
        self.backend.no_truncation()
        self.backend.no_padding()
        self.special = special
        self.context_length = int(context_length)
        ids = {}
        for role in ("bos", "eos", "pad"):
            token = getattr(special, role)
            token_id = self.backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
            ids[role] = token_id
        self.bos_token_id: int = ids["bos"]
        self.eos_token_id: int = ids["eos"]
        self.pad_token_id: int = ids["pad"]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (ids are ``0 .. vocab_size - 1``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def text_config_overrides(self) -> dict[str, int]:
        """transformers config attributes that make a text tower agree with this tokenizer."""
        return {
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }

    def encode(self, text: str) -> list[int]:
        """Token ids of one text with bos/eos, not truncated or padded."""
        return self._with_specials(self.backend.encode(text).ids)

    def _with_specials(self, ids: list[int]) -> list[int]:
        # Tokenizers whose post-processor does not add bos/eos (e.g. GPT-2's) get them here.
        if not ids or ids[0] != self.bos_token_id:
            ids = [self.bos_token_id] + ids
        if len(ids) < 2 or ids[-1] != self.eos_token_id:
            ids = ids + [self.eos_token_id]
        return ids

    def __call__(
        self,
        texts: str | Sequence[str],
        context_length: int | None = None,
        padding: str = "max_length",
    ) -> dict[str, torch.Tensor]:
        """Tokenises ``texts``.

        Args:
            texts: A string or a sequence of strings.
            context_length: Row length; defaults to ``self.context_length``.
            padding: ``"max_length"`` pads every row to the context length (CLIP); ``"longest"``
                pads to the longest row in the batch.

        Returns:
            ``{"input_ids": LongTensor[B, L], "attention_mask": LongTensor[B, L]}``. A text longer
            than the context is cut to ``L - 1`` tokens followed by the end-of-text token.

        Raises:
            TypeError: an element that is not a string.
            ValueError: an unknown padding mode.
        """
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"text {i} is {type(text).__name__}, not str")
        if padding not in ("max_length", "longest"):
            raise ValueError(f"padding must be 'max_length' or 'longest', got {padding!r}")
        length = int(context_length or self.context_length)
        if length < 2:
            raise ValueError(f"context_length must be >= 2, got {length}")
        rows = []
        for encoding in self.backend.encode_batch(texts):
            ids = self._with_specials(encoding.ids)
            if len(ids) > length:
                ids = ids[: length - 1] + [self.eos_token_id]
            rows.append(ids)
        width = length if padding == "max_length" else max((len(r) for r in rows), default=2)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Text of a row of ids (padding and special tokens dropped by default)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | os.PathLike) -> Path:
        """Writes ``tokenizer.json``, ``tokenizer_config.json`` (loadable by transformers'
        ``AutoTokenizer``) and :data:`METADATA_FILE` into ``directory``; returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        hf_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.special.bos,
            "eos_token": self.special.eos,
            "pad_token": self.special.pad,
            "model_max_length": self.context_length,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(hf_config, indent=2))
        meta = {
            "format": 1,
            "context_length": self.context_length,
            "bos_token": self.special.bos,
            "eos_token": self.special.eos,
            "pad_token": self.special.pad,
        }
        (directory / METADATA_FILE).write_text(json.dumps(meta, indent=2))
        return directory


def _clean_texts(texts: Iterable[Any], counter: dict[str, int]) -> Iterator[str]:
    for text in texts:
        if isinstance(text, str) and text.strip():
            counter["used"] += 1
            yield text
        else:
            counter["skipped"] += 1


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    min_frequency: int = 2,
    lowercase: bool = True,
    special: SpecialTokens = SpecialTokens(),
) -> Tokenizer:
    """Trains a byte-level BPE tokenizer on captions.

    The special tokens get ids 0 (pad), 1 (bos), 2 (eos); the 256 byte symbols follow, so any
    text encodes without unknown tokens and decodes back to itself (after NFC normalisation and,
    by default, lower-casing, as CLIP does). Non-string and blank items are skipped and counted in
    a log message.

    Args:
        texts: An iterable of captions (read once).
        vocab_size: Target vocabulary size including the special tokens (at least 259). A small
            corpus may end with fewer tokens; ``Tokenizer.vocab_size`` tells the real number.
        context_length: Row length of the returned tokenizer.
        min_frequency: Minimum count of a pair to be merged.
        lowercase: Lower-case text before tokenising.
        special: Special token strings.

    Returns:
        The trained tokenizer.

    Raises:
        ValueError: ``vocab_size`` too small or no usable text.
    """
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + 3
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (3 special tokens + 256 bytes), got {vocab_size}")
    backend = _HFTokenizer(models.BPE())
    norm = [normalizers.NFC()] + ([normalizers.Lowercase()] if lowercase else [])
    backend.normalizer = normalizers.Sequence(norm)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[special.pad, special.bos, special.eos],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    counter = {"used": 0, "skipped": 0}
    backend.train_from_iterator(_clean_texts(texts, counter), trainer=trainer)
    if counter["skipped"]:
        logger.warning("tokenizer training skipped %d non-string or blank captions", counter["skipped"])
    if counter["used"] == 0:
        raise ValueError("no non-empty string captions to train the tokenizer on")
    bos_id, eos_id = backend.token_to_id(special.bos), backend.token_to_id(special.eos)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{special.bos} $A {special.eos}",
        special_tokens=[(special.bos, bos_id), (special.eos, eos_id)],
    )
    logger.info("trained a BPE tokenizer of %d tokens on %d captions", backend.get_vocab_size(), counter["used"])
    return Tokenizer(backend, special, context_length)


def _special_from_transformers(tok: Any) -> SpecialTokens:
    """bos/eos/pad of a transformers tokenizer; BERT-likes use [CLS]/[SEP]."""
    bos = tok.bos_token or tok.cls_token
    eos = tok.eos_token or tok.sep_token
    pad = tok.pad_token or eos
    if bos is None or eos is None:
        raise ValueError(f"{type(tok).__name__} defines no bos/cls or eos/sep token")
    return SpecialTokens(bos=str(bos), eos=str(eos), pad=str(pad))


def load_tokenizer(
    directory: str | os.PathLike,
    context_length: int | None = None,
    special: SpecialTokens | None = None,
) -> Tokenizer:
    """Loads a tokenizer from a local directory (never the network).

    Looks for, in order: :data:`METADATA_FILE` + ``tokenizer.json`` (written by
    :meth:`Tokenizer.save`); a transformers tokenizer (``tokenizer_config.json``, loaded with
    ``AutoTokenizer``, special tokens taken from it, BERT's [CLS]/[SEP] as bos/eos); a bare
    ``tokenizer.json`` (then ``special`` is required).

    Args:
        directory: The directory.
        context_length: Row length; defaults to the saved one, else 77.
        special: Special tokens overriding the discovered ones.

    Returns:
        The tokenizer.

    Raises:
        FileNotFoundError: the directory or its tokenizer files are missing.
        ValueError: special tokens cannot be determined or are not in the vocabulary.
    """
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    meta_path, json_path = path / METADATA_FILE, path / "tokenizer.json"
    if meta_path.is_file() and json_path.is_file():
        meta = json.loads(meta_path.read_text())
        found = SpecialTokens(bos=meta["bos_token"], eos=meta["eos_token"], pad=meta["pad_token"])
        return Tokenizer(
            _HFTokenizer.from_file(str(json_path)),
            special or found,
            int(context_length or meta["context_length"]),
        )
    if (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{path}: {type(hf).__name__} has no `tokenizers` backend")
        found = _special_from_transformers(hf)
        return Tokenizer(backend, special or found, int(context_length or DEFAULT_CONTEXT_LENGTH))
    if json_path.is_file():
        if special is None:
            raise ValueError(f"{path} has a bare tokenizer.json; pass special=SpecialTokens(...)")
        return Tokenizer(_HFTokenizer.from_file(str(json_path)), special, int(context_length or DEFAULT_CONTEXT_LENGTH))
    raise FileNotFoundError(f"{path} holds no tokenizer.json or tokenizer_config.json")

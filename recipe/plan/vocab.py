"""The run's tokenizer as far as it shapes the model: vocabulary size, context length, special-token ids.

``recipe.train`` sizes the text tower's token embedding from its tokenizer
(:func:`recipe.model.create_model` with ``tokenizer=``): the ``--tokenizer DIR`` it loads, or a
byte-level BPE it trains on the training captions with *at most* ``--vocab-size`` tokens -- on a
small corpus far fewer (the demo's captions: 364 tokens of 2,048, which makes the tiny preset 247,233
parameters rather than the 486,081 of its text tower's own 4,096-token vocabulary). The planner makes
that tokenizer as :func:`recipe.train.get_tokenizer` does, from the same functions
(:func:`recipe.data.read_captions`, :func:`recipe.model.tokenizer.train_tokenizer`,
:func:`recipe.model.tokenizer.load_tokenizer`; ``tests/recipe/test_plan.py`` checks the parameter count
against the model ``recipe.train`` builds), wherever it can see the data; without data the vocabulary
is ``--vocab-size``, an upper bound, and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TRAINED_CONTEXT_LENGTH", "TokenizerShape", "run_tokenizer", "vocabulary_note"]

#: Context length of a tokenizer ``recipe.train.get_tokenizer`` trains when ``--context-length`` is unset.
TRAINED_CONTEXT_LENGTH = 32


@dataclass(frozen=True)
class TokenizerShape:
    """What of a tokenizer :func:`recipe.model.create_model` reads (it takes this in place of the
    tokenizer itself): the vocabulary size, the context length and the special-token ids.

    ``source`` says where it comes from; ``upper_bound`` marks a vocabulary the run's trained
    tokenizer may fall short of. Neither changes the model, so neither takes part in comparisons.
    """

    vocab_size: int
    context_length: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    source: str = field(default="", compare=False)
    upper_bound: bool = field(default=False, compare=False)

    @classmethod
    def of(cls, tokenizer: Any, source: str, vocab_size: int | None = None) -> TokenizerShape:
        """The shape of a :class:`recipe.model.tokenizer.Tokenizer`; ``vocab_size`` given: an upper bound of that
        size."""
        return cls(
            vocab_size=int(vocab_size or tokenizer.vocab_size), context_length=int(tokenizer.context_length),
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, source=source, upper_bound=vocab_size is not None,
        )

    def text_config_overrides(self) -> dict[str, int]:
        """As :meth:`recipe.model.tokenizer.Tokenizer.text_config_overrides`."""
        return {"vocab_size": self.vocab_size, "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}


def _data_config(train_data: str | None, **given: Any) -> Any:
    """``recipe.train``'s data settings: ``train_data`` and the ``given`` values that are set, its
    defaults (``--vocab-size`` included) for the rest."""
    from recipe.config import DataConfig

    kw = {k: v for k, v in given.items() if v is not None}
    return DataConfig(**kw) if train_data is None else DataConfig(train_data=train_data, **kw)


def _upper_bound(data: Any, hint: str) -> TokenizerShape:
    """The tokenizer ``recipe.train`` would train, with ``--vocab-size`` tokens (its ids and context
    length from a tokenizer trained the same way on one caption); ``hint`` says how to count it."""
    from recipe.model.tokenizer import train_tokenizer

    tok = train_tokenizer(["a"], data.vocab_size, context_length=data.context_length or TRAINED_CONTEXT_LENGTH)
    return TokenizerShape.of(tok, hint, vocab_size=data.vocab_size)


def run_tokenizer(
    train_data: str | None,
    *,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    context_length: int | None = None,
    data_format: str | None = None,
    caption_column: str | None = None,
    count: bool = True,
) -> TokenizerShape:
    """The tokenizer a ``recipe.train`` run with these flags ends up with, made as
    :func:`recipe.train.get_tokenizer` makes it: loaded from ``tokenizer``, or trained on the captions
    of ``train_data`` (every caption is read). Without data (or with ``count=False``), a tokenizer of
    ``vocab_size`` tokens (default: ``recipe.train``'s), marked as an upper bound.

    Raises:
        ValueError: Data or a tokenizer directory that cannot be read (missing, bad format or column).
    """
    from recipe.data import read_captions
    from recipe.model.tokenizer import load_tokenizer, train_tokenizer

    data = _data_config(train_data, tokenizer=tokenizer, vocab_size=vocab_size, context_length=context_length,
                        data_format=data_format, caption_column=caption_column)
    if tokenizer is None and (train_data is None or not count):
        hint = "give --train-data to count it" if train_data is None else "--count-vocab counts it"
        return _upper_bound(data, hint)
    try:
        if tokenizer:
            tok = load_tokenizer(tokenizer, context_length=data.context_length)
        else:
            context = data.context_length or TRAINED_CONTEXT_LENGTH
            tok = train_tokenizer(read_captions(data), data.vocab_size, context_length=context)
    except (FileNotFoundError, ValueError, OSError) as e:
        what = f"--tokenizer {tokenizer}" if tokenizer else f"the captions of --train-data {train_data}"
        raise ValueError(
            f"cannot read {what} to size the vocabulary as the run will: {e}"
            + ("" if tokenizer else " (give --data-format/--caption-column as to recipe.train, or "
               "--no-count-vocab to plan with --vocab-size as an upper bound)")
        ) from e
    if tokenizer:
        return TokenizerShape.of(tok, f"the tokenizer in {tokenizer}")
    return TokenizerShape.of(tok, f"the BPE recipe.train trains on the captions of {train_data}, "
                                  f"--vocab-size {data.vocab_size}")


def vocabulary_note(shape: TokenizerShape | None, vocab: int, flag: int | None = None) -> str:
    """One line on the model's vocabulary ``vocab``: where it comes from, and whether it is exact."""
    if shape is None:
        return f"{vocab:,} tokens (" + ("--vocab-size)" if flag else "the text tower's own)")
    if vocab != shape.vocab_size:  # recipe.model: a tower with pretrained weights keeps its vocabulary
        return f"{vocab:,} tokens (the pretrained text tower's own)"
    if shape.upper_bound:
        return (f"at most {vocab:,} tokens (--vocab-size, an upper bound: the tokenizer the run trains on its "
                f"captions may be much smaller; {shape.source})")
    return f"{vocab:,} tokens ({shape.source})"

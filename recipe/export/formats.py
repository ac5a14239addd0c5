"""What the format modules share with the package: the error a format raises for a model it cannot represent
(:class:`UnsupportedExport`) and what reading a directory gives (:class:`Imported`). Defined here, below
:mod:`recipe.export` and its format modules (:mod:`.open_clip`, :mod:`.open_clip_read`, :mod:`.hf`), so that
they import it from here and the package imports them: the arrows go one way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.clip import CLIPConfig
from ..model.tokenizer import Tokenizer

__all__ = ["Imported", "UnsupportedExport"]


class UnsupportedExport(ValueError):
    """The model cannot be represented exactly in the requested format; the message says what is missing."""


@dataclass
class Imported:
    """A pretrained model read into the recipe's terms (what ``--init-from`` starts from).

    Attributes:
        config: The recipe's model config (the architecture).
        state_dict: Weights under the recipe model's parameter names (fp32).
        tokenizer: The tokenizer that goes with the weights.
        source: ``open_clip``, ``hf`` or ``recipe``, and the directory, for messages.
    """

    config: CLIPConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str

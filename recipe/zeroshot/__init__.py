"""Zero-shot classification prompts: class names and templates, where to find them, ImageNet-1k built in.

A zero-shot prompt file (``zeroshot.json``, found next to a dataset or named by ``--zeroshot``) is::

    {"classnames": ["cat", "dog"], "templates": ["a photo of a {}."]}

class ``i`` being ``classnames[i]``: the label index of a labelled table (CSV, parquet, ...) or, for
a folder of class subfolders (``DIR/<class>/*.jpg``), the ``i``-th subfolder in sorted order (every
class then needs its folder). Or, naming the classes by folder::

    {"classnames": {"n01440764": "tench", "n01443537": "goldfish"}, "templates": "openai"}

class ``i`` being the ``i``-th entry: an image in folder ``n01443537`` is class 1, whichever of the
folders are present, and a folder the file does not name is an error. Every template holds a ``{}``
(or ``{c}``) placeholder for the class name; ``"templates": "openai"`` stands for the 80 templates
of the CLIP paper (:data:`OPENAI_IMAGENET_TEMPLATES`).

``--zeroshot imagenet`` is the built-in ImageNet-1k set (:func:`imagenet_prompts`): the 1000 WordNet
ids in their standard sorted order (:data:`IMAGENET_WNIDS`, ``n01440764`` ... ``n15075141``: the
class folders of an ImageNet-style folder), the class names of the CLIP paper's evaluation
(:data:`IMAGENET_CLASSNAMES`) and its 80 templates. That name list calls two pairs of different
classes alike, ``missile`` (classes 657 and 744) and ``sunglasses`` (836 and 837). They are kept as
published, so that the accuracies compare with the CLIP paper's and OpenCLIP's: the two classes of
a pair get the same classifier row, so at most one of them wins top-1 for an image (which one is
the tie-break of ``torch.topk``) while both enter the top-5 together.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

from recipe.data.formats import expand_paths

from .imagenet_data import CLASSNAMES as IMAGENET_CLASSNAMES
from .imagenet_data import TEMPLATES as OPENAI_IMAGENET_TEMPLATES
from .imagenet_data import WNIDS as IMAGENET_WNIDS

#: File name of the zero-shot class names and prompt templates next to a dataset.
ZEROSHOT_FILENAME = "zeroshot.json"
#: The ``--zeroshot`` value of the built-in ImageNet-1k prompts.
IMAGENET = "imagenet"
#: ``"templates": "openai"`` in a prompt file: :data:`OPENAI_IMAGENET_TEMPLATES`.
OPENAI_TEMPLATES_NAME = "openai"

_IMAGENET_INDEX = {w: i for i, w in enumerate(IMAGENET_WNIDS)}


@dataclass
class ZeroShotPrompts:
    """Class names and prompt templates for zero-shot classification.

    Attributes:
        classnames: Name of class ``i`` at index ``i``.
        templates: Prompt templates with a ``{}`` (or ``{c}``) placeholder for the class name.
        folders: Folder name of class ``i`` at index ``i`` (e.g. its WordNet id), for folders of class
            subfolders; None: the classes are the subfolders in sorted order.
        name: Prefix of the metric names (``imagenet_top1``...; ``zeroshot`` for a prompt file).
    """

    classnames: list[str]
    templates: list[str] = field(default_factory=lambda: ["a photo of a {}."])
    folders: list[str] | None = None
    name: str = "zeroshot"

    def __post_init__(self) -> None:
        if self.folders is not None and len(self.folders) != len(self.classnames):
            raise ValueError(f"{len(self.folders)} folder names for {len(self.classnames)} classes")
        if self.folders is not None and len(set(self.folders)) != len(self.folders):
            raise ValueError("folder names of the classes must be unique")

    def prompts(self, start: int = 0, stop: int | None = None) -> list[list[str]]:
        """``prompts()[i]`` are the prompts of class ``i``, one per template; ``prompts(a, b)`` those of
        classes ``a .. b-1``."""
        return [[t.replace("{c}", c).replace("{}", c) for t in self.templates] for c in self.classnames[start:stop]]

    def class_index(self) -> dict[str, int] | None:
        """``{folder name: class index}``; None when the classes are not named by folder."""
        return None if self.folders is None else {f: i for i, f in enumerate(self.folders)}


def imagenet_prompts() -> ZeroShotPrompts:
    """The built-in ImageNet-1k prompts: 1000 classes in WordNet-id order, 80 templates each."""
    return ZeroShotPrompts(
        list(IMAGENET_CLASSNAMES), list(OPENAI_IMAGENET_TEMPLATES), list(IMAGENET_WNIDS), name=IMAGENET
    )


def imagenet_class_index(wnid: str) -> int:
    """The ImageNet-1k class index (0-999) of a WordNet id such as ``n01440764`` (a class folder's name).

    Raises:
        KeyError: ``wnid`` is not one of the 1000 ImageNet-1k classes.
    """
    try:
        return _IMAGENET_INDEX[wnid]
    except KeyError:
        raise KeyError(f"{wnid!r} is not an ImageNet-1k class (a WordNet id such as 'n01440764')") from None


def _check_templates(templates: object, where: str) -> list[str]:
    if templates == OPENAI_TEMPLATES_NAME:
        return list(OPENAI_IMAGENET_TEMPLATES)
    if (
        not isinstance(templates, list)
        or not templates
        or not all(isinstance(t, str) and ("{}" in t or "{c}" in t) for t in templates)
    ):
        raise ValueError(
            f"{where}: 'templates' must be a non-empty list of strings with a '{{}}' placeholder, or 'openai'"
        )
    return list(templates)


def load_zeroshot_prompts(path: str | os.PathLike) -> ZeroShotPrompts:
    """Read a zero-shot prompt file (``classnames`` as a list, or a mapping from folder names).

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: Missing or malformed fields.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"zero-shot prompt file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a JSON object with 'classnames' and 'templates'")
    names, folders = spec.get("classnames"), None
    if isinstance(names, dict):
        folders, names = list(names), list(names.values())
        if not all(folders):
            raise ValueError(f"{path}: the folder names (keys of 'classnames') must not be empty")
    if not names or not isinstance(names, list) or not all(isinstance(c, str) and c for c in names):
        raise ValueError(
            f"{path}: 'classnames' must be a non-empty list of strings or a mapping from folder names to them"
        )
    return ZeroShotPrompts(list(names), _check_templates(spec.get("templates"), path), folders)


def get_zeroshot_prompts(spec: str | os.PathLike) -> ZeroShotPrompts:
    """``"imagenet"`` (:func:`imagenet_prompts`) or the path of a prompt file (:func:`load_zeroshot_prompts`)."""
    if os.fspath(spec) == IMAGENET:
        return imagenet_prompts()
    return load_zeroshot_prompts(spec)


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


__all__ = [
    "IMAGENET",
    "IMAGENET_CLASSNAMES",
    "IMAGENET_WNIDS",
    "OPENAI_IMAGENET_TEMPLATES",
    "ZEROSHOT_FILENAME",
    "ZeroShotPrompts",
    "find_zeroshot_file",
    "get_zeroshot_prompts",
    "imagenet_class_index",
    "imagenet_prompts",
    "load_zeroshot_prompts",
]

"""The zero-shot classifier: every class's prompts embedded by the text tower, the work shared by the ranks.

:func:`zero_shot_classifier` returns ``[num_classes, D]`` class embeddings, row ``i`` the normalised
mean of class ``i``'s normalised template embeddings (the CLIP paper's prompt ensembling; ImageNet:
1000 classes x 80 templates = 80,000 prompts).

How the work is split:

* The classes are embedded in *chunks* of ``max(1, max_prompts // templates)`` whole classes, one
  forward per chunk (a class's templates are averaged together, so they stay in one forward). The
  chunks are one fixed grid over the classes, the same at every world size.
* Under an initialised process group rank ``r`` of ``W`` embeds the contiguous block of chunks
  ``C*r//W .. C*(r+1)//W`` (``C`` chunks; blocks differ by at most one chunk, a rank may get none when
  ``C < W``). Every forward therefore sees the same prompts, in the same batch, at every world size,
  and the gathered classifier is bit-identical to one process's.
* The blocks meet in one ``all_gather`` of equal-size tensors, each block zero-padded to the largest
  and trimmed after. Every rank knows every block's size from the grid, so no sizes are exchanged;
  only when some rank has no chunk is the width ``D`` agreed first (one small ``all_reduce``).
* ZeRO-3: a text tower whose parameters are partitioned (DeepSpeed's ``ds_id`` on them) runs a
  collective in every forward, so every rank must call it equally often: there ranks with fewer
  chunks than the largest block run one-prompt dummy forwards (results dropped) until they have run
  as many (``lockstep``). The recipe's own evaluation never hands in such a module: under ZeRO-3
  it evaluates a gathered full copy (:func:`recipe.training.engine.eval_module`, ``ModelEMA.eval_module``),
  whose forward is local; the padding covers a partitioned module passed in directly.

Tokenised prompts are cached in this process, per tokenizer (held weakly: the cache goes with it) and
prompt set (class names, templates, the tokenizer's context length), per chunk: a run tokenises each
of its rank's chunks once, not at every evaluation (the classifier itself is rebuilt every time: the
weights change between evaluations). Tokens are kept for the :data:`CACHED_PROMPT_SETS` prompt sets
used last per tokenizer (ImageNet at context 77: about 100 MB of int64 ids and mask, shared out over
the ranks). There is no cache file: training evaluates in one process, and a standalone evaluation
tokenises once anyway.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipe.training.distributed import rank_world

from . import ZeroShotPrompts

__all__ = [
    "CACHED_PROMPT_SETS",
    "class_chunks",
    "clear_token_cache",
    "rank_block",
    "zero_shot_classifier",
]

#: Prompt sets whose tokens are kept per tokenizer (the most recently used).
CACHED_PROMPT_SETS = 4

# tokenizer (weakly) -> OrderedDict[prompt-set key -> {(first class, end class) or "dummy": (ids, mask)}]
_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def clear_token_cache() -> None:
    """Forgets every cached tokenised prompt."""
    _TOKENS.clear()


def class_chunks(num_classes: int, num_templates: int, max_prompts: int = 2048) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the classes of each forward, ``max(1, max_prompts // num_templates)`` a chunk."""
    step = max(1, max_prompts // max(1, num_templates))
    return [(s, min(num_classes, s + step)) for s in range(0, num_classes, step)]


def rank_block(num_chunks: int, rank: int, world: int) -> tuple[int, int]:
    """``(first chunk, end chunk)`` of rank ``rank`` of ``world``: contiguous, sizes differ by at most one."""
    return num_chunks * rank // world, num_chunks * (rank + 1) // world


def _partitioned(model: Any) -> bool:
    """Whether ``model`` holds ZeRO-3 partitioned parameters (its forward is then a collective)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _token_store(tokenize: Any, prompts: ZeroShotPrompts) -> dict | None:
    """This prompt set's chunk -> tokens dict for ``tokenize``; None when ``tokenize`` cannot be held
    weakly (no cache then)."""
    owner, func = tokenize, None
    if inspect.ismethod(tokenize):  # a bound method is a new object at every attribute access
        owner, func = tokenize.__self__, tokenize.__func__
    try:
        sets = _TOKENS.get(owner)
        if sets is None:
            sets = _TOKENS[owner] = OrderedDict()
    except TypeError:  # not weakly referenceable or not hashable
        return None
    key = (func, tuple(prompts.classnames), tuple(prompts.templates), getattr(owner, "context_length", None))
    store = sets.get(key)
    if store is None:
        store = sets[key] = {}
        while len(sets) > CACHED_PROMPT_SETS:
            sets.popitem(last=False)
    sets.move_to_end(key)
    return store


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(None, file=sys.stderr, dynamic_ncols=True, desc="zero-shot classifier", unit="class", total=total)


def _gather_blocks(local: torch.Tensor | None, sizes: list[int], device: torch.device) -> torch.Tensor:
    """The ranks' ``[sizes[r], D]`` blocks, in rank order, from one ``all_gather`` of padded blocks."""
    if min(sizes) == 0:  # a rank without classes does not know D
        width = torch.tensor([0 if local is None else local.shape[1]], dtype=torch.long, device=device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        dim = int(width.item())
    else:
        dim = local.shape[1]  # type: ignore[union-attr]
    padded = torch.zeros(max(sizes), dim, dtype=torch.float32, device=device)
    if local is not None:
        padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


@torch.no_grad()
def zero_shot_classifier(
    model: Any,
    prompts: ZeroShotPrompts,
    tokenize: Any,
    max_prompts: int = 2048,
    progress: bool = False,
    lockstep: bool | None = None,
) -> torch.Tensor:
    """``[num_classes, D]`` fp32 class embeddings on the model's device: the normalised mean of each
    class's normalised template embeddings (as in the CLIP paper's prompt ensembling).

    Up to ``max_prompts`` prompts (whole classes, at least one) a forward; under an initialised process
    group each rank embeds a contiguous block of the classes and the blocks are gathered, the result
    bit-identical to one process's (see the module's documentation). Every rank must call it.

    Args:
        model: Has ``encode_text(input_ids, attention_mask)`` and parameters (their device is used).
        prompts: The class names and templates.
        tokenize: ``tokenize(list_of_str)`` -> ``{"input_ids", "attention_mask"}``; its results are
            cached per tokenizer and prompt set.
        max_prompts: Prompts a forward at most (rounded down to whole classes).
        progress: A progress bar on stderr.
        lockstep: Every rank runs as many forwards as the rank with the most chunks (one-prompt dummy
            forwards); default: when the model's parameters are ZeRO-3 partitioned.

    Raises:
        ValueError: No classes.
    """
    if not prompts.classnames:
        raise ValueError("zero-shot prompts without classes")
    device = next(model.parameters()).device
    t = len(prompts.templates)
    chunks = class_chunks(len(prompts.classnames), t, max_prompts)
    rank, world = rank_world()
    blocks = [rank_block(len(chunks), r, world) for r in range(world)]
    first, end = blocks[rank]
    if lockstep is None:  # ZeRO-3 partitioned tower: its forward is a collective, so pad with dummy forwards
        lockstep = world > 1 and _partitioned(model)
    forwards = max(e - f for f, e in blocks) if lockstep else end - first

    store = _token_store(tokenize, prompts)

    def tokens(key: Any, texts: Any) -> tuple[torch.Tensor, torch.Tensor]:
        found = None if store is None else store.get(key)
        if found is None:
            tok = tokenize(texts())
            found = (tok["input_ids"], tok["attention_mask"])
            if store is not None:
                store[key] = found
        return found

    def chunk_prompts(start: int, stop: int) -> Any:
        return lambda: [p for class_prompts in prompts.prompts(start, stop) for p in class_prompts]

    rows = []
    bar = _progress(progress, sum(s - a for a, s in chunks[first:end]))
    for i in range(forwards):
        if first + i < end:
            start, stop = chunks[first + i]
            ids, mask = tokens((start, stop), chunk_prompts(start, stop))
            emb = model.encode_text(ids.to(device), mask.to(device)).float()
            rows.append(F.normalize(emb.view(stop - start, t, -1).mean(1), dim=-1))
            if bar is not None:
                bar.update(stop - start)
        else:  # lockstep: a forward whose result is dropped, so that every rank runs as many
            ids, mask = tokens("dummy", lambda: chunk_prompts(0, 1)()[:1])
            model.encode_text(ids[:1].to(device), mask[:1].to(device))
    if bar is not None:
        bar.close()
    local = torch.cat(rows) if rows else None
    if world == 1:
        return local  # type: ignore[return-value]
    sizes = [chunks[e - 1][1] - chunks[f][0] if e > f else 0 for f, e in blocks]
    return _gather_blocks(local, sizes, device)

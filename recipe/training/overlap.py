"""The recipe-managed routes' gradient all-reduce, overlapped with the step's last backward pass.

On the recipe-managed routes (bf16 and fp16 at ZeRO stage 0: :mod:`recipe.training.precision`) every
rank holds the whole model and the recipe averages the gradients itself. Done after the backward,
the communication would add its whole time to the step. :class:`OverlappedAllReduce` starts it
during the last backward pass instead, as PyTorch's DDP does: the gradients are cut into buckets in
the reverse order of the parameters (about the order in which backward produces them), a hook on each
parameter counts its gradient in, and a bucket whose gradients are all complete is flattened,
converted to the reduction dtype and all-reduced asynchronously while backward goes on.
:meth:`OverlappedAllReduce.finish` sends what did not become ready (parameters outside this
backward's graph: the logit scale, whose gradient the global passes give in their first backward),
waits, and gives every parameter its mean gradient.

* Order: every rank must issue the same collectives in the same order. Buckets are sent strictly in
  their index order (a ready bucket waits for all lower ones), so the order never depends on when a
  rank's hooks fire.
* Results: each element is summed over the ranks in the reduction dtype and divided by the world size
  there, then rounded to the gradients' dtype; the grouping into buckets does not change an
  element's sum (an element-wise reduction; tests compare with an all-reduce after backward).
* Only the backward inside :meth:`OverlappedAllReduce.last_backward` sends; the earlier micro-batches'
  backwards accumulate locally, as without overlap.
* Memory: a bucket's gradients are released as it is sent (their values are in the bucket), and at
  :meth:`finish` the gradients become views of the buckets' means: with the reduction in the
  gradients' dtype (``communication_data_type: bf16`` for bf16 gradients, the shipped JSON) nothing
  is held beyond one bucket's copy while it is made; a wider reduction dtype holds the difference
  (fp32 sums of bf16 gradients: 2 bytes per parameter) until :meth:`finish`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .precision import sum_dtype

__all__ = ["OverlappedAllReduce", "BUCKET_BYTES", "reducer_for"]

BUCKET_BYTES = 25 * 2**20  # DDP's default: large enough for bandwidth, small enough to start early
#: The CLIP model's parameters whose gradients the global passes give in their first backward, not the last
LATE_PARAMETERS = ("logit_scale", "logit_bias")


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    ready: int = 0  # parameters of this bucket whose gradient the armed backward completed
    flat: torch.Tensor | None = None  # the gradients, flat, in the reduction dtype (sent)
    sent: list[torch.Tensor] = field(default_factory=list)  # the parameters whose gradients flat holds
    work: Any = None  # the asynchronous all-reduce


class OverlappedAllReduce:
    """Averages the gradients of ``params`` over the ranks of ``group``, sending buckets during the
    backward pass run inside :meth:`last_backward` and finishing in :meth:`finish`.

    Args:
        params: The replicated parameters (those without ``requires_grad`` are left out).
        reduce_dtype: The dtype the sums are taken in (:attr:`Precision.reduce_dtype`); ``None``: fp32
            for bf16 gradients, the gradients' own dtype otherwise.
        bucket_bytes: Gradient bytes per bucket (in the parameters' dtype).
        group: The process group (default: the world).
        late: Those of ``params`` whose gradient the last backward may not produce (the logit scale and
            bias: the global passes give theirs in the first backward): a bucket of their own, sent
            last, so that no other bucket waits for them.
    """

    def __init__(self, params: Sequence[torch.Tensor], reduce_dtype: torch.dtype | None = None,
                 bucket_bytes: int = BUCKET_BYTES, group: Any = None, late: Sequence[torch.Tensor] = ()) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("OverlappedAllReduce needs an initialised process group")
        self.group = group
        self.world = dist.get_world_size(group)
        self.reduce_dtype = reduce_dtype
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        open_by_dtype: dict[tuple, tuple[_Bucket, int]] = {}
        late_ids = {id(p) for p in late}
        ordered = [p for p in reversed(params) if id(p) not in late_ids] + [p for p in params if id(p) in late_ids]
        for p in (p for p in ordered if p.requires_grad):
            key = (p.dtype, id(p) in late_ids)
            bucket, size = open_by_dtype.get(key, (None, 0))
            if bucket is None or size >= bucket_bytes:
                bucket, size = _Bucket([]), 0
                self.buckets.append(bucket)
            bucket.params.append(p)
            open_by_dtype[key] = (bucket, size + p.numel() * p.element_size())
            self._bucket_of[id(p)] = bucket
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for b in self.buckets for p in b.params]
        self._armed = False
        self._next = 0  # the lowest bucket not sent yet

    def close(self) -> None:
        """Removes the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @contextlib.contextmanager
    def last_backward(self) -> Iterator[None]:
        """Sends buckets as the backward pass inside completes them (the step's last backward)."""
        if self._next or any(b.ready or b.work is not None for b in self.buckets):
            raise RuntimeError("OverlappedAllReduce: finish() was not called after the previous step")
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._send(self.buckets[self._next])
            self._next += 1

    def _send(self, bucket: _Bucket) -> None:
        import torch.distributed as dist

        bucket.sent = [p for p in bucket.params if p.grad is not None]
        if not bucket.sent:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in bucket.sent])
        dtype = sum_dtype(flat.dtype, self.reduce_dtype)
        bucket.flat = flat if flat.dtype == dtype else flat.to(dtype)
        for p in bucket.sent:  # their values are in the bucket now: the memory goes back at once
            p.grad = None
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> int:
        """Sends the buckets not sent yet (in order), waits for all, and gives each parameter its gradient's
        mean over the ranks (a view of its bucket, in the gradient's dtype). Returns how many buckets were
        sent during backward (for measurements)."""
        overlapped = self._next
        for bucket in self.buckets[self._next:]:
            self._send(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # the collective's completion (on a GPU: the stream waits, not the host)
                bucket.flat.div_(self.world)
                grad_dtype = bucket.sent[0].dtype  # a bucket holds one dtype
                means = bucket.flat if bucket.flat.dtype == grad_dtype else bucket.flat.to(grad_dtype)
                offset = 0
                for p in bucket.sent:  # the gradients become views of the bucket (contiguous, p's shape)
                    p.grad = means[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
            bucket.ready, bucket.flat, bucket.sent, bucket.work = 0, None, [], None
        self._next = 0
        return overlapped


_REDUCERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its reducer (or None)


def reducer_for(engine: Any, reduce_dtype: torch.dtype | None) -> OverlappedAllReduce | None:
    """The overlapped all-reduce of ``engine``'s replicated module (made on first use, one per engine), or
    None when there is nothing to reduce (no process group, or one rank). Only for the recipe-managed
    routes, whose gradients the recipe averages itself (the caller decides that)."""
    import torch.distributed as dist

    if engine in _REDUCERS:
        return _REDUCERS[engine]
    reducer = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        named = list(engine.module.named_parameters())
        late = [p for name, p in named if name in LATE_PARAMETERS]
        reducer = OverlappedAllReduce([p for _, p in named], reduce_dtype, BUCKET_BYTES, late=late)
    _REDUCERS[engine] = reducer
    return reducer

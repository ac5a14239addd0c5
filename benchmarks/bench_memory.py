"""Measured memory per parameter: weights, gradients and optimizer state of the live engine.

For each precision mode (:data:`MODES`: every ``ds_configs`` JSON, plus DeepSpeed's standard bf16
mixed precision, i.e. the same JSON without ``bf16_master_weights_and_grads`` /
``bf16_optimizer_states`` and with ``torch.optim.AdamW``, and the recipe with the image tower SR
too), a preset (``tiny`` by default) is trained for two steps under DeepSpeed on ``--world``
ranks (CPU processes with gloo, or ``--device cuda``: one GPU per rank with NCCL). Between the second backward and
the second optimizer step, when gradients, weights and optimizer state are all alive, every rank
reads what it holds:

* weights, partitions and optimizer state: :func:`recipe.training.memory.live_bytes_per_param` (the
  module's parameters, or their ZeRO-3 shards; the flat partitions DeepSpeed hands the optimizer;
  the optimizer's state tensors), per group;
* gradients: every distinct storage among the module parameters' ``.grad``, the partitions'
  ``.grad`` and the tensors the ZeRO optimizer keeps under a name containing ``grad`` (its
  flat gradient partitions and accumulation buffers), minus storages already counted above;
* buffers: tensors the ZeRO optimizer keeps under a name containing ``ipg`` (reduce buckets sized
  by ``reduce_bucket_size``, independent of the model) in absolute bytes;
* a completeness check: every tensor storage the garbage collector can see in the process, minus
  the inputs, is compared with the storages classified above; ``unaccounted`` is what is left
  (activations are freed by then; gloo and DeepSpeed scratch buffers show up here).

Bytes are storage sizes (``untyped_storage().nbytes()``), so ZeRO's alignment padding and the
whole buffer behind a view are counted; divided by the model's parameter count, per rank.

Usage::

    python benchmarks/bench_memory.py                      # all modes, 2 CPU ranks
    python benchmarks/bench_memory.py --modes zero2_bf16_halfmaster zero2_bf16_standard --world 2
    python benchmarks/bench_memory.py --preset ViT-B-32 --batch 2     # the real model, ~6 GB of RAM
    python benchmarks/bench_memory.py --device cuda --world 1 --preset ViT-B-32 --batch 64

Writes ``benchmarks/results/bench_memory_<device>_w<world>[_<preset>].json`` and prints a markdown
table.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from _common import RESULTS, ROOT, TextSpec, build_recipe_arm, environment, make_inputs, write_result  # noqa: E402

__all__ = ["MemoryMode", "MODES", "measure_engine", "tensor_census", "run_modes", "markdown_table", "main"]


@dataclass(frozen=True)
class MemoryMode:
    """One row of the table.

    Attributes:
        config: File in ``ds_configs/``.
        standard: DeepSpeed's standard mixed precision: the two bf16 master flags removed and
            ``torch.optim.AdamW`` instead of SRAdamW.
        label: Row label.
        image_master: The image tower keeps an fp32 master (the recipe's default); ``False``
            makes it SR too (``--no-image-master-weights``).
    """

    config: str
    standard: bool = False
    label: str = ""
    image_master: bool = True


MODES: dict[str, MemoryMode] = {
    "zero1_bf16_halfmaster": MemoryMode("zero1_bf16_halfmaster.json", label="bf16 halfmaster, ZeRO-1"),
    "zero2_bf16_halfmaster": MemoryMode("zero2_bf16_halfmaster.json", label="bf16 halfmaster, ZeRO-2"),
    "zero3_bf16_halfmaster": MemoryMode("zero3_bf16_halfmaster.json", label="bf16 halfmaster, ZeRO-3"),
    "zero2_bf16_halfmaster_allsr": MemoryMode(
        "zero2_bf16_halfmaster.json", label="bf16 halfmaster, ZeRO-2, image tower SR too", image_master=False
    ),
    "zero0_fp16_sr_lossscale": MemoryMode("zero0_fp16_sr_lossscale.json", label="fp16 SR + loss scaling, ZeRO-0"),
    "zero0_bf16_sr": MemoryMode("zero0_bf16_sr.json", label="bf16 SR, ZeRO-0 (replicated)"),
    "zero2_fp32": MemoryMode("zero2_fp32.json", label="fp32, ZeRO-2"),
    "zero1_bf16_standard": MemoryMode(
        "zero1_bf16_halfmaster.json", standard=True, label="DeepSpeed standard bf16 + AdamW, ZeRO-1"
    ),
    "zero2_bf16_standard": MemoryMode(
        "zero2_bf16_halfmaster.json", standard=True, label="DeepSpeed standard bf16 + AdamW, ZeRO-2"
    ),
    "zero3_bf16_standard": MemoryMode(
        "zero3_bf16_halfmaster.json", standard=True, label="DeepSpeed standard bf16 + AdamW, ZeRO-3"
    ),
}


def ds_config_of(mode: MemoryMode, micro_batch: int) -> dict[str, Any]:
    """The DeepSpeed JSON of a mode (standard: the two half-master flags removed)."""
    cfg = json.loads((ROOT / "ds_configs" / mode.config).read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    if "fp16" in cfg:
        cfg["fp16"]["initial_scale_power"] = 8  # a tiny model overflows 2**16; start near its scale
    if mode.standard:
        bf16 = cfg.get("bf16", {})
        if not bf16.get("enabled"):
            raise ValueError(f"{mode.config}: the standard variant is defined for bf16 configs")
        bf16.pop("bf16_master_weights_and_grads", None)
        bf16.pop("bf16_optimizer_states", None)
    return cfg


# ----------------------------------------------------------------------------------------------
# reading the live tensors
# ----------------------------------------------------------------------------------------------


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of a tensor's storage; ``None`` for empty or meta storages."""
    if t.device.type == "meta":
        return None
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes()) if s.data_ptr() and s.nbytes() else None


def _walk(obj: Any, path: str, seen: set[int], depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors reachable from ``obj`` through dicts, lists, tuples and DeepSpeed objects."""
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
        if obj.grad is not None:
            yield path + ".grad", obj.grad
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield from _walk(v, f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]", seen, depth + 1)
    elif (
        type(obj).__module__.startswith("deepspeed")
        and hasattr(obj, "__dict__")
        and not isinstance(obj, torch.nn.Module)
    ):
        for k, v in list(vars(obj).items()):
            yield from _walk(v, f"{path}.{k}", seen, depth + 1)


def tensor_census(describe: bool = False) -> dict[int, Any]:
    """Every tensor storage the garbage collector tracks in this process: ``{data_ptr: nbytes}``
    (``describe=True``: ``{data_ptr: (nbytes, "dtype[shape]" of one tensor on it)}``)."""
    out: dict[int, Any] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                key = _storage(obj)
                if key and (key[0] not in out or (out[key[0]][0] if describe else out[key[0]]) < key[1]):
                    out[key[0]] = (
                        (key[1], f"{str(obj.dtype).removeprefix('torch.')}{list(obj.shape)}") if describe else key[1]
                    )
        except (ReferenceError, RuntimeError):
            continue
    return out


def measure_engine(
    engine: Any,
    optimizer: torch.optim.Optimizer,
    group_sizes: dict[str, int],
    exclude: list[torch.Tensor] = (),
    baseline: dict[int, int] | None = None,
) -> dict[str, Any]:
    """Bytes per parameter this rank holds, by kind (see the module docstring).

    Call it after ``engine.backward`` and before ``engine.step``.

    Args:
        engine: The DeepSpeed engine.
        optimizer: The client optimizer.
        group_sizes: Model parameters in each optimizer group, by group name (counted before
            ``deepspeed.initialize`` replaced the groups' parameters with flat partitions).
        exclude: Tensors to leave out of the completeness check (the inputs).
        baseline: A :func:`tensor_census` taken before the engine was built; storages found there
            (same address and size) are left out of the completeness check too.

    Returns:
        ``{"params", "weights", "partitions", "state", "grads", "total", "groups",
        "buffers_bytes", "other_bytes", "unaccounted_bytes", "grad_sources"}``: per-parameter values are
        bytes per model parameter on this rank; ``groups`` holds each group's partition and state
        per parameter of that group.
    """
    from recipe.training.memory import live_bytes_per_param

    module, zero = engine.module, engine.optimizer
    live = live_bytes_per_param(module, optimizer, zero)
    n = live["params"]
    classified: dict[int, str] = {}

    def claim(t: torch.Tensor, kind: str) -> int:
        key = _storage(t)
        if key is None or key[0] in classified:
            return 0
        classified[key[0]] = kind
        return key[1]

    weights = sum(claim(getattr(p, "ds_tensor", p), "weights") for p in module.parameters())
    weights += sum(claim(p, "weights") for p in module.parameters())  # ZeRO-3 persistent (full) parameters
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)
    partition_tensors = list(flats) if flats is not None else [p for g in optimizer.param_groups for p in g["params"]]
    partitions = sum(claim(p, "partitions") for p in partition_tensors)
    state = 0
    for p in partition_tensors:
        for v in optimizer.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                state += claim(v, "state")
    grads, sources = 0, {}
    grad_candidates = [("module.grad", p.grad) for p in module.parameters() if p.grad is not None]
    grad_candidates += [("partition.grad", p.grad) for p in partition_tensors if p.grad is not None]
    buffers = other = 0
    walked = list(_walk(vars(zero), "zero", {id(module), id(optimizer)}))
    grad_candidates += [(path, t) for path, t in walked if "grad" in path.lower() and "ipg" not in path.lower()]
    for path, t in grad_candidates:
        got = claim(t, "grads")
        if got:
            grads += got
            root = path.split("[")[0].split(".grad")[0]
            sources[root] = sources.get(root, 0) + got
    for path, t in walked:
        if "ipg" in path.lower():
            buffers += claim(t, "buffers")
    for _, t in walked:
        other += claim(t, "other")
    other += sum(claim(b, "other") for b in module.buffers())  # e.g. position ids
    from optim.functional import cached_tensors

    other += sum(claim(t, "other") for t in cached_tensors())  # SRAdamW's hyperparameter vectors (bytes)
    if hasattr(optimizer, "plan_tensors"):  # SRAdamW's step plans: metadata tables, packed counters, key words
        other += sum(claim(t, "other") for t in optimizer.plan_tensors())
    for _, t in _walk(vars(engine), "engine", {id(module), id(optimizer), id(zero)}):
        other += claim(t, "other")
    census = tensor_census(describe=True)
    skip = {k[0] for k in (_storage(t) for t in exclude) if k}
    old = baseline or {}
    left = [v for ptr, v in census.items() if ptr not in classified and ptr not in skip and old.get(ptr) != v[0]]
    unaccounted = sum(b for b, _ in left)
    examples = [d for _, d in sorted(left, reverse=True)[:8]]
    groups = {}
    for name, g in live["groups"].items():
        size = group_sizes.get(name) or 0
        groups[name] = {
            "partition": g["partition"] * n / size if size else None,
            "state": g["state"] * n / size if size else None,
            "params": size,
        }
    return {
        "params": n,
        "weights": weights / n,
        "partitions": partitions / n,
        "state": state / n,
        "grads": grads / n,
        "total": (weights + partitions + state + grads) / n,
        "groups": groups,
        "live_bytes_per_param": live,
        "buffers_bytes": buffers,
        "other_bytes": other,
        "unaccounted_bytes": unaccounted,
        "unaccounted_examples": examples,
        "grad_sources": sources,
    }


# ----------------------------------------------------------------------------------------------
# one mode on every rank
# ----------------------------------------------------------------------------------------------


def measure_mode(
    name: str,
    batch: int,
    seed: int,
    device: torch.device,
    inspect: Callable[..., dict[str, Any]] | None = None,
    preset: str = "tiny",
) -> dict[str, Any]:
    """Builds the engine of mode ``name``, trains one step, then measures between the second
    backward and the second optimizer step (this rank's view).

    ``inspect(engine, optimizer, result)``, when given, is called at the same moment and its dict
    is stored under ``result["inspect"]`` (tests use it to read references off the live engine).
    """
    import torch.distributed as dist

    from recipe.loss import ClipLoss
    from recipe.training.param_groups import param_groups
    from recipe.training.step import TrainState, train_step

    mode = MODES[name]
    gc.collect()
    baseline = tensor_census()

    def standard_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
        groups = param_groups(model, 0.2)
        for g in groups:
            g.pop("master_weights", None)
        return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.98), eps=1e-6)

    arm = build_recipe_arm(
        preset,
        ds_config_of(mode, batch),
        seed,
        image_master_weights=mode.image_master,
        optimizer=standard_adamw if mode.standard else None,
    )
    engine, opt, prec = arm.engine, arm.optimizer, arm.precision
    rank = dist.get_rank() if dist.is_initialized() else 0
    inputs = make_inputs(
        batch, int(arm.model.image_data_config()["input_size"][-1]), TextSpec.of(arm.model), seed * 100 + rank
    )
    inputs = {k: v.to(device) for k, v in inputs.items()}
    loss_fn, state = ClipLoss(validate=False), TrainState()
    result: dict[str, Any] = {}

    def measure(live: list[torch.Tensor], engine: Any = engine, opt: Any = opt, sizes: dict = arm.group_sizes) -> None:
        gc.collect()  # between the second backward and the second optimizer step
        result.update(measure_engine(engine, opt, sizes, exclude=list(inputs.values()) + live, baseline=baseline))
        if inspect is not None:
            result["inspect"] = inspect(engine, opt, result)

    train_step(engine, opt, loss_fn, prec, [inputs], state, max_nonfinite_in_row=10**9)  # creates the state
    out = train_step(engine, opt, loss_fn, prec, [inputs], state, max_nonfinite_in_row=10**9, after_backward=measure)
    result.update(
        mode=name,
        preset=preset,
        precision=prec.label,
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        zero_stage=prec.zero_stage,
        optimizer=type(opt).__name__,
        loss=float(out.loss),
    )
    engine.destroy() if hasattr(engine, "destroy") else None
    del engine, opt, arm, measure
    gc.collect()
    return result


def _rank_worker(
    rank: int,
    world: int,
    names: list[str],
    batch: int,
    seed: int,
    threads: int,
    inspect: Callable[..., dict[str, Any]] | None = None,
    preset: str = "tiny",
    device_type: str = "cpu",
) -> list[dict[str, Any]]:
    from recipe.training.engine import init_distributed

    torch.set_num_threads(threads)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    init_distributed("nccl" if device_type == "cuda" else "gloo")
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    out = []
    for name in names:
        try:
            out.append(measure_mode(name, batch, seed, device, inspect, preset))
        except Exception as err:  # a mode that does not work is reported, not fatal for the others
            out.append({"mode": name, "error": f"{type(err).__name__}: {err}"})
    return out


def run_modes(
    names: list[str],
    world: int = 2,
    batch: int = 8,
    seed: int = 0,
    threads: int = 1,
    timeout_s: float = 900,
    inspect: Callable[..., dict[str, Any]] | None = None,
    preset: str = "tiny",
    device_type: str = "cpu",
) -> list[list[dict[str, Any]]]:
    """Measures ``names`` on ``world`` ranks (spawned processes; CPU with gloo, or one GPU per rank
    with NCCL); returns per-rank lists of :func:`measure_mode` results (a mode that fails gives
    ``{"mode", "error"}``). ``inspect`` must be a module-level (picklable) function."""
    from tests.dist_utils import run_distributed

    if device_type == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} visible")
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if device_type == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return run_distributed(
        _rank_worker,
        world,
        names,
        batch,
        seed,
        threads,
        inspect,
        preset,
        device_type,
        init_process_group=False,
        env=env,
        timeout_s=timeout_s,
        threads_per_rank=threads,
    )


def summarize(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per mode: rank 0's measurement, plus the largest total over ranks."""
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        row = copy.deepcopy(r0)
        if "error" not in row:
            totals = [ranks[i]["total"] for ranks in per_rank]
            row["total_max_over_ranks"] = max(totals)
            row["unaccounted_bytes_max_over_ranks"] = max(ranks[i]["unaccounted_bytes"] for ranks in per_rank)
        rows.append(row)
    return rows


def _sr_and_master(groups: dict[str, Any]) -> tuple[str, str]:
    def fmt(names: list[str]) -> str:
        vals = [groups[n] for n in names if n in groups and groups[n]["params"]]
        if not vals:
            return "—"
        total = sum(v["params"] for v in vals)
        part = sum(v["partition"] * v["params"] for v in vals) / total
        state = sum(v["state"] * v["params"] for v in vals) / total
        return f"{part:.2f} + {state:.2f}"

    return fmt(["text.decay", "text.no_decay"]), fmt(["image.decay", "image.no_decay"])


def markdown_table(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    world = next((r["world_size"] for r in rows if "world_size" in r), "?")
    preset = next((r["preset"] for r in rows if "preset" in r), "?")
    params = next((r["params"] for r in rows if "params" in r), 0)
    ranks = f"each of {world} ranks" if world != 1 else "one rank"
    v = env["versions"]
    lines = [
        f"Bytes per parameter on {ranks}, read from the live engine between the second backward and the second "
        f"optimizer step; `{preset}` preset ({params:,} parameters), {env['device']}, torch {v['torch']}, "
        f"deepspeed {v['deepspeed']}, {env['date']}.",
        "",
        "| mode | optimizer | weights | grads | partition + optimizer state | total | text tower: partition + state "
        "| image tower: partition + state | reduce buckets | unaccounted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | — | fails: {r['error'][:120]} | | | | | | | |")
            continue
        sr, master = _sr_and_master(r["groups"])
        lines.append(
            f"| {MODES[r['mode']].label} | {r['optimizer']} | {r['weights']:.2f} | {r['grads']:.2f} "
            f"| {r['partitions'] + r['state']:.2f} | **{r['total']:.2f}** | {sr} | {master} "
            f"| {r['buffers_bytes'] / 2**20:.0f} MiB | {r['unaccounted_bytes_max_over_ranks'] / 2**10:.0f} KiB |"
        )
    lines += [
        "",
        "Tower columns are per parameter of that tower (in the recipe's modes the text tower is SR bf16/fp16 without "
        "a master and the image tower keeps an fp32 master inside SRAdamW's state, unless it is SR too). Reduce "
        "buckets are fixed-size (`reduce_bucket_size`), not per parameter. `unaccounted`: tensor storages alive in "
        "the process that none of the columns claims (gloo and DeepSpeed scratch), largest over ranks.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo ranks; cuda: one GPU per rank, NCCL"
    )
    ap.add_argument("--world", type=int, default=2, help="ranks (processes)")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--preset",
        default="tiny",
        help="recipe.model preset (ViT-B-32 fits in CPU memory too; its SR steps take minutes)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for all modes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument(
        "--json", default=None, help="output JSON (default benchmarks/results/bench_memory_cpu_w<world>.json)"
    )
    args = ap.parse_args(argv)
    if args.world < 1 or args.batch < 2:
        raise SystemExit("need --world >= 1 and --batch >= 2")
    per_rank = run_modes(
        args.modes,
        args.world,
        args.batch,
        args.seed,
        args.threads,
        args.timeout,
        preset=args.preset,
        device_type=args.device,
    )
    rows = summarize(per_rank)
    env = environment(args.device)
    result = {"environment": env, "settings": vars(args), "rows": rows, "per_rank": per_rank}
    suffix = "" if args.preset == "tiny" else f"_{args.preset}"
    write_result(
        args.json or RESULTS / f"bench_memory_{args.device}_w{args.world}{suffix}.json",
        result,
        markdown_table(rows, env),
    )
    return result


if __name__ == "__main__":
    main()

"""CPU smoke tests of the end-to-end benchmarks (benchmarks/bench_train.py, bench_memory.py,
sr_experiment.py, bench_optim.py): each runs with tiny settings and its numbers are checked against
references (brute-force search, the live engine's own bookkeeping, a torch.optim.AdamW training loop,
the gradients the optimizer saw, the launches it made). No test asserts a speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_memory  # noqa: E402
import bench_optim  # noqa: E402
import bench_train  # noqa: E402
import sr_experiment  # noqa: E402

# ---------------------------------------------------------------------------------------------
# bench_train: search and inputs (in process)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [5, 8, 100, 129, 511, 512, 513, 1000, 4095, 5000])
@pytest.mark.parametrize("granularity,tolerance", [(1, 0.0), (8, 0.0), (32, 0.05)])
def test_largest_fitting_brackets_the_true_limit(limit: int, granularity: int, tolerance: float) -> None:
    calls: list[list[int]] = []

    def probe(batches: list[int]) -> dict[int, bool]:  # stops at the first failure, like a worker
        calls.append(list(batches))
        out = {}
        for b in batches:
            out[b] = b <= limit
            if not out[b]:
                break
        return out

    got = bench_train.largest_fitting(probe, start=8, max_batch=4096, tolerance=tolerance, granularity=granularity, known={8: 8 <= limit})
    probes = got["probes"]
    assert all(fits == (b <= limit) for b, fits in probes.items())  # every reported probe is true
    if limit < 8:
        assert got["largest"] is None and got["first_failing"] == 8
    elif limit >= 4096:
        assert got["largest"] == 4096 and got["capped"] and got["first_failing"] is None
    else:
        lo, hi = got["largest"], got["first_failing"]
        assert lo <= limit < hi
        assert hi - lo <= max(granularity, tolerance * lo)
        if granularity == 1 and tolerance == 0:
            assert lo == limit  # exact
    assert len(calls) <= 2 + math.ceil(math.log2(4096))  # one doubling pass, then bisection


def test_inputs_are_the_same_for_both_models_and_prefix_stable() -> None:
    recipe_text = bench_train.TextSpec(4096, 32, bos=1, eos=2)
    openclip_text = bench_train.TextSpec(4096, 32, bos=4094, eos=4095)
    a = bench_train.make_inputs(6, 32, recipe_text, seed=3)
    b = bench_train.make_inputs(6, 32, openclip_text, seed=3)
    small = bench_train.make_inputs(4, 32, recipe_text, seed=3)
    assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["attention_mask"], b["attention_mask"])
    assert bench_train.input_checksum(a, recipe_text) == bench_train.input_checksum(b, openclip_text)
    assert bench_train.input_checksum(a, recipe_text) != bench_train.input_checksum(bench_train.make_inputs(6, 32, recipe_text, seed=4), recipe_text)
    for k in a:
        assert torch.equal(small[k], a[k][:4])
    for inputs, text in ((a, recipe_text), (b, openclip_text)):
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        lengths = mask.sum(1)
        assert (ids[:, 0] == text.bos).all()
        assert (ids[torch.arange(6), lengths - 1] == text.eos).all()
        body = torch.cat([ids[i, 1 : lengths[i] - 1] for i in range(6)])
        assert not torch.isin(body, torch.tensor([text.bos, text.eos, text.pad])).any()
        assert (ids[mask == 0] == text.pad).all()
    # OpenCLIP pools at the arg-max id: that must be the end-of-text position
    assert torch.equal(b["input_ids"].argmax(1), b["attention_mask"].sum(1) - 1)


# ---------------------------------------------------------------------------------------------
# bench_train: the script on CPU
# ---------------------------------------------------------------------------------------------


def test_bench_train_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--device", "cpu", "--batch", "8", "--max-batch", "16",
           "--steps", "2", "--warmup", "1", "--ckpt", "on", "--cpu-budget-mib", "100000", "--json", str(out),
           "--accumulation", "1", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    accumulated = [r for r in result["rows"] if r["accumulation"] == 2]
    rows = {r["arm"]: r for r in result["rows"] if r["accumulation"] == 1}
    # the same 8 pairs in 2 micro-batches of 4 under the global contrastive batch: the first step's loss
    # is the loss of the same batch (bf16 towers: to bf16 rounding of the embeddings)
    assert [r["arm"] for r in accumulated] == ["recipe-plain"] and "largest_batch" not in accumulated[0]
    assert accumulated[0]["first_loss"] == pytest.approx(rows["recipe-plain"]["first_loss"], rel=1e-2)
    assert accumulated[0]["checksum"] == rows["recipe-plain"]["checksum"] and accumulated[0]["batch"] == 8
    try:
        import open_clip
    except ImportError:
        open_clip = None
    baseline = "openclip" if open_clip else "torch-amp"
    assert set(rows) == {"recipe-plain", baseline}
    assert "recipe-fused" in result["unavailable"]  # compiled Triton kernels: CUDA only
    # same pixels and tokens in both arms
    assert rows["recipe-plain"]["checksum"] == rows[baseline]["checksum"]
    # parameter counts of the models the arms built
    from recipe.model import create_model

    assert rows["recipe-plain"]["params"] == sum(p.numel() for p in create_model("tiny").parameters())
    if open_clip:
        ref = open_clip.create_model("ViT-B-32", **bench_train.OPENCLIP_TINY)
        assert rows["openclip"]["params"] == sum(p.numel() for p in ref.parameters())
    for r in rows.values():
        assert r["ckpt"] is True and r["batch"] == 8 and r["fits"]
        assert r["samples_per_s"] == pytest.approx(8 * 2 / r["seconds"], rel=1e-9)
        assert r["peak_bytes"] > 0
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
        assert 0.5 * math.log(8) < r["first_loss"] < 4 * math.log(8)  # an untrained contrastive loss
        assert r["largest_batch"] == 16 and r["fit_capped"] and r["probes"] == {"8": True, "16": True}
    ratio = rows["recipe-plain"]["samples_per_s"] / rows[baseline]["samples_per_s"]
    assert rows["recipe-plain"]["speedup_vs_baseline"] == pytest.approx(ratio)
    table = result["markdown"]
    assert table in proc.stdout and "| recipe-plain | 1 | on |" in table and f"| {baseline} | 1 | on |" in table
    assert "| recipe-plain | 2 | on |" in table
    assert result["environment"]["versions"]["torch"] == torch.__version__


def test_baseline_clips_like_the_deepspeed_config_unless_told(tmp_path: Path) -> None:
    s = bench_train.BenchSettings(device="cpu")
    assert bench_train._baseline_grad_clip(s) == 1.0  # ds_configs/zero2_bf16_halfmaster.json
    cfg = json.loads((ROOT / "ds_configs" / "zero2_bf16_halfmaster.json").read_text())
    cfg["gradient_clipping"] = 0.5
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    assert bench_train._baseline_grad_clip(bench_train.BenchSettings(device="cpu", ds_config=str(tmp_path / "ds.json"))) == 0.5
    assert bench_train._baseline_grad_clip(bench_train.BenchSettings(device="cpu", baseline_grad_clip=0.0)) == 0.0


def test_bench_train_breakdown_cpu(tmp_path: Path) -> None:
    """--breakdown: the recipe's own train step and the baseline alternate in one process; every phase's
    timer is wired (the rows of each step add up to its total) and DeepSpeed's overflow check, a second
    owner of the train step's finite check, does not run."""
    out = tmp_path / "breakdown.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--device", "cpu", "--batch", "8", "--steps", "3",
           "--warmup", "1", "--ckpt", "off", "--loss-modes", "plain", "--breakdown", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    recipe_arm, baseline = result["arms"]
    assert recipe_arm == "recipe-plain" and baseline in ("openclip", "torch-amp")
    parts = [k for k, _ in bench_train.BREAKDOWN_ROWS if k != "total"]
    for arm in result["arms"]:
        row = result["breakdown"][arm]
        assert len(row["steps"]) == 3 and row["samples_per_s"] == pytest.approx(8 / row["total"])
        for step in row["steps"]:
            assert sum(step[k] for k in parts) == pytest.approx(step["total"], rel=1e-9)
            assert all(step[k] >= 0 for k in parts), step
    mine, base = result["breakdown"][recipe_arm], result["breakdown"][baseline]
    for k in ("forward", "loss", "backward", "optimizer", "ds_norm", "ds_copy"):
        assert mine[k] > 0, k
    # one rank on the recipe-managed route: no gradient all-reduce at all (the overlapped one needs two ranks)
    assert mine["ds_reduce"] == 0
    assert all(s["ds_overflow"] == 0 for s in mine["steps"])  # the train step owns the finite check
    # like for like: the baseline clips at the DeepSpeed config's gradient_clipping (OpenCLIP's --grad-clip-norm)
    assert base["forward"] > 0 and base["optimizer"] > 0 and base["ds_norm"] > 0
    assert "clip_grad_norm_ 1" in base["description"]
    assert result["markdown"] in proc.stdout and "| total (median step) |" in result["markdown"]


def test_bench_train_routes_cpu(tmp_path: Path) -> None:
    """--routes: the recipe's own train step under each DeepSpeed JSON, alternating in one process; the
    ratio to the first route; with --breakdown every phase is wired (a step's exclusive phases add up to
    its total) and each route shows its own machinery (ZeRO-2: per-gradient hooks, flattening, clipping;
    ZeRO-0: the recipe's all-reduce-free step at one rank, its norm)."""
    out = tmp_path / "routes.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--device", "cpu", "--batch", "8", "--steps", "3",
           "--warmup", "1", "--ckpt", "off", "--loss-modes", "plain", "--routes", "zero0_bf16_sr",
           str(ROOT / "ds_configs" / "zero2_bf16_halfmaster.json"), "--breakdown", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["routes"] == ["zero0_bf16_sr", "zero2_bf16_halfmaster"] and result["world_size"] == 1
    z0, z2 = (result["rows"][n] for n in result["routes"])
    assert (z0["route"], z2["route"]) == ("bf16/zero0", "bf16/zero2")
    assert z0["ratio_to_first"] == 1.0 and z2["ratio_to_first"] == pytest.approx(z2["step_s"] / z0["step_s"])
    parts = [k for k, _ in bench_train.ROUTE_PHASES if k != "total"]
    for row in (z0, z2):
        assert len(row["steps_s"]) == 3
        for step in row["phase_steps"]:
            assert sum(step[k] for k in parts) == pytest.approx(step["total"], rel=1e-9)
            assert all(step[k] >= 0 for k in parts), step
        assert row["phases"]["forward"] > 0 and row["phases"]["backward"] > 0 and row["phases"]["optimizer"] > 0
        assert row["phases"]["norm"] > 0
    assert z2["phase_calls"]["hooks"] == 69 and z2["phases"]["flatten"] > 0 and z2["phases"]["clip"] > 0
    assert z0["phases"]["hooks"] == z0["phases"]["flatten"] == z0["phases"]["clip"] == 0
    assert "step time / `zero0_bf16_sr`" in result["markdown"] and result["markdown"] in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_train_cuda_tiny(tmp_path: Path) -> None:
    # The script's CUDA path, as small as it goes: one arm (the recipe with the fused loss: DeepSpeed,
    # SRAdamW's Triton kernel and the loss kernels on the GPU), one warm-up and one timed step, in one
    # worker process (each arm is a process: ~30 s on the GPU machine, ~90 s for the three arms this
    # used to run). The OpenCLIP arm and the plain loss on CUDA: gpu_check.sh's `train` step runs
    # bench_train on ViT-B-32 with the baseline; the CPU smoke test above compares the arms' inputs.
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--device", "cuda", "--preset", "tiny",
           "--batch", "16", "--warmup", "1", "--steps", "1", "--fit", "none", "--ckpt", "off", "--loss-modes", "fused",
           "--no-baseline", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"recipe-fused"}, rows
    for r in rows.values():
        assert r["fits"] and r["samples_per_s"] > 0 and r["peak_bytes"] > 0 and r["checksum"]


# ---------------------------------------------------------------------------------------------
# bench_optim: fresh gradients every step, host time with the launches recorded
# ---------------------------------------------------------------------------------------------


def _sr(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    from optim import SRAdamW

    return SRAdamW(ps, lr=1e-3, state_dtype=torch.bfloat16)


@pytest.mark.parametrize("grads", ["new", "copy"])
@pytest.mark.parametrize("make", [_sr, lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)], ids=["SRAdamW", "AdamW"])
def test_bench_optim_steps_see_fresh_gradients(grads: str, make) -> None:
    shapes = bench_optim.layout("uniform", 3, 96)
    pool = bench_optim.GradPool(shapes, "cpu", sets=3)
    runner = bench_optim.prepare("x", make, shapes, torch.bfloat16, "cpu", pool, warmup=1, grads=grads)
    seen: list[list[torch.Tensor]] = []  # the gradient tensors each step ran on, as the optimizer saw them
    runner.opt.register_step_pre_hook(lambda opt, args, kwargs: seen.append([p.grad for p in runner.params]))
    values = []
    for _ in range(4):
        runner.timed_step()
        values.append([g.clone() for g in seen[-1]])
    for i, step_values in enumerate(values):  # the warm-up step took set 0: the timed steps take 1, 2, 0, 1
        expected = pool.sets[(i + 1) % 3]
        assert all(torch.equal(v, e.to(v.dtype)) for v, e in zip(step_values, expected)), i
        if i:
            assert not any(torch.equal(v, w) for v, w in zip(step_values, values[i - 1])), i
    same_tensors = all(a is b for a, b in zip(seen[0], seen[1]))
    assert same_tensors == (grads == "copy")  # "new": a new gradient tensor every step, as zero_grad(None)
    row = bench_optim.result_row(runner)
    assert row["steps"] == 4 and len(row["times_ms"]) == 4 and row["grads"] == grads
    assert 0 < row["ms_min"] <= row["ms"] <= row["ms_max"] and row["GB/s"] > 0

    # the trajectory differs from a constant-gradient run of the same optimizer
    constant = bench_optim.prepare("x", make, shapes, torch.bfloat16, "cpu", bench_optim.GradPool(shapes, "cpu", sets=1),
                                   warmup=1, grads=grads)
    for _ in range(4):
        constant.timed_step()
    assert any(not torch.equal(p, q) for p, q in zip(runner.params, constant.params))


def _host_route_or_skip(route: str) -> tuple:
    try:
        return bench_optim._host_module(route)
    except Exception as e:  # no compiler, no Triton, or Triton imported compiled (a GPU machine)
        pytest.skip(f"host route {route} cannot run here: {e}")


@pytest.mark.parametrize("route", list(bench_optim.HOST_ROUTES))
def test_bench_optim_host_mode_records_launches(route: str) -> None:
    module, name = _host_route_or_skip(route)
    real = getattr(module, name)
    shapes = bench_optim.layout("uniform", 5, 300)
    row = bench_optim.host_time(shapes, route, "bf16", steps=6, warmup=2, elements=64)
    assert getattr(module, name) is real  # the launch point is restored
    assert row["kind"] == "host" and row["route"] == route and row["tensors"] == 5 and row["params"] == 5 * 64
    # a steady step on a plan: the gradient maxima and the update, one launch each (one dtype, one group)
    assert row["launches_per_step"] == 2 and row["launches_per_step_2x"] == 2 and row["steps"] == 6
    assert 0 < row["host_us_min"] <= row["host_us"] <= row["host_us_max"] and row["host_us_2x"] > 0
    assert math.isfinite(row["us_per_extra_tensor"])


def test_bench_optim_host_mode_refuses_a_step_that_launches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _host_route_or_skip("cpu")
    monkeypatch.setattr(bench_optim, "SRAdamW", lambda ps, lr, **kw: torch.optim.SGD(ps, lr=lr))
    with pytest.raises(RuntimeError, match="recorded no launch"):
        bench_optim.host_time(bench_optim.layout("uniform", 2, 64), "cpu", steps=2, warmup=1)


def test_bench_optim_cli_cpu(tmp_path: Path) -> None:
    """Both modes through the command line: the JSON rows and the tables."""
    cmd = [sys.executable, "-X", "faulthandler", str(ROOT / "benchmarks" / "bench_optim.py"), "--layout", "uniform",
           "--iters", "3", "--warmup", "1"]
    out = tmp_path / "steps.json"
    proc = subprocess.run([*cmd, "--device", "cpu", "--tensors", "2", "--size", "256", "--only", "bf16", "--exclude",
                           "PyTorch path", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["optimizer"] for r in rows} >= {"torch AdamW bf16 (RTN)", "SRAdamW bf16 w + bf16 SR states (CPU kernel)"}
    for r in rows:
        assert r["kind"] == "step" and r["layout"] == "uniform" and r["steps"] == 3 and r["ms"] > 0, r
        assert f"| {r['optimizer']} | {r['ms']:.2f} |" in proc.stdout
    out = tmp_path / "host.json"
    proc = subprocess.run([*cmd, "--host", "--tensors", "3", "--size", "64", "--json", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["route"] for r in rows] == list(bench_optim.HOST_ROUTES)
    for r in rows:  # a route that cannot run on this machine is an error row, not a crash
        assert r["kind"] == "host" and r["layout"] == "uniform"
        assert "error" in r or (r["launches_per_step"] >= 1 and r["host_us"] > 0), r


# ---------------------------------------------------------------------------------------------
# bench_memory: 2 CPU ranks
# ---------------------------------------------------------------------------------------------


def grad_reference(engine, optimizer, result) -> dict:
    """What the ZeRO optimizer's own bookkeeping says this rank's gradients occupy (bytes/param)."""
    zero, n = engine.optimizer, result["params"]
    if hasattr(zero, "grad_partitions_flat_buffer"):  # ZeRO-3: one flat gradient partition
        t = zero.grad_partitions_flat_buffer
        grads = t.numel() * t.element_size()
    elif hasattr(zero, "params_in_partition"):  # ZeRO-1/2: whole gradients of the params touching the partition
        elem = next(engine.module.parameters()).element_size()
        grads = sum(p.numel() for group in zero.params_in_partition for p in group) * elem
    else:  # stage 0: the module's .grad
        grads = sum(p.grad.numel() * p.grad.element_size() for p in engine.module.parameters() if p.grad is not None)
    return {"grads": grads / n, "module_numel": sum(p.numel() for p in engine.module.parameters())}


# (module weights, text: partition + state, image: partition + state) per parameter at N ranks,
# from the table in docs/precision.md ("Precision modes and bytes per parameter")
PROMISED = {
    "zero2_bf16_halfmaster": lambda N: (2, (2 / N, 4 / N), (2 / N, 10 / N)),  # split master: 2-byte low half
    "zero0_fp16_sr_lossscale": lambda N: (2, (0, 4), (0, 12)),
    "zero0_bf16_sr": lambda N: (2, (0, 4), (0, 10)),
    "zero2_bf16_standard": lambda N: (2, (4 / N, 8 / N), (4 / N, 8 / N)),
}


@pytest.fixture(scope="module")
def memory_rows() -> list[list[dict]]:
    return bench_memory.run_modes(list(PROMISED), world=2, batch=4, inspect=grad_reference, timeout_s=600)


def check_memory_row(r: dict, mode: str, world: int, unaccounted_limit: int = 0) -> None:
    assert "error" not in r, r.get("error")
    n = r["params"]
    assert r["world_size"] == world
    pad = 256 / n  # ZeRO aligns each flat partition: a few elements per group
    weights, sr, master = PROMISED[mode](world)
    # against recipe.training.memory.live_bytes_per_param (element counts) and docs/precision.md's promises
    live = r["live_bytes_per_param"]
    assert r["weights"] == pytest.approx(live["module_weights"], abs=pad) and r["weights"] == pytest.approx(weights, abs=pad)
    part_state = sum(g["partition"] + g["state"] for g in live["groups"].values())
    assert r["partitions"] + r["state"] == pytest.approx(part_state, abs=4 * pad)
    for tower, (part, state) in (("text", sr), ("image", master)):
        for name in (f"{tower}.decay", f"{tower}.no_decay"):
            g = r["groups"][name]
            assert g["partition"] == pytest.approx(part, abs=0.05) and g["state"] == pytest.approx(state, abs=0.05), (name, g)
    # gradients against the ZeRO optimizer's own bookkeeping
    assert r["grads"] == pytest.approx(r["inspect"]["grads"], abs=1e-4)
    assert r["inspect"]["module_numel"] == n
    assert r["total"] == pytest.approx(r["weights"] + r["partitions"] + r["state"] + r["grads"])
    # nothing alive was missed: every new storage is classified (or the inputs)
    assert r["unaccounted_bytes"] <= unaccounted_limit, r["unaccounted_examples"]


@pytest.mark.parametrize("mode", list(PROMISED))
def test_bench_memory_reads_what_the_engine_holds(memory_rows: list[list[dict]], mode: str) -> None:
    for rank_rows in memory_rows:
        check_memory_row(next(x for x in rank_rows if x["mode"] == mode), mode, world=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_memory_on_one_gpu() -> None:
    # The two default routes (several GPUs: ZeRO-2 halfmaster; one GPU: bf16 SR at ZeRO-0) in one worker;
    # every mode of PROMISED is checked on CPU ranks above (test_bench_memory_reads_what_the_engine_holds)
    modes = ["zero2_bf16_halfmaster", "zero0_bf16_sr"]
    rows = bench_memory.run_modes(modes, world=1, batch=4, inspect=grad_reference, device_type="cuda", timeout_s=600)[0]
    for mode in modes:
        # CUDA libraries may keep a few small tensors of their own (workspaces are not tensors)
        check_memory_row(next(x for x in rows if x["mode"] == mode), mode, world=1, unaccounted_limit=2**20)


def test_bench_memory_table_lists_every_mode(memory_rows: list[list[dict]]) -> None:
    rows = bench_memory.summarize(memory_rows)
    env = {"device": "cpu", "versions": {"torch": torch.__version__, "deepspeed": "x"}, "date": "today"}
    table = bench_memory.markdown_table(rows, env)
    for r in rows:
        assert f"| {bench_memory.MODES[r['mode']].label} |" in table
        assert f"**{r['total']:.2f}**" in table
    standard = next(r for r in rows if r["mode"] == "zero2_bf16_standard")
    halfmaster = next(r for r in rows if r["mode"] == "zero2_bf16_halfmaster")
    assert halfmaster["total"] < standard["total"]  # the point of the halfmaster modes


# ---------------------------------------------------------------------------------------------
# sr_experiment
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sr_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    out = tmp_path_factory.mktemp("sr_out")
    data = tmp_path_factory.mktemp("sr_data")
    argv = ["--steps", "6", "--warmup-steps", "2", "--batch-size", "16", "--n-train", "96", "--n-val", "24", "--lrs", "1e-5",
            "--seeds", "0", "--jobs", "1", "--data-dir", str(data), "--out", str(out), "--no-plot"]
    return sr_experiment.main(argv), out, data


def _adamw_reference_losses(result: dict, data_dir: Path) -> list[float]:
    """The fp32 arm re-trained with torch.optim.AdamW (no SRAdamW, no harness code)."""
    from recipe.loss import ClipLoss
    from recipe.model import create_model
    from recipe.model.tokenizer import load_tokenizer
    from recipe.training.param_groups import param_groups

    s = result["settings"]
    root = next(p for p in data_dir.iterdir() if (p / "tensors.pt").exists())
    train = torch.load(root / "tensors.pt", weights_only=True)["train"]
    torch.manual_seed(0)
    model = create_model("tiny", tokenizer=load_tokenizer(root / "tokenizer"))
    opt = torch.optim.AdamW(param_groups(model, s["weight_decay"]), lr=s["lrs"][0], betas=tuple(s["betas"]), eps=s["eps"])
    gen = torch.Generator().manual_seed(0)
    perm, losses, b = torch.randperm(train["pixel_values"].shape[0], generator=gen), [], s["batch_size"]
    for step in range(s["steps"]):
        for g in opt.param_groups:
            g["lr"] = s["lrs"][0] * min(1.0, (step + 1) / s["warmup_steps"])
        idx = perm[step * b : (step + 1) * b]
        loss, _ = ClipLoss()(*model(train["pixel_values"][idx], train["input_ids"][idx], train["attention_mask"][idx]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_sr_experiment_fp32_arm_is_adamw_and_arms_share_data(sr_result: tuple[dict, Path, Path]) -> None:
    result, out, data = sr_result
    runs = {r["arm"]: r for r in result["runs"]}
    assert set(runs) == set(sr_experiment.ARMS)
    ref = _adamw_reference_losses(result, data)
    assert runs["fp32"]["losses"] == pytest.approx(ref, rel=1e-4)
    # same bf16 initialisation and same first batch: identical first losses across the bf16 arms
    firsts = {runs[a]["losses"][0] for a in ("bf16-rtn", "bf16-sr", "bf16-sr+bf16-states-rtn", "bf16-sr+bf16-states-sr")}
    assert len(firsts) == 1
    assert runs["bf16-rtn"]["losses"][0] == pytest.approx(runs["fp32"]["losses"][0], rel=1e-2)
    for r in runs.values():
        assert all(math.isfinite(v) for v in r["losses"]) and len(r["losses"]) == 6
        assert 0 < r["zeroshot_chance"] < 1 and 0 <= r["zeroshot_top1"] <= 1


def test_sr_experiment_round_to_nearest_stalls_at_a_tiny_learning_rate(sr_result: tuple[dict, Path, Path]) -> None:
    result, _, _ = sr_result
    runs = {r["arm"]: r for r in result["runs"]}
    # lr 1e-5 with Adam's ~lr-sized steps is below half a bf16 ulp of almost every weight
    # (|w| >= 2**-7 has ulp >= 2**-14 = 6e-5): round-to-nearest writes most of them back unchanged,
    # SR moves each with probability ~ |update| / ulp, fp32 moves all that get a gradient.
    assert runs["fp32"]["frac_weights_unchanged"] < 0.2
    assert runs["bf16-rtn"]["frac_weights_unchanged"] > 0.8
    assert runs["bf16-sr"]["frac_weights_unchanged"] < runs["bf16-rtn"]["frac_weights_unchanged"] - 0.1


def test_sr_experiment_outputs(sr_result: tuple[dict, Path, Path]) -> None:
    result, out, _ = sr_result
    saved = json.loads((out / "sr_experiment.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    rows = {r["arm"]: r for r in saved["summary"]}
    fp32 = rows["fp32"]["val_loss"]
    for arm, row in rows.items():
        assert row["val_loss_vs_fp32_pct"] == pytest.approx(100 * (row["val_loss"] - fp32) / fp32)
    table = (out / "sr_experiment.md").read_text()
    assert all(f"| {arm} |" in table for arm in sr_experiment.ARMS)


def test_sr_experiment_plots(sr_result: tuple[dict, Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need the bench extra (matplotlib)")
    from PIL import Image

    result, _, _ = sr_result
    cfg = sr_experiment.ExperimentConfig(**{k: v for k, v in result["settings"].items() if k in sr_experiment.ExperimentConfig.__dataclass_fields__})
    paths = sr_experiment.plot(result["runs"], result["summary"], tmp_path, cfg)
    for p in paths:
        with Image.open(p) as im:
            assert im.format == "PNG" and im.size[0] > 400 and im.size[1] > 200

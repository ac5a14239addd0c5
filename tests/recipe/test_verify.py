"""``python -m recipe.verify``: passes on a healthy 2-rank CPU launch through ``launch.sh verify``, fails
(exit 1 on every rank, the broken item named) when a check is broken on one rank, and refuses bad
input with one line and exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from recipe.verify import cli
from recipe.verify.check_optim import differing_elements

from ..dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _rows(out: str) -> dict[str, str]:
    """``{"check item": STATUS}`` from the report's table lines."""
    found = {}
    for line in out.splitlines():
        m = re.match(r"^(memory|comm|loss|optimizer)\s+(.+?)\s{2}(PASS|WARN|FAIL|SKIP)\s{2}", line)
        if m:
            found[f"{m.group(1)} {m.group(2).strip()}"] = m.group(3)
    return found


def test_launch_verify_passes_on_a_healthy_cpu_launch(tmp_path: Path) -> None:
    env = dict(os.environ, NUM_GPUS="2")
    env.pop("DS_CONFIG", None)
    res = subprocess.run(["bash", str(ROOT / "launch.sh"), "verify"], check=False, cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "recipe.verify: 2 rank(s) (gloo, cpu), tiny (D=64)" in res.stdout, out[-4000:]
    rows = _rows(res.stdout)
    expected = {"memory peak vs free", "comm all-gather", "comm reduce-scatter", "comm all-reduce", "loss clip plain fp32",
                "loss clip plain bf16", "loss clip chunked fp32", "loss clip chunked bf16",
                "optimizer text bf16 SR, bf16 states", "optimizer image bf16 + split master",
                "optimizer logit scale bf16 + master, clamp"}
    assert set(rows) == expected, rows
    assert set(rows.values()) <= {"PASS", "WARN"} and rows["loss clip chunked bf16"] == "PASS", rows
    assert all(rows[k] == "PASS" for k in expected if k.startswith(("loss", "optimizer"))), rows
    assert "_cpu_kernel.cpu_updates_ vs eager" in res.stdout  # the default CPU path was the one compared
    assert "Traceback" not in out


def _broken_worker(rank: int, world: int) -> tuple[int, str]:
    """One rank of a preflight in which rank 1's chunked loss, default optimizer path, reduce-scatter and
    all-reduce are each slightly wrong, and the memory given is far too small."""
    if rank == 1:
        from optim import _cpu_kernel
        from recipe.loss import clip
        from recipe.verify import check_comm

        chunked = clip.LOSS_MODES["chunked"]
        clip.LOSS_MODES["chunked"] = lambda *a: chunked(*a)._replace(ce_i2t=chunked(*a).ce_i2t * 1.001)
        kernel = _cpu_kernel.cpu_updates_

        def off_by_one_ulp(specs, **kw):
            kernel(specs, **kw)
            for s in specs:
                if s.param.numel() > 1:
                    bits = s.param.view(torch.int16 if s.param.element_size() == 2 else torch.int32)
                    bits[7] += 1  # one ulp up (both steps: never undone)

        _cpu_kernel.cpu_updates_ = off_by_one_ulp
        run_op = check_comm._run

        def wrong_sum(op, out, inp, timeout):
            run_op(op, out, inp, timeout)
            if op in ("reduce_scatter", "all_reduce"):
                out[3] += 1.0

        check_comm._run = wrong_sum
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["--loss-rows", "8", "--comm-sizes", "0.01", "--comm-iters", "1", "--gpu-memory", "1MiB",
                        "--min-busbw", "0"])
    return code, buf.getvalue()


def test_a_check_broken_on_one_rank_fails_every_rank() -> None:
    (code0, out0), (code1, out1) = run_distributed(_broken_worker, 2, init_process_group=False, timeout_s=240,
                                                   threads_per_rank=1, env={"DS_ACCELERATOR": "cpu"})
    print(out0)
    assert code0 == code1 == 1, out0
    assert out1 == "", out1  # rank 0 prints the one screen
    rows = _rows(out0)
    assert rows["memory peak vs free"] == "FAIL" and "does not fit" in out0, out0
    assert rows["comm reduce-scatter"] == rows["comm all-reduce"] == "FAIL" and rows["comm all-gather"] == "PASS", out0
    assert rows["loss clip chunked fp32"] == rows["loss clip chunked bf16"] == "FAIL", out0
    assert rows["loss clip plain fp32"] == rows["loss clip plain bf16"] == "PASS", out0
    assert rows["optimizer text bf16 SR, bf16 states"] == rows["optimizer image bf16 + split master"] == "FAIL", out0
    assert rows["optimizer logit scale bf16 + master, clamp"] == "PASS", out0  # 1 element: left alone above
    assert re.search(r"optimizer\s+text .* FAIL  [1-9]\d* of \d+ elements differ \(rank\(s\) 1\)", out0), out0
    assert re.search(r"comm\s+reduce-scatter\s+FAIL  [1-9]\d* wrong elements on rank\(s\) 1;", out0), out0
    assert out0.rstrip().splitlines()[-1].startswith("FAIL: "), out0


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--world-size", "4"], "launched with 1 rank(s) but --world-size is 4"),
    (["--skip", "loss,gpu"], "skip: unknown check(s) gpu"),
    (["--global-batch", "100", "--micro-batch", "64"], "global batch 100 is not divisible by micro-batch 64"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RECIPE_TRACEBACK", raising=False)
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_unreadable_or_inconsistent_ds_json_is_named(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECIPE_TRACEBACK", raising=False)
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["--ds-config", str(bad)]) == 2
    assert f"{bad}: not valid JSON" in capsys.readouterr().err
    assert cli.main(["--ds-config", str(tmp_path / "missing.json")]) == 2
    assert "DeepSpeed config not found" in capsys.readouterr().err
    cfg = json.loads((ROOT / "ds_configs" / "zero2_bf16_halfmaster.json").read_text())
    cfg.update(train_batch_size=128, gradient_accumulation_steps=1)  # 64 x 1 x 2 ranks, launched on 4
    (tmp_path / "w2.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli.main(["--ds-config", str(tmp_path / "w2.json")]) == 2
    assert "train_batch_size 128 != " in capsys.readouterr().err


def test_differing_elements_counts_bits_and_equal_nans() -> None:
    a = torch.tensor([1.0, float("nan"), -0.0, 2.0], dtype=torch.bfloat16)
    b = a.clone()
    assert differing_elements(a, b) == 0
    b[2] = 0.0  # -0.0 and 0.0 compare equal as numbers, not as bits
    b.view(torch.int16)[3] += 1  # one ulp
    assert differing_elements(a, b) == 2

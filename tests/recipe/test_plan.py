"""``recipe.plan``: predictions against the live census, activation accounting against hand counts,
the command line end to end, and clear errors for bad input."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from recipe.config import build_parser, check_model_names
from recipe.plan import ModelSpec, PlanError, parse_memory, plan, predict_memory
from recipe.plan.activations import count_saved, measure_activations
from recipe.plan.cli import main
from recipe.plan.search import format_bytes
from recipe.plan.states import build_meta_model
from recipe.plan.vocab import run_tokenizer
from recipe.synthetic import write_dataset
from recipe.training.precision import read_ds_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_memory

#: census modes and the ds_configs JSON each one runs (bench_memory.MODES), all the planner's routes
CENSUS_MODES = ["zero2_bf16_halfmaster", "zero3_bf16_halfmaster", "zero2_bf16_halfmaster_allsr",
                "zero0_fp16_sr_lossscale", "zero0_bf16_sr", "zero2_fp32"]


# ----------------------------------------------------------------------------------------------
# model states against the live census (bench_memory measures the engine of every mode)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def census_w2() -> list[list[dict]]:
    """bench_memory's census of the tiny preset on 2 CPU ranks (every rank's view)."""
    return bench_memory.run_modes(CENSUS_MODES, world=2, batch=4, preset="tiny", timeout_s=600)


@pytest.mark.slow  # ~50 s: five DeepSpeed engines on two gloo ranks
@pytest.mark.parametrize("index", range(len(CENSUS_MODES)), ids=CENSUS_MODES)
def test_model_states_match_live_census_w2(census_w2: list[list[dict]], index: int) -> None:
    rows = [ranks[index] for ranks in census_w2]
    assert "error" not in rows[0], rows[0]
    mode = bench_memory.MODES[CENSUS_MODES[index]]
    p = predict_memory(ModelSpec("tiny", image_master_weights=mode.image_master), mode.config, world=2, micro_batch=4)
    for kind, predicted in (("weights", p.bytes_per_param["weights"]), ("grads", p.bytes_per_param["grads"]),
                            ("state", p.bytes_per_param["optimizer_state"])):
        measured = max(r[kind] for r in rows)  # the fullest rank, as the planner predicts
        assert predicted == pytest.approx(measured, rel=0.1, abs=0.01), kind
    measured_total = max(r["total"] for r in rows)
    assert p.model_state_bytes / p.params == pytest.approx(measured_total, rel=0.1)
    if p.zero_stage == 3:  # the reduce bucket is alive when the census reads
        assert p.buffer_bytes == pytest.approx(max(r["buffers_bytes"] for r in rows), rel=0.01)


@pytest.mark.parametrize("world", [1, 2])
def test_vit_b32_model_states_match_the_recorded_census(world: int) -> None:
    """ViT-B-32 (151 M parameters): the planner against bench_memory's census of the live engines,
    recorded in benchmarks/results/bench_memory_cpu_w<world>_ViT-B-32.json (a 10-minute CPU run;
    re-run it when the optimizer's or DeepSpeed's state layout changes): every recorded mode within 2 %
    (measured: 0.0-0.1 %)."""
    import json

    recorded = json.loads((ROOT / "benchmarks" / "results" / f"bench_memory_cpu_w{world}_ViT-B-32.json").read_text())
    rows = [r for r in recorded["rows"] if "error" not in r and r["optimizer"] == "SRAdamW"]
    assert len(rows) >= 4, [r["mode"] for r in rows]
    for row in rows:
        mode = bench_memory.MODES[row["mode"]]
        p = predict_memory(ModelSpec("ViT-B-32", image_master_weights=mode.image_master), mode.config, world=world,
                           micro_batch=2)
        measured = row.get("total_max_over_ranks", row["total"])
        assert p.model_state_bytes / p.params == pytest.approx(measured, rel=0.02), row["mode"]


def test_model_states_world1_sum_to_census_kinds() -> None:
    """At one rank everything is whole: the halfmaster route's partition is 2 B/param, grads 2."""
    p = predict_memory("tiny", "zero2_bf16_halfmaster.json", world=1, micro_batch=2)
    assert p.bytes_per_param["weights"] == 2.0
    assert p.bytes_per_param["partitions"] == pytest.approx(2.0, abs=1e-4)
    assert p.bytes_per_param["grads"] == 2.0
    fp32 = predict_memory("tiny", "zero2_fp32.json", world=1, micro_batch=2)
    assert fp32.bytes_per_param["optimizer_state"] == pytest.approx(8.0, abs=1e-4)  # fp32 Adam, no master
    # the engine's one-rank settings (recipe.training.engine.engine_config): no contiguous-gradient reduce
    # buckets at one rank (the census finds none), DeepSpeed's default ones at two
    assert p.buffer_bytes == 0
    two = predict_memory("tiny", "zero2_bf16_halfmaster.json", world=2, micro_batch=2)
    assert two.buffer_bytes > 0


# ----------------------------------------------------------------------------------------------
# activation accounting
# ----------------------------------------------------------------------------------------------


def test_saved_counter_matches_hand_count() -> None:
    """Linear -> ReLU -> Linear at batch B saves x (B x 8) and the ReLU output (B x 16) once (the
    second Linear saves the same tensor); weights are model state, not activations."""
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for batch in (3, 5):
        x = torch.randn(batch, 8)
        with count_saved() as counter:
            net(x).sum()
        assert counter.bytes == batch * (8 + 16) * 4


def test_saved_counter_sees_checkpointed_segment() -> None:
    """With a checkpointed segment the segment's input is kept (4·B·16 bytes) and its own saved
    tensors are recomputed in backward: the recomputation peak is the hand count of that segment."""
    inner = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    first = nn.Linear(8, 16)
    batch = 4
    x = torch.randn(batch, 8)
    with count_saved() as counter:
        h = first(x)
        torch.utils.checkpoint.checkpoint(inner, h, use_reentrant=False).sum()
    assert counter.segments == 1
    assert counter.bytes == batch * (8 + 16) * 4  # x for the first Linear, h kept for the recomputation
    assert counter.segment_peak == batch * (16 + 32) * 4  # h and the ReLU output, recomputed


@pytest.mark.parametrize("checkpointing", [False, True])
def test_meta_activations_match_cpu(checkpointing: bool) -> None:
    """The meta-device count (used for every plan) agrees with the same count on real CPU tensors."""
    torch.manual_seed(0)
    from recipe.model import create_model

    cpu = measure_activations(create_model("tiny"), torch.bfloat16, checkpointing)
    meta = measure_activations(build_meta_model(ModelSpec("tiny")), torch.bfloat16, checkpointing)
    assert meta.per_sample == pytest.approx(cpu.per_sample, rel=0.1)
    assert meta.recompute_per_sample == pytest.approx(cpu.recompute_per_sample, rel=0.1)
    if checkpointing:
        assert meta.per_sample < 0.5 * measure_activations(
            build_meta_model(ModelSpec("tiny")), torch.bfloat16, False).per_sample


def test_loss_memory_plain_vs_chunked() -> None:
    """Plain keeps M x NM fp32 blocks (2 per direction); chunked keeps tiles only."""
    plain = predict_memory("tiny", "zero2_bf16_halfmaster.json", world=2, micro_batch=256, loss_mode="plain")
    chunked = predict_memory("tiny", "zero2_bf16_halfmaster.json", world=2, micro_batch=256, loss_mode="chunked",
                             chunk_size=64)
    blocks = 4 * 256 * 512 * 4  # four fp32 256 x 512 blocks
    assert blocks <= plain.loss_bytes <= 1.6 * blocks
    assert chunked.loss_bytes < plain.loss_bytes / 4


# ----------------------------------------------------------------------------------------------
# search, command line, errors
# ----------------------------------------------------------------------------------------------


def test_plan_prefers_no_checkpointing_and_little_accumulation() -> None:
    roomy = plan("tiny", gpus=2, gpu_memory="64GiB", global_batch=256)
    assert (roomy.micro_batch, roomy.accumulation, roomy.checkpointing) == (128, 1, False)
    # the recipe's default on any number of GPUs: bf16 at ZeRO-0 (replicated, one bf16 gradient all-reduce)
    assert roomy.ds_config == "ds_configs/zero0_bf16_sr.json" and roomy.zero_stage == 0
    one = plan("tiny", gpus=1, gpu_memory="64GiB", global_batch=256)  # nothing to shard: bf16 at ZeRO-0
    assert one.ds_config == "ds_configs/zero0_bf16_sr.json" and one.zero_stage == 0
    assert one.total_bytes_per_gpu < predict_memory("tiny", "zero2_bf16_halfmaster.json", world=1,
                                                    micro_batch=one.micro_batch).total_bytes
    tight = plan("tiny", gpus=2, gpu_memory="1300MiB", global_batch=8192, headroom=0.0)
    assert tight.total_bytes_per_gpu <= tight.usable_bytes
    assert tight.accumulation > 1 or tight.checkpointing
    assert tight.micro_batch * tight.accumulation * 2 == 8192


def _launch_args(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[:2] == ["NUM_GPUS=2", words[1]] and words[1].startswith("DS_CONFIG=")
    assert words[2:4] == ["bash", "launch.sh"]
    return words[4:]


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = main(["--preset", "tiny", "--gpus", "2", "--gpu-memory", "8GiB", "--global-batch", "512",
               "--ds-config-out", str(out), "--train-data", "data/x.csv", "--loss-mode", "chunked",
               "--no-count-vocab"])  # data that is not here: the vocabulary is --vocab-size, an upper bound
    text = capsys.readouterr().out
    assert rc == 0
    assert "plan: micro-batch" in text and "| **peak** |" in text
    command = text.strip().splitlines()[-1]
    args = _launch_args(command)
    parsed = build_parser().parse_args(args + ["--deepspeed_config", str(out)])  # recipe.train's own parser
    assert getattr(parsed, "model.preset") == "tiny" and parsed.loss_mode == "chunked"
    assert getattr(parsed, "data.train_data") == "data/x.csv"
    written = read_ds_config(out, world_size=2)  # the JSON the command names, checked as recipe.train does
    assert written["train_micro_batch_size_per_gpu"] * written["gradient_accumulation_steps"] * 2 == 512


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "tiny", "--gpus", "2", "--gpu-memory", "8GB", "--global-batch", "64", "--json",
                 "--no-write", "--grad-checkpointing", "on"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["checkpointing"] is True and "--grad-checkpointing" in data["launch_command"]
    assert set(data["bytes_per_param"]) == {"weights", "partitions", "grads", "optimizer_state", "buffers"}


@pytest.mark.parametrize("text, expected", [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("81920MiB", 80 * 2**30),
                                            ("0.5 gib", 2**29)])
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "ViT-Z-99"], "unknown preset 'ViT-Z-99'"),
        (["--preset", "", "--image-encoder", "not_a_timm_model", "--text-encoder", "clip-text"],
         "image encoder 'not_a_timm_model'"),
        (["--preset", "", "--image-encoder", "resnet18", "--text-encoder", "no-such-tower"], "text encoder 'no-such-tower'"),
        (["--preset", "tiny", "--global-batch", "100", "--gpus", "8"], "global batch 100 is not divisible by 8 GPUs"),
        (["--preset", "tiny", "--gpu-memory", "80"], "has no unit"),
        (["--preset", "tiny", "--gpu-memory", "80 gigs"], "expected a number and a unit"),
        (["--preset", "tiny", "--gpu-memory", "1MiB", "--gpus", "2", "--global-batch", "64"], "nothing fits"),
        (["--preset", "tiny", "--ds-config", "ds_configs/missing.json"], "not found"),
        (["--preset", "tiny", "--train-data", "missing/train.csv"],
         "cannot read the captions of --train-data missing/train.csv to size the vocabulary"),
        (["--preset", "tiny", "--tokenizer", "missing/tokenizer"], "cannot read --tokenizer missing/tokenizer"),
    ],
)
def test_bad_input_is_a_clear_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv + ["--no-write"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("preset, image, text", [("ViT-Z-99", None, None), (None, "not_a_timm_model", "clip-text"),
                                                 (None, "resnet18", "no-such-tower"), (None, "resnet18", None)])
def test_model_names_are_checked_by_the_config_check(preset, image, text) -> None:
    """One owner of the model-name check (recipe.config.check_model_names): the planner says what training says."""
    with pytest.raises(ValueError) as expected:
        check_model_names(preset, image, text)
    with pytest.raises(PlanError) as got:
        plan(ModelSpec(preset, image, text), gpus=1, gpu_memory="80GiB", global_batch=8)
    assert str(got.value) == str(expected.value)


def test_nothing_fits_names_the_term() -> None:
    # the global contrastive batch of 4096 makes the plain loss's 4096 x 4096 fp32 blocks the largest term
    with pytest.raises(PlanError, match="largest term is plain loss.*--loss-mode chunked"):
        plan("tiny", gpus=1, gpu_memory="40MiB", global_batch=4096, ds_config="zero0_fp16_sr_lossscale.json")
    with pytest.raises(PlanError, match=r"needs 4\.8\d MiB; its largest term is model states"):
        plan("tiny", gpus=1, gpu_memory="1MiB", global_batch=4, ds_config="zero0_fp16_sr_lossscale.json",
             contrastive_batch="micro", checkpointing=False)


# ----------------------------------------------------------------------------------------------
# the run's vocabulary, and what the peak is made of
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's kind of data (recipe.synthetic), small: captions with few distinct words."""
    out = tmp_path_factory.mktemp("demo")
    write_dataset(str(out), 200, n_val=12, image_size=16, seed=0)
    return out


def test_plan_counts_the_parameters_of_the_model_the_run_builds(demo_data: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny preset on the demo's kind of data: the run trains a BPE of a few hundred tokens, not the
    text tower's 4,096 (the demo: 247,233 parameters, not 486,081). The plan's parameter count is that of
    the model recipe.train builds from the plan's own launch command (its tokenizer, then its model),
    also when the run is given that tokenizer (--tokenizer)."""
    from recipe.config import parse_args
    from recipe.train import build_model, get_tokenizer

    def planned(*extra: str) -> dict:
        assert main(["--preset", "tiny", "--gpus", "2", "--gpu-memory", "8GiB", "--global-batch", "64", "--json",
                     "--ds-config-out", str(tmp_path / "plan.json"), *extra]) == 0
        return json.loads(capsys.readouterr().out)

    plan_json = planned("--train-data", str(demo_data / "train.csv"))
    run = tmp_path / "run"
    run.mkdir()
    cfg = parse_args(_launch_args(plan_json["launch_command"])
                     + ["--deepspeed_config", str(tmp_path / "plan.json"), "--output-dir", str(run)])
    tok = get_tokenizer(cfg, run)
    model = build_model(cfg, tok, run)
    params = sum(p.numel() for p in model.parameters())
    assert tok.vocab_size < 1000 and model.text.config.vocab_size == tok.vocab_size
    assert plan_json["prediction"]["params"] == params
    assert plan_json["vocabulary"].startswith(f"{tok.vocab_size:,} tokens (the BPE recipe.train trains")

    # the tokenizer the run saved, given to the planner as the run would be given it
    loaded = planned("--tokenizer", str(run / "tokenizer"))
    assert loaded["prediction"]["params"] == params and "--tokenizer" in loaded["launch_command"]

    # without data: --vocab-size (recipe.train's default), an upper bound; the context length is the run's
    bound = run_tokenizer(None)
    assert bound.upper_bound and bound.vocab_size == cfg.data.vocab_size and bound.context_length == tok.context_length
    assert planned()["prediction"]["params"] > params


def test_without_data_the_vocabulary_is_said_to_be_an_upper_bound(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "tiny", "--gpus", "2", "--gpu-memory", "8GiB", "--global-batch", "64", "--no-write",
                 "--vocab-size", "1024"]) == 0
    text = capsys.readouterr().out
    assert "text vocabulary: at most 1,024 tokens (--vocab-size, an upper bound: the tokenizer the run trains" in text
    assert "give --train-data to count it" in text and "--vocab-size 1024" in text.splitlines()[-1]


@pytest.mark.parametrize("accumulation, contrastive", [(1, "global"), (4, "global"), (4, "micro")])
def test_peak_terms_add_up_to_the_peak(accumulation: int, contrastive: str) -> None:
    """One micro-batch at a time: the peak is the table's rows summed. Global contrastive batch over k > 1
    steps: backward and loss are separate phases; only the larger counts, so the peak is below the rows' sum."""
    p = predict_memory("tiny", "zero2_bf16_halfmaster.json", world=2, micro_batch=8, accumulation=accumulation,
                       contrastive_batch=contrastive)
    t = p.peak_terms()
    rows = (sum(p.bytes_per_param.values()) * p.params + p.activation_bytes + p.cache_bytes + p.gathered_bytes
            + p.loss_bytes)
    assert p.backward_buffer_bytes > 0 and p.buffer_bytes >= p.backward_buffer_bytes  # ZeRO-2 at two ranks
    if p.phased():
        assert p.total_bytes == t["model states"] + t["embedding cache"] + max(t["backward"], t["loss"])
        assert p.total_bytes == pytest.approx(rows - min(t["backward"], t["loss"]), abs=8) and min(t.values()) > 0
    else:
        assert p.total_bytes == sum(t.values()) == pytest.approx(rows, abs=8)


@pytest.mark.parametrize("argv, says", [
    (["--gpu-memory", "8GiB", "--global-batch", "512"], "peak = the rows' sum, all alive at once"),
    (["--gpu-memory", "1300MiB", "--global-batch", "8192", "--headroom", "0"],
     "the larger of one micro-batch's backward"),
])
def test_the_output_says_what_the_peak_is_made_of(argv: list[str], says: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "tiny", "--gpus", "2", "--no-write", *argv]) == 0
    text = capsys.readouterr().out
    [line] = [x for x in text.splitlines() if x.startswith("peak = ")]
    assert says in line and "left to the" in line and "headroom" in line
    activations = [x for x in text.splitlines() if x.startswith("| activations")][0].split("|")[-2].strip()
    assert f"activations {activations}" in line and activations != format_bytes(0)  # the row's figure, named

"""The start-of-run note for bf16 on a CPU without bf16 instructions (recipe/training/precision.py): said for
BatchNorm and convolutional towers on such a CPU, never for the demo's ViT, fp32, a GPU, or a CPU that
has the instructions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recipe.model import create_model
from recipe.model.tokenizer import train_tokenizer
from recipe.training.precision import Precision, cpu_has_bf16, slow_bf16_on_cpu

BF16 = Precision("bf16", 2, torch.bfloat16, torch.bfloat16, True)
FP32 = Precision("fp32", 2, torch.float32, torch.float32, False)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["a red circle on white", "a blue square on grey"] * 8, vocab_size=300, context_length=16)


@pytest.fixture(scope="module")
def resnet(tokenizer):
    return create_model(None, image_encoder="resnet18", text_encoder="bert-tiny", embed_dim=32, image_size=32,
                        tokenizer=tokenizer)


def test_a_convnet_on_bf16_without_bf16_instructions_is_named_with_the_fast_route(resnet) -> None:
    note = slow_bf16_on_cpu(resnet, BF16, on_cpu=True, has_bf16=False)
    assert note is not None and note.startswith("note: this CPU has no bf16 instructions (AVX512-BF16 or AMX)")
    assert "20 BatchNorm2d, 20 Conv2d layers run 20-200x slower" in note
    assert note.endswith("DS_CONFIG=ds_configs/zero2_fp32.json is the fast route on this machine")
    assert (Path(__file__).resolve().parents[3] / "ds_configs" / "zero2_fp32.json").is_file()


def test_no_note_where_bf16_is_fast(resnet, tokenizer) -> None:
    assert slow_bf16_on_cpu(resnet, BF16, on_cpu=True, has_bf16=True) is None  # the instructions are there
    assert slow_bf16_on_cpu(resnet, FP32, on_cpu=True, has_bf16=False) is None  # fp32 route
    assert slow_bf16_on_cpu(resnet, BF16, on_cpu=False, has_bf16=False) is None  # a GPU run
    demo = create_model("tiny", tokenizer=tokenizer)  # its ViT's only convolution is the patch embedding
    assert any(isinstance(m, torch.nn.Conv2d) for m in demo.modules())
    assert slow_bf16_on_cpu(demo, BF16, on_cpu=True, has_bf16=False) is None


def test_cpu_features_agree_with_the_kernel() -> None:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this system to compare with")
    assert cpu_has_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)

"""Fixtures of the optim tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture
def ieee_sqrt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the PyTorch path's float32 CPU square root correctly rounded.

    torch's CPU ``Tensor.sqrt`` for float32 goes through a vector math library and is not always
    correctly rounded (about one result in five is one ulp off the IEEE square root), while the fused
    kernel uses the IEEE ``sqrt_rn``; references of the kernel take their square root from numpy.
    """
    original = torch.Tensor.sqrt

    def sqrt(self: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32 and self.device.type == "cpu":
            return torch.from_numpy(np.sqrt(self.detach().contiguous().numpy())).view(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "sqrt", sqrt)

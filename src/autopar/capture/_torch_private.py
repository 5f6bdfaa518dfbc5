"""The one place capture/ touches PyTorch internals; if a torch release moves them, only this file changes."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["FakeTensor", "FakeTensorMode", "TorchDispatchMode", "new_fake"]

_CPU = torch.device("cpu")


def new_fake(
    mode: FakeTensorMode, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, requires_grad: bool
) -> torch.Tensor:
    """A fresh fake CPU tensor with its own storage, built without a trip through fake dispatch (5x cheaper)."""
    with _disable_current_modes():
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        fake = FakeTensor(mode, meta, _CPU)
    if requires_grad:
        fake.requires_grad_(True)
    return fake

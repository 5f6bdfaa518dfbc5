"""The one place capture/ touches PyTorch internals; if a torch release moves them, only this file changes."""

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FakeTensorMode", "TorchDispatchMode"]

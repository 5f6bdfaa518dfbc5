"""Models that cannot be traced symbolically fail with an error naming the module and the op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.capture import CaptureError


class Router(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x.sum(-1) > 0]  # data-dependent output shape


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum().item() > 0 else x  # control flow on a value


class Net(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.proj(x))


def test_data_dependent_shape_names_module_and_op() -> None:
    with pytest.raises(CaptureError) as err:
        autopar.trace(Net(Router()), (torch.zeros(3, 4),))
    message = str(err.value)
    assert "'inner'" in message and "Router" in message
    assert "aten." in message and "nonzero" in message


def test_item_in_control_flow_names_module_and_op() -> None:
    with pytest.raises(CaptureError) as err:
        autopar.trace(Net(Gate()), (torch.zeros(3, 4),))
    assert "'inner'" in str(err.value) and "_local_scalar_dense" in str(err.value)


def test_python_error_names_module() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ torch.zeros(5, 5)

    with pytest.raises(CaptureError, match="'inner'.*Broken"):
        autopar.trace(Net(Broken()), (torch.zeros(3, 4),))


def test_shapes_that_do_not_fit_are_named_as_the_model_s_own_error_in_one_line(capfd) -> None:
    """An op refusing the shapes the model gives it (sizes from a config that do not fit together) would fail on
    real tensors too: the error says so rather than blaming fake tensors, and torch's own log of the fake kernel's
    traceback (30 lines before the error) is held back."""

    class Misfit(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.ones(5)

    with pytest.raises(CaptureError) as err:
        autopar.trace(Net(Misfit()), (torch.zeros(3, 4),))
    message = str(err.value)
    assert "'inner' (Misfit)" in message and "aten.mul.Tensor fails on the shapes" in message
    assert "a real forward would fail the same way" in message and "no symbolic" not in message
    assert "failed while attempting" not in capfd.readouterr().err


def test_failed_trace_leaves_model_usable() -> None:
    model = Net(Router())
    with pytest.raises(CaptureError):
        autopar.trace(model, (torch.zeros(3, 4),))
    assert "forward" not in model.inner.__dict__
    out = model(torch.ones(3, 4))
    assert out.shape[1] == 4

"""autopar: plan and run parallel training of large PyTorch models."""

from autopar.capture import CaptureError, Graph, trace
from autopar.zoo import ModelConfig, load

__version__ = "0.1.0"

__all__ = ["CaptureError", "Graph", "ModelConfig", "ParallelModel", "__version__", "load", "parallelize", "trace"]


def __getattr__(name: str):  # noqa: ANN202 - the runtime loads torch.distributed: only when asked for
    if name in ("parallelize", "ParallelModel"):
        from autopar.runtime import apply

        return getattr(apply, name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")

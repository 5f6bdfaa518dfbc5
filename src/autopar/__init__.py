"""autopar: plan and run parallel training of large PyTorch models."""

from autopar.capture import CaptureError, Graph, trace
from autopar.zoo import ModelConfig, load

__version__ = "0.1.0"

__all__ = ["CaptureError", "Graph", "ModelConfig", "__version__", "load", "trace"]

"""Model zoo: real `nn.Module`s built on the meta device from a name (``gpt3-1.3b``, ``llama-7b``, ``hf:llama``)."""

from autopar.zoo.catalog import (
    CATALOG,
    ZooModel,
    build_model,
    config_for,
    example_inputs,
    get_config,
    load,
    model_names,
)
from autopar.zoo.config import ModelConfig

__all__ = [
    "CATALOG",
    "ModelConfig",
    "ZooModel",
    "build_model",
    "config_for",
    "example_inputs",
    "get_config",
    "load",
    "model_names",
]

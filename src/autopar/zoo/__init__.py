"""Model zoo: real `nn.Module`s built on the meta device from a name (``gpt3-1.3b``, ``llama-7b``, ``hf:llama``,
``hf:gemma``, ``hf:path/config.json``) or by a function of yours (``path/to/file.py:function``)."""

from autopar.zoo.catalog import (
    CATALOG,
    ZooModel,
    build_model,
    config_for,
    describe,
    example_inputs,
    get_config,
    load,
    model_names,
    synthetic_batch,
)
from autopar.zoo.config import ModelConfig

__all__ = [
    "CATALOG",
    "ModelConfig",
    "ZooModel",
    "build_model",
    "config_for",
    "describe",
    "example_inputs",
    "get_config",
    "load",
    "model_names",
    "synthetic_batch",
]

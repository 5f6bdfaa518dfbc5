"""Exports of a plan to the stacks users train with: torchtitan 0.3 (`to_torchtitan`: overrides of its
``Trainer.Config``) and Megatron-LM (`to_megatron`: its training arguments). Pure functions from a `Plan` to an
`Export`; what a target cannot express is an `Approximation` with the closest setting, never dropped."""

from autopar.export.megatron import to_megatron
from autopar.export.result import Approximation, Export, Target
from autopar.export.torchtitan import to_torchtitan

__all__ = ["Approximation", "Export", "Target", "to_megatron", "to_torchtitan"]

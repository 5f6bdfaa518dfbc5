"""Plan files: the JSON a search writes and the runtime reads (versioned; loading never runs code)."""

from autopar.plan.io import SCHEMA_VERSION, load_plan, save_plan

__all__ = ["SCHEMA_VERSION", "load_plan", "save_plan"]

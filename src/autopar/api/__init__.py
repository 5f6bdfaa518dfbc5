"""autopar from Python: plan a model of one's own (`plan`, `plan_once`), then run the plan in one's own training
loop (`autopar.parallelize`, `ParallelModel.step`). The command line's ``autopar plan`` calls the same planner
(`autopar.api.search`) and prints the same report (`autopar.api.report`)."""

from autopar.api.planning import plan, plan_once

__all__ = ["plan", "plan_once"]

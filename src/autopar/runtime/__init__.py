"""Runtime: apply a plan with PyTorch's distributed engine, train on synthetic data, check against one process."""

from autopar.runtime.apply import ParallelModel, check_supported, parallelize
from autopar.runtime.launch import run_plan
from autopar.runtime.train import StepLog, Workload, reference
from autopar.runtime.validate import check_runnable

__all__ = ["ParallelModel", "StepLog", "Workload", "check_runnable", "check_supported", "parallelize", "reference",
           "run_plan"]

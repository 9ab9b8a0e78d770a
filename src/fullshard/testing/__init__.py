"""Helpers for fullshard's own tests and benchmarks: a multi-rank runner and a zoo of tiny models."""

from .spawn import DistributedTestError, reported_by_every_rank, run_distributed
from .zoo import ZOO, build_model, make_batch, tiny_config

__all__ = ["DistributedTestError", "reported_by_every_rank", "run_distributed", "ZOO", "build_model", "make_batch",
           "tiny_config"]

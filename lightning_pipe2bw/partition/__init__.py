"""Splitting a model into pipeline stages."""

from lightning_pipe2bw.partition.build import build_stage
from lightning_pipe2bw.partition.memoryplan import MemoryPlan, plan_memory
from lightning_pipe2bw.partition.split import BodyRef, Partition, find_body, make_partition

__all__ = [
    "BodyRef",
    "MemoryPlan",
    "Partition",
    "build_stage",
    "find_body",
    "make_partition",
    "plan_memory",
]

"""Splitting a model into pipeline stages."""

from lightning_pipe2bw.partition.build import build_stage
from lightning_pipe2bw.partition.split import BodyRef, Partition, find_body, make_partition

__all__ = [
    "BodyRef",
    "Partition",
    "build_stage",
    "find_body",
    "make_partition",
]

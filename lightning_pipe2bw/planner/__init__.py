"""The planner: a profile of the body's blocks (``profile``, ``measure``, ``timing``), a cost
model of each schedule (``costmodel``, ``simcosts``, ``virtualplan`` for several stages per
rank), the partition search (``partitioner``), the plans it returns (``plans``) and the search
over depth, data-parallel width, micro-batch size and recomputation (``planner``), and the
memory plan (``memoryplan``). Pure functions of a profile; ``pipeline/autoplan.py`` runs them
for ``balance="auto"``."""

from lightning_pipe2bw.planner.memoryplan import MemoryPlan, plan_memory

__all__ = ["MemoryPlan", "plan_memory"]

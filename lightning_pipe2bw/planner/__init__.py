"""The planner: a profile of the body's blocks (``profile``, ``measure``, ``timing``), a cost
model of each schedule (``costmodel``, ``simcosts``, ``virtualplan`` for several stages per
rank), the partition search (``partitioner``), the plans it returns (``plans``) and the search
over depth, data-parallel width, micro-batch size and recomputation (``planner``), and the
memory plan (``memoryplan``): pure functions of a profile. Then the planner at work:
``balance="auto"`` measured and planned on the ranks (``autoplan``: the pipeline's layer) and under
Lightning (``hooks``: at set-up, and the throughput check; ``loopcost``: Lightning's loop's own
cost per step, measured once and kept), the seam's layer (``docs/design.md``)."""

from lightning_pipe2bw.planner.memoryplan import MemoryPlan, plan_memory

__all__ = ["MemoryPlan", "plan_memory"]

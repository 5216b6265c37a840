"""The pipeline below the Lightning seam: options, the process mesh, a stage's assembled runtime
and ``balance="auto"`` (checkpoints, repartitioning and failures have their own folders).

Nothing here imports ``lightning.pytorch``: the strategy (``lightning_pipe2bw.strategy``) turns
Lightning's hooks into calls on these pieces (see ``docs/design.md``).
"""

from lightning_pipe2bw.pipeline.options import PipeOptions, Problem
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.pipeline.topology import Topology

__all__ = ["PipeOptions", "Problem", "StageRuntime", "Topology"]

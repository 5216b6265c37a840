"""Memory-efficient pipeline-parallel training for PyTorch Lightning (PipeDream-2BW, 1F1B, GPipe).

Importing the package registers the strategy names with Lightning's strategy registry:
``"pipe2bw"`` (the default schedule), ``"pipe2bw_spawn"`` (spawned workers) and
``"pipe2bw_<schedule>"`` for every schedule of ``lightning_pipe2bw.schedule.REGISTRY``
(``"pipe2bw_2bw"``, ``"pipe2bw_zb-h1"``, ...).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe2bw.callbacks import ActivationBalancer, PipelineReport, StageMemoryMonitor
from lightning_pipe2bw.optim import MuonAdamW
from lightning_pipe2bw.partition.pipemodel import PipeModel
from lightning_pipe2bw.pipeline.options import PipeOptions
from lightning_pipe2bw.runtime.items import items_in_batch
from lightning_pipe2bw.strategy import Pipe2BWStrategy

__all__ = [
    "ActivationBalancer",
    "MuonAdamW",
    "Pipe2BWStrategy",
    "PipeModel",
    "PipeOptions",
    "PipelineReport",
    "StageMemoryMonitor",
    "items_in_batch",
]
__version__ = "0.1.0"

Pipe2BWStrategy.register_strategies(StrategyRegistry)

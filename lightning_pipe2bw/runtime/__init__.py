"""The pipeline runtime: the stage module, the action interpreter and P2P transport."""

from lightning_pipe2bw.runtime.engine import ActionTiming, PipelineEngine
from lightning_pipe2bw.runtime.microbatch import merge_outputs, split_batch
from lightning_pipe2bw.runtime.stage import StageBody
from lightning_pipe2bw.runtime.transport import P2PTransport

__all__ = [
    "ActionTiming",
    "P2PTransport",
    "PipelineEngine",
    "StageBody",
    "merge_outputs",
    "split_batch",
]

"""The process mesh as plain arithmetic: which global rank runs which stage of which replica.

``world_size`` ranks form ``data_parallel`` pipeline replicas of ``num_stages`` stages each.
Replica r holds the contiguous ranks ``r * num_stages ..``, so a pipeline stays inside a node
where it fits, and inside a replica the ranks run the stages in *reverse*: global rank 0 runs
the last stage, where the loss is computed, so Lightning's progress bar, loggers and checkpoint
writer (which live on rank 0) see each step's values the moment they exist.

Nothing here talks to other processes: the groups built from this layout are in
:mod:`lightning_pipe2bw.pipeline.groups`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipe2bw.pipeline.options import PipeOptions, Problem, raise_problems

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """Rank ``rank`` of ``world_size``, in ``data_parallel`` pipelines (see the module notes).
    Build it with :meth:`create`, which checks that the replicas divide the world."""

    world_size: int
    data_parallel: int = 1
    rank: int = 0

    @classmethod
    def create(cls, world_size: int, data_parallel: int = 1, rank: int = 0) -> Topology:
        raise_problems(cls.problems(world_size, data_parallel))
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size} processes")
        return cls(world_size, data_parallel, rank)

    @staticmethod
    def problems(world_size: int, data_parallel: int) -> list[Problem]:
        w = data_parallel
        if world_size % w == 0:
            return []
        return [
            Problem(
                "data_parallel",
                w,
                f"data_parallel={w} does not divide the {world_size} processes (devices x "
                f"num_nodes); use a data_parallel that divides {world_size}, or "
                f"{w * max(world_size // w, 1)} devices",
            )
        ]

    # ------------------------------------------------------------------ the layout
    @property
    def num_stages(self) -> int:
        return self.world_size // self.data_parallel

    @property
    def replica(self) -> int:
        """This rank's pipeline replica."""
        return self.rank // self.num_stages

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (global rank 0 runs the last)."""
        return self.num_stages - 1 - self.rank % self.num_stages

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def rank_of_stage(self, stage: int, replica: int | None = None) -> int:
        """The global rank that runs ``stage`` of ``replica`` (default: this rank's)."""
        replica = self.replica if replica is None else replica
        return replica * self.num_stages + self.num_stages - 1 - stage

    @property
    def prev_rank(self) -> int | None:
        """The rank of the stage before this one in its pipeline (None on the first)."""
        return None if self.is_first else self.rank_of_stage(self.stage - 1)

    @property
    def next_rank(self) -> int | None:
        """The rank of the stage after this one in its pipeline (None on the last)."""
        return None if self.is_last else self.rank_of_stage(self.stage + 1)

    @property
    def last_rank(self) -> int:
        """The rank of this pipeline's last stage (where the loss and the logged values are)."""
        return self.rank_of_stage(self.num_stages - 1)

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        """The ranks of one pipeline replica, in stage order."""
        return [self.rank_of_stage(s, replica) for s in range(self.num_stages)]

    def stage_ranks(self, stage: int | None = None) -> list[int]:
        """The ranks that run ``stage`` (default: this rank's), one per replica."""
        stage = self.stage if stage is None else stage
        return [self.rank_of_stage(stage, r) for r in range(self.data_parallel)]

    def partner(self, stage: int | None = None) -> int:
        """BPipe's partner of ``stage`` (default: this rank's): stage p - 1 - s."""
        stage = self.stage if stage is None else stage
        return self.num_stages - 1 - stage

    # ------------------------------------------------------------------ options vs the layout
    def option_problems(self, options: PipeOptions) -> list[Problem]:
        """The options that describe another number of stages than this layout's."""
        world, w, p = self.world_size, self.data_parallel, self.num_stages
        problems: list[Problem] = []
        if options.balance is not None and len(options.balance) != p:
            stages = len(options.balance)
            hint = (
                f"data_parallel={world // stages} ({world // stages} pipelines of {stages} "
                f"stages) or devices={stages * w}"
                if world % stages == 0
                else f"a device count divisible by {stages}"
            )
            problems.append(
                Problem(
                    "balance",
                    options.balance,
                    f"balance={list(options.balance)} describes {stages} stages but {world} "
                    f"devices with data_parallel={w} make pipelines of {p} stages; use {hint}",
                )
            )
        flags = options.recompute
        if isinstance(flags, tuple) and len(flags) != p:
            problems.append(
                Problem(
                    "recompute",
                    flags,
                    f"recompute={list(flags)} has {len(flags)} entries but the pipeline has {p} "
                    "stages; give one bool per stage, or one bool for all",
                )
            )
        return problems

    def describe(self) -> str:
        return (
            f"rank {self.rank} of {self.world_size}: stage {self.stage} of {self.num_stages} in "
            f"replica {self.replica} of {self.data_parallel}"
        )

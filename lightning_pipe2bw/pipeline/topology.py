"""The process mesh as plain arithmetic: which global rank runs which stage of which replica.

``world_size`` ranks form ``data_parallel`` pipeline replicas of ``num_stages`` stages each.
Replica r holds the contiguous ranks ``r * num_stages ..``, so a pipeline stays inside a node
where it fits, and inside a replica the ranks run the stages in *reverse*: global rank 0 runs
the last stage, where the loss is computed, so Lightning's progress bar, loggers and checkpoint
writer (which live on rank 0) see each step's values the moment they exist.

With virtual stages (``placement``) a rank holds several stages of the pipeline: ``stage``
and ``num_stages`` still count ranks (the rank's place in its pipeline, the pipeline's ranks),
and :attr:`stages_here` names the stages of the whole pipeline (``len(placement)`` of them) it
holds. The loss is where the last of them is: on the last rank for a looped placement, on the
first for a V.

Nothing here talks to other processes: the groups built from this layout are in
:mod:`lightning_pipe2bw.pipeline.groups`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipe2bw.pipeline.options import PipeOptions, Problem, raise_problems
from lightning_pipe2bw.schedule import placement_of

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """Rank ``rank`` of ``world_size``, in ``data_parallel`` pipelines (see the module notes).
    Build it with :meth:`create`, which checks that the replicas divide the world."""

    world_size: int
    data_parallel: int = 1
    rank: int = 0
    # virtual stages: the rank (place in the pipeline) of each stage; None: one stage per rank
    placement: tuple[int, ...] | None = None

    @classmethod
    def create(cls, world_size: int, data_parallel: int = 1, rank: int = 0) -> Topology:
        raise_problems(cls.problems(world_size, data_parallel))
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size} processes")
        return cls(world_size, data_parallel, rank)

    @classmethod
    def for_schedule(
        cls, world_size: int, data_parallel: int, rank: int, schedule: str
    ) -> Topology:
        """The layout for ``schedule``: virtual stages where it holds several per rank (see
        ``schedule.placement_of``). Unchecked, like the constructor."""
        p = world_size // data_parallel if data_parallel and world_size % data_parallel == 0 else 1
        return cls(world_size, data_parallel, rank, placement_of(schedule, max(p, 1)))

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
        """This rank holds the pipeline's first stage."""
        return self.stage == self.place_of(0)

    @property
    def is_last(self) -> bool:
        """This rank holds the pipeline's last stage (the loss)."""
        return self.stage == self.place_of(self.num_virtual - 1)

    # ------------------------------------------------------------------ virtual stages
    @property
    def num_virtual(self) -> int:
        """The pipeline's stages (its ranks', unless a rank holds several)."""
        return self.num_stages if self.placement is None else len(self.placement)

    def place_of(self, virtual: int) -> int:
        """The place in the pipeline (``stage``) of the rank that holds stage ``virtual``."""
        return virtual if self.placement is None else self.placement[virtual]

    @property
    def stages_here(self) -> tuple[int, ...]:
        """The stages of the whole pipeline this rank holds, in order."""
        if self.placement is None:
            return (self.stage,)
        return tuple(v for v, place in enumerate(self.placement) if place == self.stage)

    def neighbour_ranks(self) -> dict[int, int | None]:
        """The global rank of each stage next to one this rank holds (None past either end)."""
        out: dict[int, int | None] = {}
        for v in self.stages_here:
            for other in (v - 1, v + 1):
                inside = 0 <= other < self.num_virtual
                out[other] = self.rank_of_stage(self.place_of(other)) if inside else None
        return out

    @property
    def peers(self) -> list[int]:
        """The other ranks this rank exchanges activations or gradients with."""
        ranks = self.neighbour_ranks().values()
        return sorted({r for r in ranks if r is not None and r != self.rank})

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
        return self.rank_of_stage(self.place_of(self.num_virtual - 1))

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
        if self.placement is not None:
            problems.extend(self._virtual_problems(options))
            if options.balance is not None and len(options.balance) != self.num_virtual:
                stages = len(options.balance)
                problems.append(
                    Problem(
                        "balance",
                        options.balance,
                        f"balance={list(options.balance)} describes {stages} stages but "
                        f"schedule={options.schedule!r} runs {self.num_virtual} stages on the "
                        f"{p} ranks of each pipeline; give {self.num_virtual} block counts",
                    )
                )
        elif options.balance is not None and len(options.balance) != p:
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

    def _virtual_problems(self, options: PipeOptions) -> list[Problem]:
        """What a schedule with several stages per rank does not run with (yet), each with
        the way out."""
        name, p = options.schedule, self.num_stages
        problems: list[Problem] = []
        m = options.num_microbatches(p)
        message = options.spec.microbatch_message(m, p)
        if message is not None:
            problems.append(Problem("microbatches", m, message))
        refused = [
            ("activation_budget", options.activation_budget is not None,
             "balance_activations / ActivationBalancer (BPipe)",
             "a V placement (schedule='zb-v') balances activations by itself"),
            ("memory_plan", "evict" in (options.memory_plan or {}).values(),
             "memory_plan 'evict' entries (BPipe)", "use 'swap' or 'recompute' for those blocks"),
            ("repartition_every", options.repartition_every is not None,
             "live repartitioning (repartition_every)", "repartition between runs instead"),
        ]  # fmt: skip
        for option, given, what, fix in refused:
            if given:
                problems.append(
                    Problem(
                        option,
                        getattr(options, option),
                        f"schedule={name!r} holds {len(self.placement or ())} stages on "
                        f"{p} ranks, which {what} does not support yet; {fix}, or use a "
                        "schedule with one stage per rank ('1f1b', 'zb-h1', '2bw')",
                    )
                )
        return problems

    def describe(self) -> str:
        return (
            f"rank {self.rank} of {self.world_size}: stage {self.stage} of {self.num_stages} in "
            f"replica {self.replica} of {self.data_parallel}"
        )

"""The checkpoint format of a pipeline: what pipe2bw adds to Lightning's checkpoint, and how a
stage reads its share back.

``state_dict_type="full"`` writes one Lightning checkpoint on rank 0: the whole model's state
dict gathered from every stage under the original names (it loads on one device), every
stage's optimizer state with the layout it was written for, and a ``"pipe2bw"`` entry (see
:meth:`CheckpointFormat.pipeline_state`). ``"sharded"`` writes a directory in which every rank
saves its own tensors with ``torch.distributed.checkpoint`` under the original names (optimizer
state and 2BW's second weight version by parameter name too), so it reloads with any number of
stages; rank 0 writes the rest of Lightning's checkpoint to ``meta.pt``.

Either way a checkpoint is written at a flush point, and the ``"pipe2bw"`` entry lets a resumed
run continue exactly: the blocks-per-stage layout (a live repartition changes it), and under
2BW the batch count and the second weight version.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch.optim import Optimizer

from lightning_pipe2bw.checkpoint.storage import (
    add_stored_optimizer_entries,
    gather_named,
    gather_optimizer_state,
    gather_state_dict,
    load_sharded,
    load_stage_optimizer_state,
    load_stage_optimizer_state_by_name,
    load_stage_state_dict,
    read_sharded_meta,
    save_sharded,
    stage_optimizer_state,
)
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.planner.plans import PlanResult

__all__ = ["CheckpointFormat", "layout_to_adopt"]

# moves the blocks to a saved blocks-per-stage layout before the state is loaded into them
AdoptLayout = Callable[[Mapping[str, Any] | None], None]

_F = TypeVar("_F", bound=Callable[..., Any])


def _stage_state(method: _F) -> _F:
    """The method reads the stage's state, which a partial body otherwise refuses to give
    (``StageBody.partial_reason``): the strategy's own reads are how the whole model is saved."""

    @functools.wraps(method)
    def wrapped(self: CheckpointFormat, *args: Any, **kwargs: Any) -> Any:
        with self.runtime.body.partial_access():
            return method(self, *args, **kwargs)

    return wrapped  # type: ignore[return-value]


def _renamed(flat: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer state keyed ``state.<name>.<key>`` / ``param_groups.<name>.<key>`` with the
    parameter names in ``names`` replaced."""
    if not names:
        return flat
    out: dict[str, Any] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        for old, new in names.items():
            if rest.startswith(old + "."):
                key = f"{head}.{new}.{rest[len(old) + 1 :]}"
                break
        out[key] = value
    return out


def layout_to_adopt(
    state: Mapping[str, Any] | None, runtime: StageRuntime, fixed: bool
) -> tuple[int, ...] | None:
    """The layout a checkpoint's ``"pipe2bw"`` entry was written with, when the run should move
    its blocks to it first: it differs from the current one, describes as many stages and
    blocks (another model's layout is not adopted: loading its state names what does not
    match), and the user did not fix a ``balance`` (``fixed``)."""
    if not state or "balance" not in state or fixed:
        return None
    current = runtime.partition
    saved = tuple(int(b) for b in state["balance"])
    if len(saved) != current.num_stages or saved == tuple(current.balance):
        return None
    if sum(saved) != current.num_blocks:
        return None
    return saved


class CheckpointFormat:
    """Saving and loading one rank's share (see the module notes). ``plan``: what
    ``balance="auto"`` chose, saved with the layout."""

    def __init__(self, runtime: StageRuntime, plan: PlanResult | None = None) -> None:
        self.runtime = runtime
        self.plan = plan
        self.sharded = runtime.options.state_dict_type == "sharded"

    # ------------------------------------------------------------------ saving
    @_stage_state
    def model_state(self) -> dict[str, Any]:
        """The model's state to save: this stage's (sharded), or the whole model's on rank 0
        (full; collective, ``{}`` elsewhere)."""
        root, t = self.runtime.root, self.runtime.topology
        if self.sharded:
            return self.runtime.stage_state_dict()  # this stage's share, by original name
        return self._one_tensor_per_tie(gather_state_dict(root, t.rank, t.world_size))

    @_stage_state
    def whole_state(self) -> dict[str, Any]:
        """The whole model's state dict on global rank 0 (collective; ``{}`` elsewhere)."""
        t = self.runtime.topology
        return self._one_tensor_per_tie(gather_state_dict(self.runtime.root, t.rank, t.world_size))

    def _one_tensor_per_tie(self, state: dict[str, Any]) -> dict[str, Any]:
        """Every name of a shared parameter refers to one tensor (the primary's copy), as in the
        single-device model's state dict: the file holds it once, under each of its names."""
        body, path = self.runtime.body, self.runtime.body_path
        for tie in body.ties:
            keys = [f"{path}.{body.key_of(block, name)}" for block, name in tie.uses]
            if keys[0] in state:
                for key in keys[1:]:
                    if key in state:
                        state[key] = state[keys[0]]
        return state

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s state to save: by parameter name (sharded), or every stage's in
        stage order with the layout (full; collective along the pipeline)."""
        runtime = self.runtime
        shards = runtime.shards_of(optimizer)
        if self.sharded:  # with shard_optimizer each replica writes the entries it owns
            # a parameter cut between replicas is written whole, by each of its owners; torch's
            # helper makes state for every parameter if there is none, dropped on leaving
            with shards.whole_state(optimizer) if shards is not None else contextlib.nullcontext():
                state = stage_optimizer_state(runtime.root, optimizer)
            return _renamed(state, self._stable_names())
        t = runtime.topology
        # with shard_optimizer the replicas' entries are merged first: the same state as one
        # replica without sharding holds (collective over the replicas)
        local = shards.merged_state_dict(optimizer) if shards is not None else None
        return gather_optimizer_state(
            optimizer,
            t.stage,
            t.num_stages,
            runtime.partition.balance,
            runtime.groups.pipeline,
            local_state=local,
        )

    def pipeline_state(self, consolidate: bool = True) -> dict[str, Any]:
        """The ``"pipe2bw"`` entry: the layout (schedule, stages, blocks per stage, replicas,
        the plan), and with 2BW the batch count and the second weight version by parameter
        name (gathered on rank 0, a collective, unless ``consolidate`` is False)."""
        runtime, t = self.runtime, self.runtime.topology
        state: dict[str, Any] = {
            "schedule": runtime.options.schedule,
            "num_stages": t.num_stages,
            "balance": list(runtime.partition.balance),
            "data_parallel": t.data_parallel,
        }
        if self.plan is not None:  # JSON-ready: loads with weights_only=True
            state["plan"] = self.plan.best.to_dict()
        driver = runtime.driver.state(runtime.weight_names())
        if not driver:  # a flush schedule: the weights and the optimizers are the state
            return state
        local = driver["previous_weights"]
        state["batches"] = driver["batches"]
        # its state per parameter is in the optimizer's; under a prediction the next batch's
        # view is what "previous_weights" holds
        state["delay_correction"] = driver["delay_correction"]
        state["fresh_last_stage"] = driver.get("fresh_last_stage", False)
        if consolidate:
            local = gather_named(local, t.rank, t.world_size)
        state["previous_weights"] = local
        return state

    def full_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """A full checkpoint with its ``"pipe2bw"`` entry, if it is one to resume from (it has
        optimizer states; collective then)."""
        if "optimizer_states" not in checkpoint:
            return checkpoint
        return {**checkpoint, "pipe2bw": self.pipeline_state()}

    @_stage_state
    def save_sharded(self, checkpoint: dict[str, Any], path: Any) -> None:
        """Every rank writes its own tensors (DCP), under the original model's names; rank 0
        writes the rest of Lightning's checkpoint to ``meta.pt`` (collective)."""
        meta = dict(checkpoint)
        tensors: dict[str, Any] = {"state_dict": meta.pop("state_dict")}
        pipeline = self.pipeline_state(consolidate=False)
        pipeline["format"] = "sharded"
        if "optimizer_states" in meta:
            states = meta.pop("optimizer_states")
            tensors["optimizer_states"] = {str(i): s for i, s in enumerate(states)}
            pipeline["num_optimizers"] = len(states)
        previous = pipeline.pop("previous_weights", {})
        # whether any stage holds a second version (all do, or none)
        pipeline["has_previous"] = bool(previous)
        if previous:
            tensors["previous_weights"] = previous
        meta["pipe2bw"] = pipeline
        save_sharded(path, tensors, meta, self.runtime.topology.rank)

    def _stable_names(self) -> dict[str, str]:
        """The module's current parameter names that differ from the names a checkpoint keeps
        (a model's body: ``model.3.transformer.h.2...`` while partitioned, the model's own
        names once handed back; the checkpoint always has the model's)."""
        runtime = self.runtime
        params = [p for _, p in runtime.root.named_parameters()]
        stable = runtime.parameter_names(params)
        return {
            name: new
            for (name, _), new in zip(runtime.root.named_parameters(), stable, strict=True)
            if name != new
        }

    # ------------------------------------------------------------------ loading
    @_stage_state
    def load_sharded(
        self,
        path: Any,
        weights_only: bool,
        current_optimizers: Callable[[], list[Optimizer]],
        adopt: AdoptLayout,
    ) -> dict[str, Any]:
        """Read this stage's share of a sharded checkpoint, whatever partition wrote it
        (collective): the tensors are found by name. ``adopt`` moves the blocks to the saved
        layout first; ``current_optimizers()`` then gives the user's optimizers (a move rebuilds
        them), whose state is read too."""
        meta = read_sharded_meta(path, weights_only)
        pipeline = dict(meta.get("pipe2bw", {}))
        adopt(pipeline)
        runtime = self.runtime  # after adopting: the blocks this stage runs now
        root = runtime.root
        optimizers = current_optimizers()
        template: dict[str, Any] = {"state_dict": root.state_dict()}
        restoring_optimizers = optimizers and pipeline.get("num_optimizers")
        if restoring_optimizers:
            if pipeline["num_optimizers"] != len(optimizers):
                raise ValueError(
                    f"{path} holds the state of {pipeline['num_optimizers']} optimizers, but "
                    f"configure_optimizers returned {len(optimizers)}"
                )
            stable = self._stable_names()
            template["optimizer_states"] = {}
            for i, opt in enumerate(optimizers):
                shards = runtime.shards_of(opt)  # shard_optimizer: read a cut parameter's whole
                with shards.whole_state(opt) if shards is not None else contextlib.nullcontext():
                    template["optimizer_states"][str(i)] = _renamed(
                        stage_optimizer_state(root, opt), stable
                    )
            for i, entries in template["optimizer_states"].items():
                add_stored_optimizer_entries(path, entries, f"optimizer_states.{i}.")
        names = runtime.weight_names()
        if pipeline.get("has_previous") and runtime.driver.state(names):
            template["previous_weights"] = {
                name: torch.empty_like(p)
                for name, p in zip(names, runtime.body.parameters(), strict=True)
            }
        load_sharded(path, template)
        checkpoint = {**meta, "state_dict": template["state_dict"]}
        if restoring_optimizers:
            states = template["optimizer_states"]
            back = {v: k for k, v in self._stable_names().items()}
            checkpoint["optimizer_states"] = [
                _renamed(states[str(i)], back) for i in range(len(states))
            ]
        pipeline["previous_weights"] = template.get("previous_weights", {})
        checkpoint["pipe2bw"] = pipeline
        return checkpoint

    @_stage_state
    def load_model_state(
        self, checkpoint: Mapping[str, Any], strict: bool, adopt: AdoptLayout
    ) -> None:
        """Load this stage's weights and continue the driver where the checkpoint left it
        (collective when ``strict``)."""
        pipeline = checkpoint.get("pipe2bw")
        if (pipeline or {}).get("format") != "sharded":  # sharded: adopted when read
            adopt(pipeline)
        runtime = self.runtime
        load_stage_state_dict(runtime.root, checkpoint["state_dict"], strict)
        if pipeline:
            # a checkpoint without a batch count (a flush schedule's, or not pipe2bw's)
            # restarts 2BW's rule at the loaded weights, as at the start of training
            runtime.driver.resume(dict(pipeline), runtime.weight_names())

    def load_optimizer_states(
        self, optimizers: list[Optimizer], checkpoint: Mapping[str, Any]
    ) -> None:
        """Give each optimizer (the user's) its state for this stage's parameters."""
        runtime = self.runtime
        sharded = checkpoint.get("pipe2bw", {}).get("format") == "sharded"
        t = runtime.topology
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"], strict=True):
            if sharded:
                load_stage_optimizer_state_by_name(runtime.root, optimizer, state)
            else:
                load_stage_optimizer_state(optimizer, state, t.stage, runtime.partition.balance)
            shards = runtime.shards_of(optimizer)
            if shards is not None:  # the stage's whole state was read: keep this replica's
                shards.keep_own(optimizer)

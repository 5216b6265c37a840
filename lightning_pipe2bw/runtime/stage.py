"""The module a rank keeps in place of the body: its own blocks, under their original names."""

from __future__ import annotations

import itertools
import operator
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from lightning_pipe2bw.runtime.inplace import copy_tensors, tensor_versions
from lightning_pipe2bw.runtime.stash import ActivationStash

__all__ = [
    "BodyCall",
    "BodyInput",
    "RemoteBlock",
    "StageBody",
    "add_block_index",
    "call_input",
    "drop_block_index",
]

# Called with (stage body, the input the user's step passed to the body); returns what the body
# call returns to the user's code, or raises to stop the step (see runtime.engine).
BodyCall = Callable[["StageBody", Any], Any]


@dataclass(frozen=True)
class BodyInput:
    """The arguments the user's step passed to a body that takes any call
    (``self.model(input_ids, labels=y)``, see ``partition.pipemodel``)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _unflatten_body_input(children: Iterable[Any], _: Any) -> BodyInput:
    args, kwargs = children
    return BodyInput(tuple(args), dict(kwargs))


# a pytree node: its tensors are found, copied and moved like those of a tuple or dict
pytree.register_pytree_node(
    BodyInput,
    lambda b: ([b.args, b.kwargs], None),
    _unflatten_body_input,
    serialized_type_name="lightning_pipe2bw.BodyInput",
)


@contextmanager
def call_input(block: nn.Module, call: Any) -> Iterator[None]:
    """Give a block that takes them (``takes_call_input``: a model's last block, its head) the
    step's own arguments for one call: on the last stage the body's input is the received
    activation, while the head needs the step's labels."""
    if not getattr(block, "takes_call_input", False):
        yield
        return
    previous = block.__dict__.get("call_input")
    block.__dict__["call_input"] = call if isinstance(call, BodyInput) else None
    try:
        yield
    finally:
        block.__dict__["call_input"] = previous


class RemoteBlock(nn.Module):
    """What indexing a :class:`StageBody` gives for a block another stage holds: a module
    without parameters or buffers, so that parameter groups built by indexing the body
    (``self.body[-1].parameters()``) are simply empty on the stages that do not hold the block.
    It is not registered anywhere (no state-dict entry); calling it, or reading an attribute the
    real block would have, raises an error naming the stage that holds it."""

    def __init__(self, index: int, stage: int, here: Sequence[int], indices: list[int]) -> None:
        super().__init__()
        self.index, self.stage, self.here, self.here_blocks = index, stage, here, indices

    def _where(self) -> str:
        runs = f"stage {self.here[0]}" if len(self.here) == 1 else f"stages {list(self.here)}"
        return (
            f"block {self.index} of the pipeline body lives on stage {self.stage}; this rank runs "
            f"{runs} and holds blocks {self.here_blocks} only"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._where()}, so it cannot run it here")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise AttributeError(
                f"{self._where()}: its attribute {name!r} is not here. Indexing the body gives "
                "the stage's own blocks and, for the others, an empty module (its parameters() "
                "are empty), which is what building optimizer parameter groups needs"
            ) from None

    def extra_repr(self) -> str:
        return f"index={self.index}, stage={self.stage}"


class StageBody(nn.Module):
    """This rank's share of the body.

    Blocks keep their index in the original ``nn.Sequential`` as their name, so the stage's
    ``state_dict`` keys are exactly the original model's keys for the owned blocks, and gathering
    every stage's dict gives the unpartitioned model's dict.

    Indexed like the ``nn.Sequential`` it replaces (``len``, ``body[i]``, ``body[a:b]``,
    iteration), by the original block indices: an owned block is itself, a block of another stage
    a :class:`RemoteBlock` without parameters. So ``self.body[-1].parameters()`` in
    ``configure_optimizers`` (a head's learning rate) gives the head's parameters on the stage
    that holds it and nothing elsewhere: every stage builds the same parameter groups over its
    own parameters.

    Calling the module (as the user's step does with ``self.body(x)``) is routed to the pipeline
    engine, which decides what the call means on this stage: capture the input and stop (first
    stage), or return the received activation run through the local blocks (last stage).
    """

    def __init__(
        self,
        blocks: Iterable[tuple[int, nn.Module]],
        stage: int,
        num_stages: int,
        balance: tuple[int, ...] = (),
        *,
        recompute: bool = False,
        memory_plan: Mapping[int, str] | None = None,
        takes_any_call: bool = False,
        owner: Mapping[str, int] | None = None,
        ties: Iterable[Any] = (),
        model: nn.Module | None = None,
        restore: Callable[[Mapping[int, nn.Module]], nn.Module] | None = None,
        release: Callable[[list[nn.Module]], None] | None = None,
        built_on_meta: bool = False,
        stages: Sequence[int] | None = None,
    ) -> None:
        """``takes_any_call``: the body is a model's (``partition.pipemodel``): its call takes any
        arguments, passed on as a :class:`BodyInput`; ``owner``: then the block that holds each
        of the model's state-dict keys (the stage's keys are the model's, without the index);
        ``model``: that model object (its blocks point into it; not a child: it holds other
        stages' blocks too), ``restore``: builds what the user's module holds again from every
        block (the hand-back), ``release``: drops blocks from it (a block that leaves this stage
        frees its memory). ``ties``: the parameters several blocks of the whole body share
        (``partition.ties.Tie``); ``built_on_meta``: its blocks were built in
        ``configure_model`` (on the meta device). ``stages``: with virtual stages, the stages
        of the whole pipeline this rank holds (``num_stages`` and ``balance`` then count those
        stages; ``stage`` is the rank's place in the pipeline); default: ``(stage,)``."""
        super().__init__()
        self.stage = stage
        self.num_stages = num_stages
        self.stages: tuple[int, ...] = tuple(stages) if stages is not None else (stage,)
        self.balance = balance  # blocks per stage of the whole pipeline
        self.indices: list[int] = []
        for index, block in blocks:
            self.add_module(str(index), block)
            self.indices.append(index)
        self._call: BodyCall | None = None
        self.recompute = recompute  # recompute the blocks' activations in the backward
        # the whole body's memory plan, by block index: "keep", "recompute", "swap" or "evict"
        # (see runtime.stash); blocks not named keep theirs
        self.memory_plan: dict[int, str] = dict(memory_plan or {})
        # during a training forward: the stash told which block runs, and the micro-batch
        self.stash: ActivationStash | None = None
        self.microbatch: tuple[int, int] | None = None  # (stage, micro-batch)
        # with ``timing``, each block's forward time during training, summed (live
        # repartitioning reads and resets it); CUDA events are summed when read
        self.timing = False
        # after a Trainer call, when the whole body could not be handed back: why (state_dict
        # then raises, unless the strategy itself reads it inside ``partial_access``)
        self.partial_reason: str | None = None
        self.built_on_meta = built_on_meta  # its blocks were built in configure_model (on meta)
        self._partial_access = 0
        self._block_s: dict[int, float] = {}
        self._block_events: list[tuple[int, Any, Any]] = []
        self.takes_any_call = takes_any_call
        self.owner: dict[str, int] | None = dict(owner) if owner is not None else None
        if self.owner is not None:
            self._register_state_dict_hook(drop_block_index)
            self._register_load_state_dict_pre_hook(self._body_keys, with_module=False)
        # the original model object of a model's body (its blocks point into it); None otherwise
        self.model: nn.Module | None
        object.__setattr__(self, "model", model)  # not a child: it holds other stages' blocks
        # parameters shared by several blocks of the whole body (partition.ties.Tie)
        self.ties: list[Any] = list(ties)
        # a model's parameters (by key) whose modules its whole forward never ran: on one device
        # they get no gradient either, so the first update's check leaves them out
        self.unused_by_model: frozenset[str] = frozenset()
        # drops blocks from the model object (a block that leaves this stage frees its memory)
        self.release = release
        # builds what the user's module holds again from every block (the hand-back)
        self.restore = restore
        # recomputed regions (by their blocks' indices) whose first forward modified the
        # region's input in place: they run on a copy of it, so the recomputation sees the
        # input the first forward saw (see :meth:`_checkpoint`)
        self._modifies_input: dict[tuple[int, ...], bool] = {}
        # recomputed regions' buffers that a forward updates (batch norm's running statistics):
        # the region's blocks and the (owner, name) of each such buffer
        self._updated_buffers: dict[
            tuple[int, ...], tuple[list[nn.Module], list[tuple[nn.Module, str]]]
        ] = {}

    def run_again(self, recompute: bool, memory_plan: Mapping[int, str] | None) -> None:
        """A later Trainer call runs this (already partitioned) body again, with its own
        ``recompute`` and ``memory_plan``; the pipeline holds it whole again until that call's
        end (no partial state dict)."""
        self.recompute = recompute
        self.memory_plan = dict(memory_plan or {})
        self.partial_reason = None

    def rebalance(self, balance: Sequence[int]) -> None:
        """Live repartitioning moved blocks: the whole pipeline's blocks per stage are now
        ``balance`` (this stage's blocks moved with ``put_block`` / ``take_block``)."""
        self.balance = tuple(balance)

    def end_call(self, partial_reason: str | None) -> None:
        """The Trainer call is over: the user's module holds the whole body again (None), or
        only this stage's blocks, for ``partial_reason`` (its ``state_dict`` then raises)."""
        self.partial_reason = partial_reason

    def _body_keys(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        assert self.owner is not None
        add_block_index(state, prefix, self.owner)

    # ------------------------------------------------------------------ indexing (nn.Sequential)
    def __len__(self) -> int:
        """The number of blocks of the whole body (every stage's)."""
        return sum(self.balance) if self.balance else max(self.indices, default=-1) + 1

    def _item(self, index: int) -> nn.Module:
        if index in self.indices:
            return self.block(index)
        ends = itertools.accumulate(self.balance)
        stage = next((s for s, end in enumerate(ends) if index < end), self.num_stages - 1)
        return RemoteBlock(index, stage, self.stages, list(self.indices))

    def __getitem__(self, idx: int | slice) -> nn.Module:
        """Block ``idx`` of the whole body (see the class notes); a slice is an
        ``nn.Sequential`` of those blocks under their original names, as slicing the
        ``nn.Sequential`` gives."""
        n = len(self)
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict((str(i), self._item(i)) for i in range(n)[idx]))
        index = operator.index(idx)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range (the pipeline body has {n} blocks)")
        return self._item(index % n)

    def __iter__(self) -> Iterator[nn.Module]:
        """Every block of the whole body in order (a :class:`RemoteBlock` for another stage's)."""
        return (self._item(i) for i in range(len(self)))

    # ------------------------------------------------------------------ blocks (repartitioning)
    def block(self, index: int) -> nn.Module:
        """The owned block ``index``."""
        return self._modules[str(index)]  # type: ignore[return-value]

    def take_block(self, index: int) -> nn.Module:
        """Remove the owned block ``index`` (it moves to another stage) and return it."""
        block = self._modules.pop(str(index))
        assert block is not None
        self.indices.remove(index)
        if self.release is not None:
            self.release([block])  # the model object no longer holds it either
        return block

    def named_weights(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The stage's parameters, in ``parameters()`` order, under the names the body's state
        dict uses (a model's body: the model's names, whether or not its blocks have been handed
        back into the model; those stay the same across splits and across a hand-back)."""
        seen: set[int] = set()
        for index, block in zip(self.indices, self.children(), strict=True):
            for local, p in block.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield self.key_of(index, local), p

    def key_of(self, index: int, name: str) -> str:
        """The state-dict key (within the body) of block ``index``'s tensor ``name``."""
        return name if self.owner is not None else f"{index}.{name}"

    def put_block(self, index: int, block: nn.Module) -> None:
        """Own ``block`` as block ``index``, in block order."""
        if self.model is not None and getattr(block, "whole_model", self.model) is None:
            object.__setattr__(block, "whole_model", self.model)  # a model's block that travelled
        self.add_module(str(index), block)
        self._modules = dict(sorted(self._modules.items(), key=lambda kv: int(kv[0])))
        self.indices = sorted(int(k) for k in self._modules)

    @property
    def policy(self) -> dict[int, str]:
        """The memory plan's entries for this stage's blocks."""
        return {i: self.memory_plan[i] for i in self.indices if i in self.memory_plan}

    @contextmanager
    def forwarding(self, microbatch: tuple[int, int], stash: ActivationStash) -> Iterator[None]:
        """The training forward of ``microbatch``: its saved activations go to ``stash``, and
        block times are recorded (when :attr:`timing` is on)."""
        self.microbatch, self.stash = microbatch, stash
        try:
            yield
        finally:
            self.microbatch, self.stash = None, None

    def segment(self, stage: int) -> list[int]:
        """The owned blocks of ``stage`` (one of :attr:`stages`), in order: all of them when
        the rank holds one stage."""
        if len(self.stages) == 1:
            return self.indices
        start = sum(self.balance[:stage])
        return [i for i in self.indices if start <= i < start + self.balance[stage]]

    def takes_call(self, stage: int) -> bool:
        """Whether a block of ``stage`` takes the step's own arguments (a model's head, or the
        junction into an encoder-decoder's decoder): the stage then runs the user's step up to
        the body's call, to have them."""
        return self.takes_any_call and any(
            getattr(self.block(i), "takes_call_input", False) for i in self.segment(stage)
        )

    def run_blocks(
        self,
        x: Any,
        weights: Mapping[str, Tensor] | None = None,
        call: Any = None,
        stage: int | None = None,
    ) -> Any:
        """Apply the owned blocks in order, with ``nn.Sequential`` semantics (one input each);
        ``call``: the step's :class:`BodyInput`, for a block that takes it (a model's head);
        ``stage``: only that stage's blocks (virtual stages; None: every owned block).

        ``weights`` (names as in ``self.named_parameters()``) replace the parameters for this
        call, block by block, as ``torch.func.functional_call(block, weights, strict=False)``
        would (see :func:`_parameters_replaced`): a weight version other than the live one.

        With :attr:`recompute`, autograd keeps only the stage's input: the blocks run again,
        with the same weights and random state, when the backward needs their activations
        (``torch.utils.checkpoint``, non-reentrant). A block whose :attr:`policy` is
        ``"recompute"`` is checkpointed on its own.

        Blocks may modify their input in place (``nn.ReLU(inplace=True)``); a received
        activation must be made writable first (``runtime.inplace.writable``, as the engine
        does).
        """
        if not self.takes_any_call:
            call = None  # only a model's head takes the step's arguments
        indices = self.indices if stage is None else self.segment(stage)
        if self.recompute and torch.is_grad_enabled():
            return self._checkpoint(tuple(indices), self._apply_blocks, x, weights, call, indices)
        return self._apply_blocks(x, weights, call, indices)

    def _checkpoint(
        self, region: tuple[int, ...], fn: Callable[..., Any], x: Any, *args: Any
    ) -> Any:
        """``fn(x, *args)`` under ``torch.utils.checkpoint`` (non-reentrant), for the blocks
        ``region``.

        The recomputation runs ``fn`` again on ``x``: if the first forward modified ``x`` in
        place (an in-place first block), it would see the modified input. So the region's first
        forward runs on a copy of ``x`` and records whether the copy was modified; from then on
        only a region that modifies its input gets a copy (a clone per forward and per
        recomputation), one that does not runs on ``x`` itself at no cost, and raises if it ever
        does modify it.

        The recomputation must not update the blocks' buffers a second time (batch norm's
        running statistics and ``num_batches_tracked``; in train mode it normalises with the
        batch's statistics, so its output does not depend on them): the buffers a forward
        updates are saved before the recomputation and put back after it. Which buffers those
        are is learnt from the region's first forward, by value (batch norm's kernel updates the
        running statistics without bumping their version counters), and from version counters
        and identities in every forward; static buffers (masks, caches) are never copied.
        """
        modifies = self._modifies_input.get(region)
        modules = [self.block(i) for i in region]
        first_run = [True]
        changed: list[tuple[nn.Module, str]] = []  # the buffers the first forward changed

        def run(inp: Any, *rest: Any) -> Any:
            own = copy_tensors(inp) if modifies is not False else inp
            if not first_run[0]:  # the recomputation
                with _buffers_kept(changed):
                    return fn(own, *rest)
            first_run[0] = False
            before = tensor_versions(own)
            buffers = _buffer_versions(modules)
            known = self._updated_buffers.get(region)
            if known is not None and not _same_modules(known[0], modules):
                known = None  # blocks moved since
            values = None if known is not None else [b.clone() for _, _, b, _ in buffers]
            out = fn(own, *rest)
            updated = {
                (id(m), n): (m, n)
                for m, n, b, v in buffers
                if m._buffers.get(n) is not b or b._version != v
            }
            if known is not None:
                updated.update(((id(m), n), (m, n)) for m, n in known[1])
            else:
                assert values is not None
                for (m, n, b, _), value in zip(buffers, values, strict=True):
                    if not torch.equal(b, value):
                        updated[(id(m), n)] = (m, n)
                self._updated_buffers[region] = (modules, list(updated.values()))
            changed.extend(updated.values())
            modified = tensor_versions(own) != before
            if modifies is None:
                self._modifies_input[region] = modified
            elif modified and not modifies:
                raise RuntimeError(
                    f"blocks {list(region)} of the pipeline body modified their input in "
                    "place, which they did not do in their first recomputed forward: the "
                    "recomputation would see the modified input. Keep in-place operations "
                    "on a block's input unconditional, or do not recompute these blocks"
                )
            return out

        return checkpoint(run, x, *args, use_reentrant=False)

    def _apply_blocks(
        self,
        x: Any,
        weights: Mapping[str, Tensor] | None,
        call: Any = None,
        indices: Sequence[int] | None = None,
    ) -> Any:
        stash = self.stash
        by_block = self._weights_by_block(weights) if weights is not None else {}
        for index in self.indices if indices is None else indices:
            block = self.block(index)
            own = by_block.get(index, {}) if weights is not None else None
            policy = self.memory_plan.get(index, "keep")
            if stash is not None:
                stash.current_policy = policy
            timed = self.timing and self.microbatch is not None
            if timed:
                start = self._clock()
            try:
                if policy == "recompute" and torch.is_grad_enabled():
                    if stash is not None and self.microbatch is not None:
                        stash.note_held(self.microbatch, x)  # checkpoint keeps the input
                    x = self._checkpoint((index,), _call_on, x, block, own, call)
                else:
                    x = _call_block(block, own, x, call)
            finally:
                if stash is not None:
                    stash.current_policy = None
            if x is None:
                raise TypeError(
                    f"block {index} ({type(block).__name__}) of the pipeline body returned None; "
                    "every block must return the next block's input (a tensor, or a tuple, list "
                    "or dict of tensors and Python values)"
                )
            if timed:
                self._record(index, start)
        return x

    def _weights_by_block(self, weights: Mapping[str, Tensor]) -> dict[int, dict[str, Tensor]]:
        """``weights`` (names as in ``named_parameters()``: ``"<block>.<name in block>"``) split
        by block, with each tied weight also under its names in the later blocks that use it."""
        out: dict[int, dict[str, Tensor]] = {}
        for key, value in weights.items():
            head, _, local = key.partition(".")
            out.setdefault(int(head), {})[local] = value
        if self.ties:
            for index, aliases in self._tie_aliases().items():
                for local, source in aliases:
                    out.setdefault(index, {})[local] = weights[source]
        return out

    def _tie_aliases(self) -> dict[int, list[tuple[str, str]]]:
        """Block -> ``(name in the block, weight name)`` for the uses of a parameter that an
        earlier block of this stage holds too: the weights of a version are named once (as in
        ``named_parameters()``), under the stage's first use."""
        out: dict[int, list[tuple[str, str]]] = {}
        for tie in self.ties:
            mine = [(b, n) for b, n in tie.uses if b in self.indices]
            for block, name in mine[1:]:
                out.setdefault(block, []).append((name, f"{mine[0][0]}.{mine[0][1]}"))
        return out

    def _clock(self) -> Any:
        if self.device_type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _record(self, index: int, start: Any) -> None:
        if self.device_type == "cuda":
            self._block_events.append((index, start, self._clock()))
        else:
            self._block_s[index] = self._block_s.get(index, 0.0) + time.perf_counter() - start

    @property
    def device_type(self) -> str:
        first = next(self.parameters(), None)
        return first.device.type if first is not None else "cpu"

    def time_blocks(self) -> None:
        """Start timing every owned block's training forward (from zero)."""
        self.timing = True
        self.take_block_times()

    def take_block_times(self) -> dict[int, float]:
        """Each owned block's summed forward seconds since the previous call (training
        forwards only), and reset."""
        for index, start, end in self._block_events:
            end.synchronize()
            self._block_s[index] = self._block_s.get(index, 0.0) + start.elapsed_time(end) / 1e3
        self._block_events = []
        out = {i: self._block_s.get(i, 0.0) for i in self.indices}
        self._block_s = {}
        return out

    @contextmanager
    def partial_access(self) -> Iterator[None]:
        """Let the strategy read this stage's state (a checkpoint gathers every stage's)."""
        self._partial_access += 1
        try:
            yield
        finally:
            self._partial_access -= 1

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The owned blocks' state under their original names. Once a Trainer call has ended
        without handing the whole body back (``partial_reason``), a state dict of the user's
        module would silently hold one stage: that raises instead."""
        if self.partial_reason is not None and not self._partial_access:
            raise RuntimeError(
                f"this module holds stage {self.stage} of {self.num_stages} of its pipeline body "
                f"only (blocks {self.indices}; {self.partial_reason}), so its state_dict would "
                "miss the other stages' blocks. Save the whole model with "
                "trainer.save_checkpoint(path) (one file, loadable on one device) or take "
                "strategy.full_state_dict() (on global rank 0)"
            )
        return super().state_dict(*args, **kwargs)

    def set_call(self, call: BodyCall | None) -> None:
        self._call = call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.takes_any_call:
            call: Any = BodyInput(args, kwargs)
        elif kwargs or len(args) != 1:
            raise TypeError(
                "the pipeline body is an nn.Sequential and takes exactly one positional input "
                f"(got {len(args)} positional and {sorted(kwargs)} keyword arguments); pack several "
                "inputs into one tuple or dict"
            )
        else:
            call = args[0]
        if self._call is None:
            raise RuntimeError(
                "the pipeline body was called outside a pipelined step: with pipe2bw each rank holds "
                f"only its stage's blocks (stage {self.stage} of {self.num_stages}). Run the model "
                "through trainer.fit/validate/test/predict, or load a checkpoint on one device."
            )
        return self._call(self, call)

    def extra_repr(self) -> str:
        if len(self.stages) > 1:
            return f"stages={list(self.stages)}/{self.num_stages}, blocks={self.indices}"
        return f"stage={self.stage}/{self.num_stages}, blocks={self.indices}"


def add_block_index(state: dict[str, Any], prefix: str, owner: Mapping[str, int]) -> None:
    """Load a model's keys into its body: ``prefix + key`` -> ``prefix + "3." + key``, where
    ``owner[key]`` (3) is the block that holds it."""
    for key in list(state):
        if key.startswith(prefix):
            local = key[len(prefix) :]
            if local in owner:
                state[f"{prefix}{owner[local]}.{local}"] = state.pop(key)


def drop_block_index(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
    """A model's body saves under the model's keys: ``prefix + "3." + key`` -> ``prefix + key``
    (a state-dict hook)."""
    items = list(state.items())
    state.clear()
    for key, value in items:
        if key.startswith(prefix):
            index, _, local = key[len(prefix) :].partition(".")
            if index.isdigit():
                key = prefix + local
        state[key] = value


def _buffer_versions(blocks: Iterable[nn.Module]) -> list[tuple[nn.Module, str, Tensor, int]]:
    """Every buffer of ``blocks``: its owner, name, tensor and version counter."""
    owners = dict.fromkeys(m for block in blocks for m in block.modules())
    return [(m, n, b, b._version) for m in owners for n, b in m._buffers.items() if b is not None]


def _same_modules(a: list[nn.Module], b: list[nn.Module]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


@contextmanager
def _buffers_kept(buffers: list[tuple[nn.Module, str]]) -> Iterator[None]:
    """Put ``buffers`` (owner, name) back as they were on entry, tensor and values, on exit."""
    saved = [(m, n, m._buffers[n]) for m, n in buffers]
    values = [b.clone() if b is not None else None for _, _, b in saved]
    try:
        yield
    finally:
        with torch.no_grad():
            for (m, n, b), value in zip(saved, values, strict=True):
                m._buffers[n] = b
                if b is not None and value is not None:
                    b.copy_(value)


def _call_on(
    x: Any, block: nn.Module, weights: Mapping[str, Tensor] | None, call: Any = None
) -> Any:
    return _call_block(block, weights, x, call)


def _call_block(
    block: nn.Module, weights: Mapping[str, Tensor] | None, x: Any, call: Any = None
) -> Any:
    with call_input(block, call):
        if weights is None:
            return block(x)
        with _parameters_replaced(block, weights):
            return block(x)


@contextmanager
def _parameters_replaced(block: nn.Module, weights: Mapping[str, Tensor]) -> Iterator[None]:
    """Inside the block, ``block``'s parameters named in ``weights`` (names as in
    ``block.named_parameters()``) are those tensors: what ``torch.func.functional_call(block,
    weights, strict=False)`` does around a call, tied parameters included (a parameter a block
    holds under several names takes its tensor under all of them). functional_call's general
    machinery costs tens of microseconds per call, and 2BW calls every block of every
    micro-batch with a weight version; this walks the block's modules once and swaps entries
    of their ``_parameters`` (as torch's own swap does), then puts the parameters back."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}  # id(parameter) -> where it is held
    held: dict[str, int] = {}  # every name of a parameter -> id(parameter)
    for prefix, module in block.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, attr))
                held[f"{prefix}.{attr}" if prefix else attr] = id(param)
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for name, tensor in weights.items():
            if name not in held:
                raise KeyError(f"{type(block).__name__} has no parameter {name!r}")
            for module, attr in places[held[name]]:
                saved.append((module, attr, module._parameters[attr]))
                module._parameters[attr] = tensor  # type: ignore[assignment]
        yield
    finally:
        for module, attr, original in reversed(saved):
            module._parameters[attr] = original

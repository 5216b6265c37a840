"""The module a rank keeps in place of the body: its own blocks, under their original names."""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe2bw.runtime.blocktimes import BlockTimer
from lightning_pipe2bw.runtime.call import BodyInput
from lightning_pipe2bw.runtime.recompute import Recomputation
from lightning_pipe2bw.runtime.remote import RemoteBlock
from lightning_pipe2bw.runtime.stash import ActivationStash
from lightning_pipe2bw.runtime.weights import call_block, call_on, weights_by_block

__all__ = ["StageBody", "add_block_index", "drop_block_index"]

# Called with (stage body, the input the user's step passed to the body); returns what the body
# call returns to the user's code, or raises to stop the step (see runtime.engine).
BodyCall = Callable[["StageBody", Any], Any]


def _compile_in_place(block: nn.Module, options: Mapping[str, Any]) -> None:
    """``block.compile(**options)``, unless it is compiled already (by the model itself, an
    ``OptimizedModule``, or in place)."""
    if hasattr(block, "_orig_mod") or getattr(block, "_compiled_call_impl", None) is not None:
        return
    block.compile(**options)


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
        # each block's forward time during training, once on (live repartitioning)
        self.timer = BlockTimer()
        # torch.compile's keyword arguments for every block, owned or arriving (compile_blocks)
        self.compile_options: dict[str, Any] | None = None
        # after a Trainer call, when the whole body could not be handed back: why (state_dict
        # then raises, unless the strategy itself reads it inside ``partial_access``)
        self.partial_reason: str | None = None
        self.built_on_meta = built_on_meta  # its blocks were built in configure_model (on meta)
        self._partial_access = 0
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
        # what each recomputed region's first forward showed (runtime.recompute)
        self.recomputation = Recomputation()

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

    def compile_blocks(self, options: Mapping[str, Any]) -> None:
        """Compile every owned block in place (``nn.Module.compile``, which keeps the state
        dict's keys) with ``torch.compile``'s keyword ``options``, and each block that arrives
        later (:meth:`put_block`: a compiled call does not travel with a pickled block). A
        block the model compiled itself (``torch.compile(block)``) stays as it is."""
        self.compile_options = dict(options)
        for index in self.indices:
            _compile_in_place(self.block(index), self.compile_options)

    def put_block(self, index: int, block: nn.Module) -> None:
        """Own ``block`` as block ``index``, in block order (compiled as the stage's blocks are,
        see :meth:`compile_blocks`)."""
        if self.model is not None and getattr(block, "whole_model", self.model) is None:
            object.__setattr__(block, "whole_model", self.model)  # a model's block that travelled
        if self.compile_options is not None:
            _compile_in_place(block, self.compile_options)
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
            region = tuple(indices)
            return self.recomputation.checkpoint(
                region, [self.block(i) for i in region], self._apply_blocks, x, weights, call,
                indices,
            )  # fmt: skip
        return self._apply_blocks(x, weights, call, indices)

    def _apply_blocks(
        self,
        x: Any,
        weights: Mapping[str, Tensor] | None,
        call: Any = None,
        indices: Sequence[int] | None = None,
    ) -> Any:
        stash = self.stash
        by_block = weights_by_block(weights, self.ties, self.indices) if weights is not None else {}
        for index in self.indices if indices is None else indices:
            block = self.block(index)
            own = by_block.get(index, {}) if weights is not None else None
            policy = self.memory_plan.get(index, "keep")
            if stash is not None:
                stash.current_policy = policy
            timed = self.timer.on and self.microbatch is not None
            if timed:
                start = self.timer.clock(self.device_type)
            try:
                if policy == "recompute" and torch.is_grad_enabled():
                    if stash is not None and self.microbatch is not None:
                        stash.note_held(self.microbatch, x)  # checkpoint keeps the input
                    x = self.recomputation.checkpoint(
                        (index,), [block], call_on, x, block, own, call
                    )
                else:
                    x = call_block(block, own, x, call)
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
                self.timer.record(index, start, self.device_type)
        return x

    @property
    def device_type(self) -> str:
        first = next(self.parameters(), None)
        return first.device.type if first is not None else "cpu"

    def time_blocks(self) -> None:
        """Start timing every owned block's training forward (from zero)."""
        self.timer.start()

    def take_block_times(self) -> dict[int, float]:
        """Each owned block's summed forward seconds since the previous call (training
        forwards only), and reset."""
        return self.timer.take(self.indices)

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

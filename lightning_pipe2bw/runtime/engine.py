"""The interpreter that executes one stage's action list: forward, backward, send and receive."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe2bw.failures.record import StageFailure, lost_peer, mark_action
from lightning_pipe2bw.runtime.actionlog import ActionLog, user_log
from lightning_pipe2bw.runtime.inplace import writable
from lightning_pipe2bw.runtime.items import amended_call
from lightning_pipe2bw.runtime.payload import (
    StepFn,
    batch_signature,
    custom_functions,
    detach_all,
    filled,
    global_backward_hooks,
    grad_leaves,
    handed_over,
    is_compiled_function,
    loss_of,
    received_grads,
    step_loss,
)
from lightning_pipe2bw.runtime.peer import PeerLink
from lightning_pipe2bw.runtime.slots import (
    WHOLE,
    ActionTiming,
    Call,
    EngineStats,
    Slot,
    VirtualStages,
    weight_buffers_referenced,
)
from lightning_pipe2bw.runtime.splitgrad import SplitBackward
from lightning_pipe2bw.runtime.stage import StageBody
from lightning_pipe2bw.runtime.stash import ActivationStash
from lightning_pipe2bw.runtime.transport import Transport
from lightning_pipe2bw.schedule import Action, ActionKind, Schedule

# the engine's vocabulary, importable from here as before the split
__all__ = ["ActionTiming", "PipelineEngine", "StepFn", "VirtualStages", "step_loss"]

_COMM_KINDS = (ActionKind.RECV_F, ActionKind.SEND_F, ActionKind.RECV_B, ActionKind.SEND_B)


class _BodyReached(BaseException):
    """Raised on the first stage when the user's step reaches the body: the rest of the step (the
    loss) belongs to the last stage. A BaseException so that a broad ``except Exception`` in user
    code does not swallow it."""


class PipelineEngine:
    """Runs a stage's actions for one batch of micro-batches.

    The engine knows nothing about Lightning: the strategy hands it the user's step as a
    function of one micro-batch, the loss weights, and a ``backward`` function (which applies the
    precision plugin's loss scaling).
    """

    def __init__(
        self,
        body: StageBody,
        stage: int,
        num_stages: int,
        transport: Transport,
        prev_rank: int | None,
        next_rank: int | None,
        *,
        wait_limits: tuple[float | None, float | None] = (None, None),
        link: PeerLink | None = None,
        evict_share: Callable[[int], float | None] | None = None,
        virtual: VirtualStages | None = None,
    ) -> None:
        """``wait_limits``: seconds to wait for a forward input and for a backward gradient
        (None: the process group's timeout; see ``failures.record.wait_limits``). ``link``: BPipe's
        link to the partner stage, if this stage has one; ``evict_share(saved_bytes)``: the
        share of a micro-batch's saved bytes this stage evicts to it (the activation balancer;
        None: only the memory plan's ``"evict"`` blocks move). ``virtual``: the stages this rank
        holds when it holds several (``stage`` and ``num_stages`` then count ranks: the rank's
        place in the pipeline and the pipeline's ranks; ``prev_rank``/``next_rank`` are
        unused)."""
        self.body = body
        self.stage = stage
        self.num_stages = num_stages
        self.transport = transport
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        if virtual is None:
            ranks = {stage - 1: prev_rank, stage + 1: next_rank}
            virtual = VirtualStages((stage,), num_stages, ranks)
        self.virtual = virtual
        self.last_stage = virtual.num_stages - 1
        self.stats = EngineStats()
        self.wait_limits = wait_limits
        self.record_timeline = True
        self.slots: dict[tuple[int, int], Slot] = {}  # in-flight (stage, micro-batch)
        # saved activations: counted, and moved by the memory plan and the balancer
        self.stash = ActivationStash(transport.device, evictable=evict_share is not None)
        self.link = link
        self.evict_share: Callable[[int], float | None] = evict_share or (lambda _: None)
        self.inflight = 0
        # fsdp: turns FSDP's gradient reduction on for each stage's last backward of a batch
        # (pipeline.fsdp.GradientSync); its hooks leave no backward to cut
        self.gradient_sync: Any = None
        # PIPE2BW_DEBUG=1: log every action as it starts and ends (see docs/user-guide.md)
        debug = os.environ.get("PIPE2BW_DEBUG", "") not in ("", "0")
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.action_log = ActionLog(rank, stage) if debug else None

    @property
    def is_first(self) -> bool:
        """This rank holds the pipeline's first stage (the one that reads the batch)."""
        return 0 in self.virtual.stages

    @property
    def is_last(self) -> bool:
        """This rank holds the pipeline's last stage (the one that computes the loss)."""
        return self.last_stage in self.virtual.stages

    @property
    def neighbours(self) -> list[int]:
        """The ranks this rank exchanges activations or gradients with."""
        return sorted({r for r in self.virtual.ranks.values() if r is not None})

    def run(
        self,
        schedule: Schedule,
        microbatches: Sequence[Any],
        step: StepFn,
        *,
        train: bool,
        loss_weights: Sequence[float] = (),
        backward: Callable[[Tensor], None] | None = None,
        observer: Callable[[Action], None] | None = None,
        loss_root: Callable[[Tensor], Tensor] | None = None,
    ) -> list[Any]:
        """Execute ``schedule.stages[self.stage]`` (a flush schedule: every micro-batch starts
        and finishes here) and return the last stage's step outputs, one per micro-batch (an
        empty list on other stages). ``schedule`` must already carry communication actions.
        ``loss_root``: see :meth:`execute`."""
        if train and self.gradient_sync is not None:
            self.gradient_sync.start(len(microbatches))
        results = self.execute(
            schedule.stages[self.stage],
            dict(enumerate(microbatches)),
            step,
            train=train,
            loss_weights=dict(enumerate(loss_weights)),
            backward=backward,
            observer=observer,
            loss_root=loss_root,
        )
        if self.slots:
            left = sorted(f"{v}:{i}" for v, i in self.slots)
            raise RuntimeError(f"(stage:micro-batch) {left} are still in flight after a flush")
        if self.link is not None:
            self.link.settle()  # every offload send of the batch has been taken by now
        return [results[i] for i in range(len(microbatches))] if self.is_last else []

    def execute(
        self,
        actions: Sequence[Action],
        microbatches: Mapping[int, Any],
        step: StepFn,
        *,
        train: bool,
        loss_weights: Mapping[int, float],
        backward: Callable[[Tensor], None] | None = None,
        weights_for: Callable[[int], Mapping[str, Tensor]] | None = None,
        observer: Callable[[Action], None] | None = None,
        loss_root: Callable[[Tensor], Tensor] | None = None,
    ) -> dict[int, Any]:
        """Execute ``actions`` (compute and communication) in order, one handler per action
        kind. Micro-batches may start in one call and finish in a later one (PipeDream-2BW):
        their state stays in ``self.slots``.

        ``weights_for(microbatch)`` gives the weight tensors a micro-batch computes with (its
        weight version), or None for the module's own parameters; ``observer(action)`` is called
        after every action (a driver counting weight versions). ``loss_root(weighted loss)`` is
        the tensor that ``backward`` differentiates on the last stage, which an ``I`` action
        differentiates itself (None: the last stage runs its backward whole, see
        :meth:`_input_grad`). Returns the last stage's step outputs of the micro-batches whose
        forward ran in this call.
        """
        call = Call(
            actions, microbatches, step, train, loss_weights, backward, weights_for, loss_root,
            last_input=max(
                (n for n, a in enumerate(actions) if a.kind is ActionKind.INPUT_GRAD), default=-1
            ),
        )  # fmt: skip
        slots, timeline, stats = self.slots, self.stats.timeline, self.stats
        handlers = self._handlers
        action: Action | None = None
        try:
            self.transport.settle()
            for n, action in enumerate(actions):
                start = time.perf_counter()
                if self.action_log is not None:
                    self.action_log.start(action, start)
                handler = handlers.get(action.kind)
                if handler is None:  # pragma: no cover - the schedule validator rejects others
                    raise ValueError(f"the engine cannot run action {action}")
                handler(
                    call, n, action, slots.setdefault((action.stage, action.microbatch), Slot())
                )
                end = time.perf_counter()
                if self.action_log is not None:
                    self.action_log.end(action, end, start)
                self._sample_memory()
                if action.is_compute:
                    stats.busy_s += end - start
                    if action.kind is not ActionKind.FORWARD:
                        stats.backward_s += end - start
                    elif train:
                        stats.forward_s += end - start
                    stats.max_weight_versions = max(
                        stats.max_weight_versions,
                        weight_buffers_referenced(self.body, self.slots.values()),
                    )
                if observer is not None:
                    observer(action)
                if self.record_timeline:
                    timeline.append(ActionTiming(action, start, end))
            # a send may be received in the peer's *next* call (2BW), so it is not awaited here;
            # completed sends release their buffers, the rest are awaited at the next flush
            self.transport.reap()
        except StageFailure:
            raise
        except Exception as err:
            if action is not None:
                if action.kind in _COMM_KINDS and not isinstance(err, (TypeError, ValueError)):
                    raise self._lost_peer(action, err) from err
                mark_action(err, f"action {action}")
            raise
        finally:
            self.body.set_call(None)
        return call.results

    @property
    def _handlers(self) -> dict[ActionKind, Callable[[Call, int, Action, Slot], None]]:
        return {
            ActionKind.RECV_F: self._recv_f,
            ActionKind.FORWARD: self._forward_action,
            ActionKind.SEND_F: self._send_f,
            ActionKind.RECV_B: self._recv_b,
            ActionKind.BACKWARD: self._backward_action,
            ActionKind.INPUT_GRAD: self._input_grad,
            ActionKind.SEND_B: self._send_b,
            ActionKind.WEIGHT_GRAD: self._weight_grad,
            ActionKind.EVICT: self._evict,
            ActionKind.LOAD: self._load,
            ActionKind.RETURN: self._return,
        }

    # ------------------------------------------------------------------ one handler per kind
    def _recv_f(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        slot.inputs, slot.upstream_batch = self.transport.recv(
            self._peer_of(action.stage - 1), self.wait_limits[0]
        )

    def _forward_action(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        v, i, train = action.stage, action.microbatch, call.train
        key = (v, i)
        if train and self.link is not None and not self.link.holder:
            self.link.settle()  # earlier evictions have left before new saves
        if v != 0:
            self._check_same_batch(slot, call.microbatches[i], v, i)
        slot.weight = call.loss_weights.get(i, 0.0)
        slot.params = call.weights_for(i) if call.weights_for is not None else None
        if train:
            weights = [*self.body.parameters(), *(slot.params or {}).values()]
            with self.body.forwarding(key, self.stash), self.stash.recording(key, weights):
                self._forward(slot, call.microbatches[i], call.step, v, i)
            slot.saved_bytes = self.stash.saved_bytes(key)
        else:
            self._forward(slot, call.microbatches[i], call.step, v, i)
        if v == self.last_stage:
            call.results[i] = slot.result
        self.inflight += 1
        self.stats.peak_inflight = max(self.stats.peak_inflight, self.inflight)
        if not train:
            slot.inputs = None
            if v == self.last_stage:
                del self.slots[key]
                self.inflight -= 1
        if v + 1 in self.virtual.stages:  # the next stage is on this rank: hand over
            nxt = self.slots.setdefault((v + 1, i), Slot())
            nxt.inputs = handed_over(slot.outputs)
            if not train:
                del self.slots[key]
                self.inflight -= 1

    def _send_f(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        # the transport sends detached copies but records requires_grad for the peer; the
        # micro-batch's shapes travel along (in the cached header: free when they do not
        # change), so that every stage checks it split the same batch
        i = action.microbatch
        signature = batch_signature(call.microbatches[i]) if i in call.microbatches else None
        self._post_next_receive(call.actions, n)
        self.transport.send((slot.outputs, signature), self._peer_of(action.stage + 1))
        if not call.train:
            del self.slots[(action.stage, i)]
            self.inflight -= 1

    def _recv_b(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        # swapped activations start coming back
        self.stash.prefetch((action.stage, action.microbatch))
        slot.grads_in = self.transport.recv(self._peer_of(action.stage + 1), self.wait_limits[1])

    def _ready_for_backward(self, v: int, i: int, slot: Slot) -> None:
        self.stash.prefetch((v, i))
        if slot.loading:
            self.stash.restore((v, i), self._link().loaded(i))
            slot.loading = False

    def _inputs_grad_ready(self, v: int, i: int, slot: Slot) -> None:
        """The gradient of stage ``v``'s inputs is in ``slot.grads_out``: where the previous
        stage is on this rank, hand it over (it leaves, as a ``SEND_B`` would send it)."""
        if v - 1 in self.virtual.stages:
            self.slots[(v - 1, i)].grads_in = slot.grads_out
            slot.grads_out, slot.sent = None, True

    def _backward_action(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        """B: the whole backward of the micro-batch."""
        assert call.backward is not None, "training needs a backward function"
        v, i = action.stage, action.microbatch
        self._ready_for_backward(v, i, slot)
        self._backward(slot, v, i, call.backward, input_grads=v != 0)
        self._inputs_grad_ready(v, i, slot)
        self._backward_done(v, i, slot)

    def _input_grad(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        """I: the gradient of the stage's inputs, for the ``SEND_B`` that follows; the weights'
        gradients are left to the micro-batch's ``W``.

        Where the graph allows (:class:`SplitBackward`: no weights' node that two input-path
        nodes reach, as a layer applied to its own output does), the backward is cut into two
        passes that together do the work of one. Elsewhere the call's last ``I`` takes one more
        pass over the input-gradient path and its ``W`` runs the whole backward (the stage's
        idle tail absorbs the extra pass), and any other ``I`` runs the whole backward itself
        (its ``W`` has nothing left to do). Both are exact: every node runs on the same tensors
        with the same incoming gradient as in one backward, and the weights' gradients
        accumulate as one backward accumulates them. The first stage, which sends no gradient,
        leaves the whole backward to ``W``.

        A stage does not cut where a backward pass has effects beyond its gradients
        (activations that are recomputed, swapped or evicted, module backward hooks, custom
        ``autograd.Function`` nodes such as a reentrant checkpoint) or, on the last stage,
        where the engine cannot reproduce the backward (``loss_root`` None: a LightningModule
        or a precision plugin that overrides ``backward``): ``I`` runs it whole."""
        assert call.backward is not None, "training needs a backward function"
        v, i = action.stage, action.microbatch
        self._ready_for_backward(v, i, slot)
        if v == 0:
            slot.weights_left = WHOLE
            return
        leaves = grad_leaves(slot.inputs)
        if v == self.last_stage:
            if call.loss_root is None:
                roots: list[Tensor] = []
                seeds: list[Tensor | None] = []
            else:
                roots = [call.loss_root(loss_of(slot.result, i) * slot.weight)]
                seeds = [None]
        else:
            roots, received = received_grads(slot.outputs, slot.grads_in)
            seeds = list(received)
        if leaves and roots and self._can_split_backward((v, i), roots):
            split = SplitBackward.plan(roots, seeds, leaves)
            if split is not None:
                grads = split.inputs_pass()
                self.stats.split_backwards += 1
                slot.weights_left = split
            elif n == call.last_input:
                grads = list(
                    torch.autograd.grad(roots, leaves, seeds, retain_graph=True, allow_unused=True)
                )
                self.stats.repeated_input_passes += 1
                slot.weights_left = WHOLE
            else:
                grads = None
            if grads is not None:
                slot.grads_out = filled(grads, leaves)
                self._inputs_grad_ready(v, i, slot)
                return
        del roots, seeds
        self._backward(slot, v, i, call.backward, input_grads=True)  # whole, here
        slot.weights_left = None
        self._inputs_grad_ready(v, i, slot)

    def _weight_grad(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        """W: the weights' gradients of a micro-batch whose ``I`` ran (what it left to do)."""
        assert call.backward is not None, "training needs a backward function"
        v, i, left = action.stage, action.microbatch, slot.weights_left
        if isinstance(left, SplitBackward):
            left.weights_pass()
        elif left is WHOLE:
            self._backward(slot, v, i, call.backward, input_grads=False)
        slot.weights_left = None
        self._backward_done(v, i, slot)

    def _send_b(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        self._post_next_receive(call.actions, n)
        self.transport.send(slot.grads_out, self._peer_of(action.stage - 1))
        slot.grads_out, slot.sent = None, True
        if slot.done:
            del self.slots[(action.stage, action.microbatch)]

    def _evict(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        v, i = action.stage, action.microbatch
        # what the engine holds anyway: sending it would free nothing
        keep = (slot.inputs, slot.outputs, call.microbatches.get(i))
        share = self.evict_share(self.stash.saved_bytes((v, i)))
        self._link().evict(i, self.stash.evict((v, i), share, keep))

    def _load(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        self._link().load(
            action.microbatch, self.stash.away_size((action.stage, action.microbatch))
        )
        slot.loading = True

    def _return(self, call: Call, n: int, action: Action, slot: Slot) -> None:
        self._link().give_back(action.microbatch)

    def _backward_done(self, v: int, i: int, slot: Slot) -> None:
        """The micro-batch's weights' gradients are in: release its activations; its slot goes
        once its inputs' gradient has left too (the first stage sends none)."""
        if v == self.last_stage:
            slot.result = detach_all(slot.result)
        slot.inputs = slot.outputs = slot.grads_in = slot.params = None
        self.stash.release((v, i))
        self.inflight -= 1
        slot.done = True
        if v == 0 or slot.sent:
            del self.slots[(v, i)]

    def _lost_peer(self, action: Action, error: BaseException) -> StageFailure:
        """The error for a receive or send that failed because the peer's process is gone or
        stopped answering (the process group's timeout passed)."""
        toward_prev = action.kind in (ActionKind.RECV_F, ActionKind.SEND_B)
        peer_stage = action.stage - 1 if toward_prev else action.stage + 1
        peer = self.virtual.ranks.get(peer_stage)
        assert peer is not None
        return lost_peer(peer, peer_stage, action.stage, str(action), error)

    def _post_next_receive(self, actions: Sequence[Action], n: int) -> None:
        """Before the send ``actions[n]``: post the receive that follows it before the next
        computation, if one does. The peer often answers this send with that very message: gloo
        writes it at once into a receive already posted, where a late receive leaves it to the
        peer's transport thread, which waits while the peer computes (see :class:`P2PTransport`;
        a no-op on NCCL)."""
        for k in range(n + 1, len(actions)):
            kind = actions[k].kind
            if kind is ActionKind.RECV_F:
                self.transport.post(self._peer_of(actions[k].stage - 1))
            elif kind is ActionKind.RECV_B:
                self.transport.post(self._peer_of(actions[k].stage + 1))
            elif kind in _COMM_KINDS:
                continue
            return

    def _peer_of(self, stage: int) -> int:
        """The rank that holds ``stage`` (a neighbour of one of this rank's stages)."""
        rank = self.virtual.ranks.get(stage)
        assert rank is not None, "the schedule asked a stage to talk past the end of the pipeline"
        return rank

    def _link(self) -> PeerLink:
        if self.link is None:
            raise RuntimeError(
                "the schedule has offload actions (EVICT/LOAD/RETURN) but this stage has no link "
                "to a partner stage; offload actions come from the activation balancer or a memory "
                "plan, which set the link up"
            )
        return self.link

    def _sample_memory(self) -> None:
        """Update the activation figures after an action (the link's threads move bytes too)."""
        partner = self.link.held_bytes if self.link is not None else 0
        self.stats.sample(self.stash, partner, self.virtual.stages)

    def _check_same_batch(self, slot: Slot, microbatch: Any, v: int, index: int) -> None:
        upstream = slot.upstream_batch
        if upstream is None:
            return
        mine = batch_signature(microbatch)
        if tuple(upstream) != mine:
            raise ValueError(
                f"the ranks read different batches: stage {v - 1} split micro-batch "
                f"{index} into tensors of shapes {list(upstream)}, this stage ({v}) into "
                f"{list(mine)}. Every rank must load the same batches in the same order (the same "
                "dataset, seed and sampler; pipe2bw already makes a RandomSampler agree)"
            )

    def _forward(self, slot: Slot, microbatch: Any, step: StepFn, v: int, index: int) -> None:
        body = self.body
        first, last = v == 0, v == self.last_stage
        # the received leaves stay in slot.inputs (their .grad is the gradient sent upstream);
        # the blocks run on aliases of them, which an in-place first block may modify
        middle = not first and not last
        if middle and not body.takes_call(v):
            slot.outputs = body.run_blocks(writable(slot.inputs), slot.params, stage=v)
            return

        def call(stage_body: StageBody, x: Any) -> Any:
            slot.body_calls += 1
            if slot.body_calls > 1:
                raise RuntimeError(
                    "the pipeline body was called twice in one step; pipe2bw runs the body once per "
                    "micro-batch, so call self.body(x) / self(x) exactly once in each step"
                )
            if first:
                call_x = amended_call(x, microbatch) if last else x
                out = stage_body.run_blocks(x, slot.params, call=call_x, stage=v)
                if last:
                    return out
                slot.outputs = out
                raise _BodyReached
            if last:  # the model's end takes the batch's item counts (runtime.items)
                x = amended_call(x, microbatch)
            out = stage_body.run_blocks(writable(slot.inputs), slot.params, call=x, stage=v)
            if middle:  # a block of this stage took the step's arguments; the step stops here
                slot.outputs = out
                raise _BodyReached
            return out

        body.set_call(call)
        try:
            slot.result = step(microbatch)
        except _BodyReached:
            return
        finally:
            body.set_call(None)
        if slot.body_calls == 0:
            raise RuntimeError(
                f"the step of micro-batch {index} returned without calling the pipeline body; every "
                "step must run the model input through self.body(x) / self(x) exactly once"
            )

    def _backward(
        self,
        slot: Slot,
        v: int,
        index: int,
        backward: Callable[[Tensor], None],
        input_grads: bool,
    ) -> None:
        """The whole backward of micro-batch ``index`` on stage ``v`` (the weights' gradients
        accumulate into ``.grad``); with ``input_grads``, keep the gradient of the stage's
        inputs to send."""
        if self.gradient_sync is not None:
            self.gradient_sync.before_backward(v)
        if v == self.last_stage:
            backward(loss_of(slot.result, index) * slot.weight)
        else:
            outs, grads = received_grads(slot.outputs, slot.grads_in)
            if outs:
                torch.autograd.backward(outs, grads)
        if input_grads and v != 0:
            leaves = grad_leaves(slot.inputs)
            slot.grads_out = filled([x.grad for x in leaves], leaves)

    def _can_split_backward(self, key: tuple[int, int], roots: Sequence[Tensor]) -> bool:
        body = self.body
        if self.gradient_sync is not None:  # FSDP reduces a block's gradient in its backward
            return False
        if body.recompute or any(p != "keep" for p in body.policy.values()):
            return False
        micro = self.stash.micro.get(key)
        if micro is not None and micro.storages:  # swapped or evictable activations
            return False
        if global_backward_hooks() or any(
            m._backward_hooks or m._backward_pre_hooks for m in body.modules()
        ):
            return False
        found = custom_functions(roots)
        if not found:
            return True
        if not self.stats.whole_backward_note and any(map(is_compiled_function, found)):
            self.stats.whole_backward_note = note = (
                f"pipe2bw: rank {dist.get_rank() if dist.is_initialized() else 0} (stage "
                f"{key[0]}) runs each backward whole where zero bubble's B (or 1F1B's early "
                "inputs' gradient) is due, and leaves its W empty: its torch.compile'd blocks "
                "compute the inputs' and the weights' gradients in one compiled call, which "
                "frees its buffers as it goes and cannot be cut in two. The gradients are "
                "unchanged; only the bubble that the split would have filled stays"
            )
            user_log.info(note)
        return False

"""PipeDream-2BW's delay corrections: exact update rules that make a one-step-delayed gradient
train like a fresh one.

2BW computes batch t's gradient at W(t-1) and applies it to W(t) (``docs/pipedream-2bw.md``). A
correction changes either the point where a batch is evaluated (its forward and backward), or
the gradient the user's optimizer receives. Each is a precise rule of the weights, the
optimizer's state and the gradients a stage already has when it needs them (while batch t runs,
a stage holds W(t-1) and the optimizer state after update t-1; batch t-1's gradient is complete
only when its update is applied), so a single-process loop reproduces it exactly
(``tests/helpers/models.py::reference_2bw``). The notation: ``U(g; S)`` is the user's optimizer's whole
update (moments, bias correction, decoupled weight decay, learning rate) with gradient ``g`` from
state ``S``; ``S(t)`` is the state after t updates; batch t's update is the one that makes W(t+1)
from W(t).

State a correction keeps per parameter lives in the optimizer's own state (keys starting with
``delay_``), so checkpoints save it, shard it by parameter name and reload it on any partition
like the optimizer's moments.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "CORRECTIONS",
    "DEFAULT_CORRECTION",
    "DelayCorrection",
    "canonical_correction",
    "correction_predicts",
    "make_correction",
]


class DelayCorrection:
    """The hooks a correction has: :meth:`predict` (where a batch is evaluated, when
    :attr:`predicts`), :meth:`before_step` (the gradient the optimizer receives), and
    :meth:`after_step` / :meth:`skipped` (what it keeps for the next step)."""

    name: ClassVar[str] = "none"
    # the batch is evaluated at weights of its own (a third weight buffer where batches span
    # two calls): WeightVersions asks predict() for them
    predicts: ClassVar[bool] = False
    # the optimizer-state entries it keeps per parameter (each one tensor of the parameter's size)
    state_keys: ClassVar[tuple[str, ...]] = ()
    # what it changes: "point" (where a batch is evaluated), "gradient" (what the optimizer
    # receives) or "update" (the weights after the optimizer's step); a spec joins at most one
    # of each kind
    kind: ClassVar[str] = "none"

    def __init__(self, optimizer: Optimizer, params: Sequence[Tensor]) -> None:
        self.optimizer = optimizer  # the user's (unwrapped)
        self.params = list(params)  # the stage's, in WeightVersions order

    def predict(
        self, newest: list[Tensor], out: list[Tensor], hyper: list[dict[str, Any]] | None
    ) -> None:
        """Write the weights the next batch is evaluated at into ``out`` (``newest``: W(t-1);
        ``hyper``: the param groups' values of the update that follows, None for the
        current)."""
        raise NotImplementedError(f"delay_correction={self.name!r} does not predict weights")

    def before_step(self) -> None:
        """The due gradient is in the parameters' ``.grad`` (clipped, unscaled); the optimizer
        steps next."""

    def after_step(self) -> None:
        """The optimizer has stepped."""

    def skipped(self) -> None:
        """The loss scaler skipped the update (inf/NaN), on every stage alike."""

    def state_of(self, param: Tensor) -> dict[str, Any]:
        return self.optimizer.state[param]  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def stepping(self, params: Sequence[Tensor]) -> Iterator[None]:
        """While it runs, the correction works on ``params`` in place of the stage's: with
        ``shard_optimizer``, the parts of them this replica updates (``optim.shard``), each keyed
        in the optimizer's state meanwhile."""
        before, self.params = self.params, list(params)
        try:
            yield
        finally:
            self.params = before


class NoCorrection(DelayCorrection):
    """The plain rule: W(t+1) = W(t) - U(g_t), g_t at W(t-1)."""


# ---------------------------------------------------------------------- weight prediction
def _inner_class(optimizer: Optimizer, group: dict[str, Any]) -> type[Optimizer]:
    """The optimizer class that steps ``group`` (MuonAdamW runs Muon or AdamW per group)."""
    from lightning_pipe2bw.optim.muon import MuonAdamW

    if isinstance(optimizer, MuonAdamW):
        return torch.optim.Muon if group["muon"] else torch.optim.AdamW
    return type(optimizer)


_MOMENTS = ("exp_avg", "momentum_buffer")  # Adam's family, SGD and Muon


class WeightPrediction(DelayCorrection):
    """Batch t is evaluated at the optimizer's own prediction of the weights it would have
    computed with: the next update applied to W(t-1) with the optimizer's first moment in place
    of the gradient that is not complete yet (SpecTrain, XPipe and PipeOptim predict this way):

        E(t) = W(t-1) - U(m(t-1); S(t-1)),    W(t+1) = W(t) - U(grad f_t(E(t)); S(t))

    where m is the first moment the optimizer keeps (``exp_avg``: Adam, AdamW, NAdam...;
    ``momentum_buffer``: SGD with momentum, Muon), U is the step the optimizer would take next
    (batch t-1's, with its learning rate and weight decay), and S(t-1) is left untouched (the
    prediction runs on copies). Before the first update (no moment yet) E(t) = W(t-1). Memory: a
    third weight buffer on every stage but the last (a batch's view lives while its backwards
    run in the next call), and up to :attr:`PREDICT_CHUNK_BYTES` of optimizer state, copied, at
    a time. Time: one extra optimizer step per stage and step (one call per group and chunk).
    """

    name = "predict"
    predicts = True
    kind = "point"
    # the most optimizer state (bytes) copied at once while predicting: the parameters of a
    # group step together in chunks of this size (one parameter's state at least)
    PREDICT_CHUNK_BYTES: ClassVar[int] = 64 * 2**20

    def __init__(self, optimizer: Optimizer, params: Sequence[Tensor]) -> None:
        super().__init__(optimizer, params)
        self._shadows: dict[type[Optimizer], Optimizer] = {}

    def predict(
        self, newest: list[Tensor], out: list[Tensor], hyper: list[dict[str, Any]] | None
    ) -> None:
        optimizer = self.optimizer
        # per group, in the group's order: (parameter, its copy, its state, its moment's key)
        by_group: dict[int, list[tuple[Tensor, Tensor, dict[str, Any], str]]] = {}
        # read at each call: with shard_optimizer the groups hold this replica's parts meanwhile
        group_of = {
            id(p): index
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
        }
        with torch.no_grad():
            if out:
                torch._foreach_copy_(out, newest)
            for param, dst in zip(self.params, out, strict=True):
                state = optimizer.state.get(param)
                key = next((k for k in _MOMENTS if state and k in state), None)
                if key is None:
                    if state:
                        raise TypeError(
                            f"delay_correction='predict' predicts with the optimizer's first "
                            f"moment (exp_avg or momentum_buffer), and "
                            f"{type(optimizer).__name__} keeps neither (its state: "
                            f"{sorted(state)}); use delay_correction='error_feedback'"
                        )
                    continue  # before the first update: no moment, no step to predict
                assert state is not None
                by_group.setdefault(group_of[id(param)], []).append((param, dst, state, key))
            for index, items in by_group.items():
                group = optimizer.param_groups[index]
                values = {k: v for k, v in group.items() if k != "params"}
                if hyper is not None:
                    values.update(hyper[index])
                for chunk in self._chunks(items):
                    self._step_shadow(group, values, chunk)

    def _chunks(
        self, items: list[tuple[Tensor, Tensor, dict[str, Any], str]]
    ) -> Iterator[list[tuple[Tensor, Tensor, dict[str, Any], str]]]:
        """``items`` in runs of at most :attr:`PREDICT_CHUNK_BYTES` of optimizer state (one
        parameter's at least): what one shadow step copies at once."""
        chunk: list[tuple[Tensor, Tensor, dict[str, Any], str]] = []
        size = 0
        for item in items:
            nbytes = sum(v.nbytes for v in item[2].values() if isinstance(v, Tensor))
            if chunk and size + nbytes > self.PREDICT_CHUNK_BYTES:
                yield chunk
                chunk, size = [], 0
            chunk.append(item)
            size += nbytes
        if chunk:
            yield chunk

    def _step_shadow(
        self,
        group: dict[str, Any],
        values: dict[str, Any],
        chunk: list[tuple[Tensor, Tensor, dict[str, Any], str]],
    ) -> None:
        """One step of an optimizer of the group's class, with the group's values, over the
        chunk's copies (``dst``), each starting from a copy of its parameter's state and taking
        its first moment as the gradient. The optimizer treats each parameter on its own, so
        the result is the same as one step per parameter, with one call's overhead."""
        dsts = [dst for _, dst, _, _ in chunk]
        cls = _inner_class(self.optimizer, group)
        shadow = self._shadows.get(cls)
        if shadow is None:
            shadow = cls(dsts)  # type: ignore[call-arg]
            self._shadows[cls] = shadow
        shadow.param_groups[0].update(values)
        shadow.param_groups[0]["params"] = dsts
        try:
            for _, dst, state, key in chunk:
                shadow.state[dst] = {
                    k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)
                    for k, v in state.items()
                }
                dst.grad = state[key].clone()
            shadow.step()
        finally:
            for dst in dsts:
                dst.grad = None
            shadow.state.clear()
            shadow.param_groups[0]["params"] = []


# ---------------------------------------------------------------------- error feedback
class ErrorFeedback(DelayCorrection):
    """Feed back the error of the last delayed step: the optimizer receives the due gradient
    plus ``strength`` times how much it moved since the previous one,

        W(t+1) = W(t) - U(g_t + k (g_t - g_{t-1}); S(t)),    g_t = grad f_t(W(t-1)),

    with k = :attr:`strength` and no correction for the first update (no g_{t-1}). The delay
    makes each update use a gradient one step old; to first order the error is the gradient's
    change over one step, H (W(t) - W(t-1)), which the last two delayed gradients estimate, and
    the update adds it back (error feedback, after arXiv 2606.30634's optimizer-agnostic
    correction: it transforms the gradient of any optimizer). g is the gradient the optimizer
    would see without the correction (clipped and unscaled). Memory: one gradient-sized buffer
    per parameter (the previous gradient, ``delay_previous_grad`` in the optimizer's state).
    Time: three element-wise passes per step.
    """

    name = "error_feedback"
    state_keys = ("delay_previous_grad",)
    kind = "gradient"
    strength: float = 2.0  # the best alone with AdamW in the screening (docs/pipedream-2bw.md)

    def __init__(self, optimizer: Optimizer, params: Sequence[Tensor]) -> None:
        super().__init__(optimizer, params)
        self._raw: dict[int, Tensor] = {}

    def before_step(self) -> None:
        with torch.no_grad():
            grads: list[Tensor] = []
            raws: list[Tensor] = []
            previous: list[Tensor] = []
            for param in self.params:
                grad = param.grad
                if grad is None:
                    continue
                raw = grad.clone()
                self._raw[id(param)] = raw
                before = self.state_of(param).get("delay_previous_grad")
                if before is not None:
                    grads.append(grad)
                    raws.append(raw)
                    previous.append(before)
            if grads:  # g + k (g - g_prev), every parameter in one pass of each
                torch._foreach_add_(grads, torch._foreach_sub(raws, previous), alpha=self.strength)

    def after_step(self) -> None:
        # kept only after the optimizer has stepped: Adam's family makes its state when the
        # state of a parameter is still empty at its first step
        for param in self.params:
            raw = self._raw.pop(id(param), None)
            if raw is not None:
                self.state_of(param)["delay_previous_grad"] = raw

    def skipped(self) -> None:
        self._raw.clear()


# ---------------------------------------------------------------------- Nesterov
class NesterovLookahead(DelayCorrection):
    """Nesterov's look-ahead on the optimizer's own updates: after the optimizer's step, the
    weights move on by ``momentum`` times how much that update changed from the previous one,

        u_t = U(g_t; S(t)),    W(t+1) = W(t) - u_t - b (u_t - u_{t-1}),

    with b = :attr:`momentum`, u the update the optimizer itself applied (before this
    correction) and none for the first update. This is Nesterov's accelerated step written on
    updates (W moves by (1 + b) u_t - b u_{t-1}, the look-ahead form of Sutskever et al.); with a
    fixed delay of one it steps ahead of where the stale gradient points, as Ajanthan et al.
    (ICML 2025) adapt Nesterov's look-ahead to a delay, for any optimizer. Memory: one
    weight-sized buffer per parameter (the previous update, ``delay_previous_update`` in the
    optimizer's state) and the weights before the step, copied during it. Time: four element-wise
    passes per step.
    """

    name = "nesterov"
    state_keys = ("delay_previous_update",)
    kind = "update"
    momentum: float = 0.5

    def __init__(self, optimizer: Optimizer, params: Sequence[Tensor]) -> None:
        super().__init__(optimizer, params)
        self._before: dict[int, Tensor] = {}

    def before_step(self) -> None:
        for param in self.params:
            if param.grad is not None:
                self._before[id(param)] = param.detach().clone()

    def after_step(self) -> None:
        with torch.no_grad():
            params: list[Tensor] = []
            updates: list[Tensor] = []
            for param in self.params:
                before = self._before.pop(id(param), None)
                if before is not None:
                    params.append(param)
                    updates.append(before)
            if not params:
                return
            torch._foreach_sub_(updates, params)  # u_t = W(t) - (W(t) - u_t)
            moved: list[Tensor] = []
            changes: list[Tensor] = []
            previous: list[Tensor] = []
            for param, update in zip(params, updates, strict=True):
                state = self.state_of(param)
                before = state.get("delay_previous_update")
                if before is not None:
                    moved.append(param)
                    changes.append(update)
                    previous.append(before)
                state["delay_previous_update"] = update
            if moved:  # W(t+1) -= b (u_t - u_{t-1}), every parameter in one pass of each
                steps = torch._foreach_sub(changes, previous)
                torch._foreach_sub_(moved, steps, alpha=self.momentum)

    def skipped(self) -> None:
        self._before.clear()


class UpdateFeedback(NesterovLookahead):
    """arXiv 2606.30634's update-level correction, as reported: after the optimizer's step, the
    weights move on by the whole change of its update since the previous one,

        u_t = U(g_t; S(t)),    W(t+1) = W(t) - 2 u_t + u_{t-1},

    u the optimizer's whole step (learning rate, moments, Muon's orthogonalisation) from the
    delayed gradient, none for the first update. With a delay of one the update applied is the
    one the optimizer would take extrapolated one step ahead (u_t + (u_t - u_{t-1})). It is
    :class:`NesterovLookahead` with b = 1, which it keeps its state with (the previous update,
    ``delay_previous_update``), so the two do not combine; it takes no coefficient. Memory: one
    weight-sized buffer per parameter. Time: as ``nesterov``.
    """

    name = "update_feedback"
    momentum = 1.0


class CombinedCorrection(DelayCorrection):
    """Several corrections at once, at most one of each kind: a prediction of where batches are
    evaluated, and gradient or update corrections (``"predict+error_feedback=0.5"``). Each
    keeps its own state; their hooks run in the order given."""

    name = "combined"

    def __init__(self, parts: Sequence[DelayCorrection]) -> None:
        super().__init__(parts[0].optimizer, parts[0].params)
        self.parts = list(parts)
        self.predicting = next((p for p in parts if p.predicts), None)

    @property  # type: ignore[override]
    def predicts(self) -> bool:  # type: ignore[override]
        return self.predicting is not None

    def predict(
        self, newest: list[Tensor], out: list[Tensor], hyper: list[dict[str, Any]] | None
    ) -> None:
        assert self.predicting is not None
        self.predicting.predict(newest, out, hyper)

    def before_step(self) -> None:
        for part in self.parts:
            part.before_step()

    def after_step(self) -> None:
        for part in self.parts:
            part.after_step()

    def skipped(self) -> None:
        for part in self.parts:
            part.skipped()

    @contextlib.contextmanager
    def stepping(self, params: Sequence[Tensor]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(super().stepping(params))
            for part in self.parts:
                stack.enter_context(part.stepping(params))
            yield


CORRECTIONS: dict[str, type[DelayCorrection]] = {
    cls.name: cls
    for cls in (NoCorrection, WeightPrediction, ErrorFeedback, NesterovLookahead, UpdateFeedback)
}
# the coefficient a correction takes after "=" in a spec, by name
_COEFFICIENT = {"error_feedback": "strength", "nesterov": "momentum"}
# what schedule="2bw" applies unless told otherwise: the fastest 2BW configuration to the common
# target loss of benchmarks/convergence.py (with Muon; with AdamW it is also the best, tied with
# predict+error_feedback=0.5, and the cheapest), see docs/pipedream-2bw.md
DEFAULT_CORRECTION = "error_feedback"


def parse_correction(spec: str) -> tuple[tuple[str, float | None], ...]:
    """The terms of a correction spec: names of :data:`CORRECTIONS` joined by ``+``, each
    optionally with its coefficient (``"error_feedback=0.5"``: its strength; ``"nesterov=0.9"``:
    its momentum). Raises ``ValueError`` naming the spec and the fix."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"delay_correction must be a string such as 'error_feedback', got {spec!r}"
        )
    valid = ", ".join(repr(n) for n in CORRECTIONS)
    terms: list[tuple[str, float | None]] = []
    for raw in spec.split("+"):
        name, eq, value = (part.strip() for part in raw.partition("="))
        if name not in CORRECTIONS:
            raise ValueError(
                f"unknown delay_correction {name!r} in {spec!r}; valid: {valid}, joined by '+' "
                "(e.g. 'predict+error_feedback=0.5')"
            )
        coefficient: float | None = None
        if eq:
            if name not in _COEFFICIENT:
                raise ValueError(
                    f"delay_correction {spec!r}: {name!r} takes no coefficient; only "
                    f"{', '.join(repr(n) for n in _COEFFICIENT)} do (e.g. 'error_feedback=0.5')"
                )
            try:
                coefficient = float(value)
            except ValueError:
                raise ValueError(
                    f"delay_correction {spec!r}: {name!r}'s coefficient {value!r} is not a number"
                ) from None
            if not math.isfinite(coefficient) or coefficient < 0:
                raise ValueError(
                    f"delay_correction {spec!r}: {name!r}'s coefficient must be a finite number "
                    f">= 0, got {coefficient!r}"
                )
        if any(n == name for n, _ in terms):
            raise ValueError(f"delay_correction {spec!r} names {name!r} twice")
        kind = CORRECTIONS[name].kind
        clash = next((n for n, _ in terms if CORRECTIONS[n].kind == kind != "none"), None)
        if clash is not None:
            raise ValueError(
                f"delay_correction {spec!r} joins {clash!r} and {name!r}, which both correct the "
                f"{kind}; keep one (update_feedback is nesterov=1.0)"
            )
        terms.append((name, coefficient))
    if len(terms) > 1 and any(n == "none" for n, _ in terms):
        raise ValueError(f"delay_correction {spec!r}: 'none' cannot be combined with others")
    return tuple(terms)


def canonical_correction(spec: str) -> str:
    """``spec`` in one spelling: its terms in the order of :data:`CORRECTIONS`, coefficients
    as Python prints them (``"error_feedback=0.5+predict"`` -> ``"predict+error_feedback=0.5"``)."""
    order = list(CORRECTIONS)
    terms = sorted(parse_correction(spec), key=lambda term: order.index(term[0]))
    return "+".join(name if c is None else f"{name}={c!r}" for name, c in terms)


def correction_predicts(spec: str) -> bool:
    """Whether ``spec`` evaluates batches at predicted weights."""
    return any(CORRECTIONS[name].predicts for name, _ in parse_correction(spec))


def make_correction(spec: str, optimizer: Optimizer, params: Sequence[Tensor]) -> DelayCorrection:
    """The correction ``spec`` (see :func:`parse_correction`) for a stage's ``params`` under
    ``optimizer``."""
    parts = []
    for name, coefficient in parse_correction(spec):
        part = CORRECTIONS[name](optimizer, params)
        if coefficient is not None:
            setattr(part, _COEFFICIENT[name], coefficient)
        parts.append(part)
    return parts[0] if len(parts) == 1 else CombinedCorrection(parts)

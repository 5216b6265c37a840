"""What the intake of a model learns from the user's own step, and the guard against a split that
trains silently wrong.

- :func:`step_call`: the arguments the user's step passes to the model on the first micro-batch
  (the step runs up to the model's call, which is stopped there), so that the structure of a
  model that is not an ``nn.Sequential`` is learnt from one forward (``partition.observe``) and
  the split is checked against the whole model (``partition.split``).
- :func:`whole_call`: the same on a whole batch, at every step, for a loss normalised by the
  batch's items.
- :func:`check_every_parameter_used`: at the first update, every trainable parameter must have
  received a gradient, as DDP checks (each stage checks its own, without a collective).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only

from lightning_pipe2bw.partition.observe import TURN_OFF, SplitError
from lightning_pipe2bw.runtime.call import BodyInput
from lightning_pipe2bw.runtime.microbatch import batch_size_of, split_batch

__all__ = ["check_every_parameter_used", "step_call", "whole_call"]


class _Stopped(BaseException):
    """Raised by the hook on the model's call: a BaseException, so that no ``except Exception``
    in the user's step swallows it."""

    def __init__(self, call: BodyInput) -> None:
        super().__init__("stopped at the model's call")
        self.call = call


def step_call(
    module: nn.Module, hook: str, loader: Any, microbatches: int, *, shapes_only: bool = False
) -> Callable[[nn.Module], BodyInput | None]:
    """A function that gives the arguments ``module.<hook>`` (the user's step) passes to a
    model on the first micro-batch of ``loader``'s first batch, or None where that cannot be had
    (no loader, a model on the meta device, a step that fails outside the loop or never calls
    the model): the intake then does without (a warning says so). The random state is put back
    (the loader's sampler draws its seed from it).

    ``shapes_only``: the call is wanted for its shapes (the default split counts FLOPs on it):
    a model on the meta device gets the call as the loader gives it, and a step that cannot
    run says nothing (the split says what it did instead)."""

    def call_of(model: nn.Module) -> BodyInput | None:
        on_meta = any(p.is_meta for p in model.parameters())
        if loader is None or (on_meta and not shapes_only):
            return None
        step = getattr(module, hook, None)
        if not callable(step):
            return None

        def first_step() -> None:
            batch = next(iter(loader))
            n = max(1, min(microbatches, batch_size_of(batch)))
            sample = split_batch(batch, n)[0][0]
            device = _device_of(model)
            if device is not None and not on_meta:
                sample = tree_map_only(Tensor, lambda t: t.to(device), sample)
            step(sample, 0)

        try:
            call = _stopped_at(model, first_step)
        except Exception as err:  # the step needs the loop (a log before the call, ...)
            if not shapes_only:
                _cannot(model, f"{hook} raised {type(err).__name__}: {err}")
            return None
        if call is None and not shapes_only:
            _cannot(model, f"{hook} did not call it on the first micro-batch")
        return call

    return call_of


def whole_call(
    module: nn.Module, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], body: nn.Module
) -> BodyInput | None:
    """The arguments the user's step (``module.<hook>(*args, **kwargs)``, on the whole batch
    ``args[0]``) passes to ``body``, the model: the step runs up to the call, which is stopped
    there, without gradient, with ``self.log`` muted and the random state put back; None where
    the step returns or fails before calling it. What a loss normalised by the batch's items
    counts (``runtime.items``)."""
    own = module.__dict__.get("log", _NOTHING)  # a log of the object's own, put back after
    module.__dict__["log"] = _muted  # shadows the method on this object only
    try:
        return _stopped_at(body, lambda: getattr(module, hook)(*args, **kwargs))
    except Exception:  # the micro-batches' steps raise it where it belongs
        return None
    finally:
        if own is _NOTHING:
            module.__dict__.pop("log", None)
        else:
            module.__dict__["log"] = own


def _stopped_at(model: nn.Module, run: Callable[[], Any]) -> BodyInput | None:
    """Run ``run()`` (the user's step) without gradient, the random state put back, until it
    calls ``model``: the arguments of that call, or None where it returned first (its other
    errors propagate)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    handle = model.register_forward_pre_hook(_stop, with_kwargs=True)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            run()
    except _Stopped as stopped:
        return stopped.call
    finally:
        handle.remove()
    return None


_NOTHING = object()


def _muted(*args: Any, **kwargs: Any) -> None:
    pass


def _stop(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    raise _Stopped(BodyInput(args, dict(kwargs)))


def _cannot(model: nn.Module, why: str) -> None:
    warnings.warn(
        f"pipe2bw: could not run {type(model).__name__} on the first micro-batch at set-up "
        f"({why}); its split follows the order it registers its modules in, unchecked until "
        "the first update checks that every parameter gets a gradient",
        stacklevel=2,
    )


def _device_of(model: nn.Module) -> torch.device | None:
    return next((p.device for p in model.parameters()), None)


def check_every_parameter_used(unused: list[str], stage: int) -> None:
    """Raise :class:`SplitError` when a trainable parameter of this stage got no gradient at
    the first update. Each stage checks its own parameters, without waiting on another (a
    parameter shared with another stage, whose copy there may be the one in use, is left out
    by the caller); a stage that raises takes the failure path, which stops the others with its
    error."""
    if not unused:
        return
    listed = sorted(unused)
    shown = listed if len(listed) <= 8 else [*listed[:8], f"... {len(listed) - 8} more"]
    raise SplitError(
        f"{len(listed)} trainable parameter(s) of stage {stage} got no gradient at the first "
        f"update: {shown}. Either the split runs the module that holds them on a stage where the "
        "forward never reaches it (the model runs them at another point than pipe2bw placed "
        "them: describe it with PipeModel(model, blocks=..., pre=[...], post=[...]), "
        "docs/models.md), or the model never uses them (freeze them with "
        f"requires_grad_(False)). To train on regardless, turn the check off with {TURN_OFF}"
    )

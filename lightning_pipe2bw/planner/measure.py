"""Measuring a body's blocks: forward/backward times and activation, output and weight bytes."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_pipe2bw.planner.profile import BlockProfile, Profile, ProfileSet
from lightning_pipe2bw.planner.timing import (
    Runs,
    call_block,
    fresh,
    sync,
    time_in_sequence,
    time_split,
    tree_map,
)
from lightning_pipe2bw.runtime.call import call_input
from lightning_pipe2bw.runtime.payload import grad_leaves
from lightning_pipe2bw.runtime.splitgrad import SplitBackward
from lightning_pipe2bw.runtime.stash import local_shard, run_eagerly

__all__ = ["MakeOptimizer", "profile_sizes", "storage_bytes"]

# builds the run's optimizer over some parameters, e.g. ``lambda ps: torch.optim.AdamW(ps)``
MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def profile_blocks(
    blocks: Sequence[nn.Module] | nn.Sequential,
    sample: Any,
    *,
    names: Sequence[str] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    device: torch.device | str | None = None,
    min_time_s: float = 0.0,
) -> Profile:
    """Measure every block of a body on one micro-batch ``sample`` (the body's input).

    Each block runs on a detached copy of the previous block's output (floating leaves require
    grad, as a pipeline stage receives them), which it may modify in place as a stage's blocks
    may (``nn.ReLU(inplace=True)``): the sample and the next block's input are not touched. ``forward_s`` and ``backward_s`` are medians over
    ``repeats`` timed runs after ``warmup`` untimed ones, or more while the timed runs have
    taken less than ``min_time_s`` in all (up to 10 x ``repeats``: small blocks' medians over a
    handful of millisecond runs are noisy on a shared machine). A run is what a stage does with one
    micro-batch: every block's forward in order, keeping the outputs, then every block's
    backward in reverse order, each timed on its own. Timing the blocks in sequence, not each one
    repeated alone, matters: a block that runs again at once finds its weights still in cache,
    and on a CPU that made blocks look 25-50% faster than they run in a stage. The backward is
    ``torch.autograd.backward`` of the output's grad-requiring floating leaves with gradients of
    ones (``backward_s`` is 0 when no output leaf requires grad); gradients accumulate into
    ``.grad`` as in gradient accumulation. ``input_grad_s`` and ``weight_grad_s`` time the same
    backward cut in two as the zero-bubble schedules' ``I`` and ``W`` run it (further runs:
    every inputs' pass in reverse order, then every weights' pass). ``output_bytes`` sums the
    output's tensor leaves; ``param_bytes`` the block's distinct parameters.

    ``saved_bytes`` is what autograd keeps alive for the block's backward: the tensors packed by
    ``torch.autograd.graph.saved_tensors_hooks`` during one forward that are still referenced by
    the graph once the forward returns, counting each storage once (by
    ``untyped_storage().data_ptr()``, the whole storage's bytes, as a saved view keeps its whole
    storage alive). Storages of the block's own parameters and buffers (weights) and of its input
    (the boundary activation, counted as the previous block's ``output_bytes``) are left out; the
    output is counted when autograd saves it (e.g. ``ReLU`` saves its result).

    The blocks run in train mode; every module's mode, the parameters' ``.grad``, the buffers
    (e.g. batch-norm running statistics) and the RNG state are restored afterwards, and no
    parameter is updated. ``device`` defaults to the blocks' (else the sample's) device; the
    sample is moved there, and blocks on another device are moved there (all of them, as the
    timing runs them in sequence) and back afterwards. ``names`` default to the ``nn.Sequential``'s child names, else indices.
    """
    mods = list(blocks)  # not .children(), which would drop a block listed twice
    if not mods:
        raise ValueError("profile_blocks needs at least one block")
    for i, m in enumerate(mods):
        if not isinstance(m, nn.Module):
            raise TypeError(f"block {i} is a {type(m).__name__}, not an nn.Module")
    if names is None and isinstance(blocks, nn.Sequential):
        names = list(blocks._modules)
    elif names is None:
        names = [str(i) for i in range(len(mods))]
    labels = [str(n) for n in names]
    if len(labels) != len(mods):
        raise ValueError(f"got {len(labels)} names for {len(mods)} blocks; give one name per block")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    if not (math.isfinite(min_time_s) and min_time_s >= 0):
        raise ValueError(f"min_time_s must be a number of seconds >= 0, got {min_time_s!r}")
    leaves = [x for x in pytree.tree_leaves(sample) if isinstance(x, Tensor)]
    batched = [x for x in leaves if x.ndim >= 1]
    if not batched:
        raise TypeError(
            "the sample must be a tensor or a tuple/list/dict of tensors holding one micro-batch "
            f"(dimension 0 is the micro-batch size); got {type(sample).__name__} with no "
            "tensor of ndim >= 1. Pass the body's input for one micro-batch."
        )
    dev = torch.device(device) if device is not None else _default_device(mods, leaves[0])
    if dev.type == "meta":
        raise ValueError("cannot time blocks on the meta device; pass device='cpu' or 'cuda'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())

    cuda = dev.type == "cuda"
    results: list[BlockProfile] = []
    rng = torch.random.fork_rng([dev.index] if cuda else [], device_type="cuda" if cuda else None)
    with _kept_state(mods), rng, torch.inference_mode(False), torch.enable_grad():
        x = tree_map(lambda t: t.detach().to(dev), sample)
        call = x  # a model's head (its last block) runs with the call's own arguments
        inputs = []
        with ExitStack() as moved:
            for i, (name, block) in enumerate(zip(labels, mods, strict=True)):
                moved.enter_context(_on_device(block, dev, i))
                moved.enter_context(call_input(block, call))
                block.train()
                inputs.append(x)
                profile, x = _measure_bytes(block, x, i, name)
                results.append(profile)
            forward, backward = time_in_sequence(
                mods, labels, inputs, dev, Runs(warmup, repeats, min_time_s)
            )
            cut = time_split(mods, labels, inputs, dev, Runs(warmup, repeats, min_time_s), backward)
        results = [
            dataclasses.replace(r, forward_s=f, backward_s=b, input_grad_s=i, weight_grad_s=w)
            for r, f, b, (i, w) in zip(results, forward, backward, cut, strict=True)
        ]
    meta: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "warmup": warmup,
    }
    if cuda:
        meta["device_name"] = torch.cuda.get_device_name(dev)
    return Profile(
        microbatch_size=int(batched[0].shape[0]),
        input_bytes=_leaf_bytes(sample),
        blocks=tuple(results),
        device=dev.type,
        repeats=repeats,
        meta=meta,
    )


def profile_sizes(
    blocks: Sequence[nn.Module] | nn.Sequential,
    make_sample: Callable[[int], Any],
    sizes: Sequence[int],
    *,
    names: Sequence[str] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    device: torch.device | str | None = None,
    optimizer: MakeOptimizer | None = None,
    min_time_s: float = 0.0,
) -> ProfileSet:
    """Profile the blocks at each micro-batch size; ``make_sample(b)`` gives a sample of size b.
    With ``optimizer``, each block's ``update_s`` is its parameters' update (see
    :func:`update_times`). ``min_time_s``: see :func:`profile_blocks` (the updates share it)."""
    if not sizes:
        raise ValueError("profile_sizes needs at least one micro-batch size")
    profiles = []
    for size in sizes:
        profile = profile_blocks(
            blocks, make_sample(size), names=names, warmup=warmup, repeats=repeats,
            device=device, min_time_s=min_time_s,
        )  # fmt: skip
        if profile.microbatch_size != size:
            raise ValueError(
                f"make_sample({size}) returned a sample with micro-batch size "
                f"{profile.microbatch_size}; dimension 0 of its first tensor must be {size}"
            )
        profiles.append(profile)
    if optimizer is not None:
        updates = update_times(
            blocks, optimizer, warmup=warmup, repeats=repeats, device=device, min_time_s=min_time_s
        )
        profiles = [
            dataclasses.replace(
                p,
                blocks=tuple(
                    dataclasses.replace(b, update_s=u)
                    for b, u in zip(p.blocks, updates, strict=True)
                ),
            )
            for p in profiles
        ]
    return ProfileSet(tuple(profiles))


def update_times(
    blocks: Sequence[nn.Module] | nn.Sequential,
    optimizer: MakeOptimizer,
    *,
    warmup: int = 2,
    repeats: int = 5,
    device: torch.device | str | None = None,
    min_time_s: float = 0.0,
) -> list[float]:
    """Median seconds of one ``optimizer`` step over each block's trainable parameters (more
    than ``repeats`` steps while a block's have taken less than its share of ``min_time_s``).

    The step runs on copies of the parameters, with random gradients, so the blocks and their
    gradients are untouched; the optimizer's state is created by the warm-up steps (Adam's first
    step allocates its moments), so the figure is a steady-state step's.
    """
    times = []
    for block in blocks:
        params = [p for p in dict.fromkeys(block.parameters()) if p.requires_grad]
        if not params:
            times.append(0.0)
            continue
        dev = torch.device(device) if device is not None else params[0].device
        copies = [nn.Parameter(p.detach().to(dev).clone()) for p in params]
        for c in copies:
            c.grad = torch.randn_like(c)
        opt = optimizer(copies)
        runs = []
        loop = Runs(warmup, max(repeats, 1), min_time_s / len(blocks))
        for run in loop:
            sync(dev)
            start = time.perf_counter()
            opt.step()
            sync(dev)
            if run >= warmup:
                loop.spent += time.perf_counter() - start
                runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs))
    return times


def _measure_bytes(block: nn.Module, x: Any, index: int, name: str) -> tuple[BlockProfile, Any]:
    """One block's byte counts (times are filled in later), and its detached output (the next
    block's input)."""
    exclude = {storage_key(t)[0] for t in (*block.parameters(), *block.buffers())}
    inp = fresh(x)
    exclude |= {storage_key(t)[0] for t in pytree.tree_leaves(inp) if isinstance(t, Tensor)}
    packed: list[weakref.ref[Tensor]] = []

    @run_eagerly  # as written when a compiled block calls it (see runtime.stash)
    def pack(t: Tensor) -> Tensor:
        # a detached alias: packing a saved output itself would tie it to its own grad_fn in a
        # reference cycle, alive after its graph died; the alias lives exactly as long as the node
        alias = t.detach()
        packed.append(weakref.ref(alias))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call_block(block, inp, index, name)
    storages: dict[int, int] = {}
    for ref in packed:
        t = ref()
        if t is not None:
            key, size = storage_key(t)
            if key not in exclude:
                storages[key] = size
    nxt = tree_map(lambda t: t.detach(), out)
    output_bytes = _leaf_bytes(out)
    backward_bytes = _backward_bytes(block, inp, out)
    del inp, out
    profile = BlockProfile(
        name=name,
        forward_s=0.0,
        backward_s=0.0,
        output_bytes=output_bytes,
        saved_bytes=sum(storages.values()),
        param_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
        backward_bytes=backward_bytes,
        cut_bytes=_cut_bytes(block, x, index, name),
    )
    return profile, nxt


def _backward_bytes(block: nn.Module, inp: Any, out: Any) -> int:
    """The most bytes the backward of ``out`` allocates and holds at once (see
    :class:`NewStorages`), run with the weights' gradients already in place, as every
    micro-batch's backward after a step's first finds them."""
    roots = grad_leaves(out)
    if not roots:
        return 0
    leaves = grad_leaves((inp, list(block.parameters())))
    for p in block.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    seeds = [torch.ones_like(t) for t in roots]  # the gradient that arrives: not the backward's
    new = NewStorages()
    with new:
        torch.autograd.backward(roots, seeds, inputs=leaves or None)
    return new.peak


def _cut_bytes(block: nn.Module, x: Any, index: int, name: str) -> int:
    """What the backward of a fresh forward cut in two keeps between its passes
    (:attr:`SplitBackward.kept_bytes`); 0 where it cannot be cut."""
    inp = fresh(x)
    inputs = grad_leaves(inp)
    roots = grad_leaves(call_block(block, inp, index, name))
    seeds: list[Tensor | None] = [torch.ones_like(t) for t in roots]
    split = SplitBackward.plan(roots, seeds, inputs) if roots and inputs else None
    if split is None:
        return 0
    split.inputs_pass()
    kept = split.kept_bytes
    split.weights_pass()
    return kept


class NewStorages(TorchDispatchMode):
    """While active: the bytes of the storages that operators create and that are still alive,
    now and at most (``peak``). A storage an operator returns that one of its inputs already
    had (a view, an in-place result) is not new; one that exists already is counted once."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.now -= self._live.pop(key)[1]
        out = func(*args, **(kwargs or {}))
        seen = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, Tensor)
        }
        for t in pytree.tree_leaves(out):
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in seen and key not in self._live:
                self._live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def _leaf_bytes(tree: Any) -> int:
    leaves = pytree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, Tensor))


def storage_key(t: Tensor) -> tuple[int, int]:
    """(key, bytes) of the storage behind ``t``; tensors without one count alone, by id. A
    DTensor (``fsdp=True``) counts the shard this rank holds."""
    t = local_shard(t)
    try:
        storage = t.untyped_storage()
        if storage.data_ptr() != 0:
            return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        pass
    return -id(t), t.numel() * t.element_size()


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind the tensors among ``tensors`` (meta tensors and
    anything else skipped): views and shared tensors count once."""
    seen = dict(
        storage_key(t) for t in tensors if isinstance(t, Tensor) and t.device.type != "meta"
    )
    return sum(seen.values())


def _default_device(mods: list[nn.Module], first_leaf: Tensor) -> torch.device:
    for block in mods:
        for t in (*block.parameters(), *block.buffers()):
            if t.device.type != "meta":
                return t.device
    return first_leaf.device


@contextmanager
def _kept_state(mods: list[nn.Module]) -> Iterator[None]:
    """Restore every module's mode, the parameters' ``.grad`` and the buffers' values on exit.

    Looked up by owner and name, since moving a block between devices replaces its buffers.
    """
    owners = list(dict.fromkeys(m for block in mods for m in block.modules()))
    modes = [m.training for m in owners]
    grads = [(m, n, p.grad) for m in owners for n, p in m.named_parameters(recurse=False)]
    buffers = [(m, n, b.clone()) for m in owners for n, b in m.named_buffers(recurse=False)]
    for m, n, _ in grads:
        getattr(m, n).grad = None
    try:
        yield
    finally:
        with torch.no_grad():  # restoring state only, not a measurement
            for m, n, value in buffers:
                getattr(m, n).copy_(value)
        for m, n, grad in grads:
            getattr(m, n).grad = grad
        for m, mode in zip(owners, modes, strict=True):
            m.training = mode


@contextmanager
def _on_device(block: nn.Module, dev: torch.device, index: int) -> Iterator[None]:
    """Run ``block`` on ``dev``, moving it there and back when its tensors live elsewhere."""
    devices = {t.device for t in (*block.parameters(), *block.buffers())}
    if any(d.type == "meta" for d in devices):
        raise ValueError(
            f"block {index} has tensors on the meta device; materialise it (e.g. "
            "module.to_empty(device=...) and initialise it) before profiling"
        )
    if len(devices) > 1:
        raise ValueError(
            f"block {index} has tensors on several devices {sorted(map(str, devices))}; "
            "move it to one device before profiling"
        )
    home = devices.pop() if devices else dev
    if home == dev:
        yield
        return
    block.to(dev)
    try:
        yield
    finally:
        block.to(home)

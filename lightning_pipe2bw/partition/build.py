"""Turning a module's body into this rank's stage: keep the owned blocks, release the rest."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_pipe2bw.partition.pipemodel import PipeModelBody, release, restore_model
from lightning_pipe2bw.partition.split import BodyRef, Partition, make_partition
from lightning_pipe2bw.partition.ties import find_ties, share_parameter
from lightning_pipe2bw.runtime.stage import StageBody

__all__ = ["Init", "Uninitialized", "UninitializedError", "build_stage", "check_callable_blocks"]

Init = Callable[[nn.Module], None]
"""A per-module initialiser, called like ``nn.Module.apply``'s function (``pipeline_init``)."""


def build_stage(
    module: nn.Module,
    ref: BodyRef,
    stage: int,
    num_stages: int,
    balance: Sequence[int] | None,
    device: torch.device,
    *,
    recompute: bool = False,
    memory_plan: Mapping[int, str] | None = None,
    init: Init | None = None,
    stages: Sequence[int] | None = None,
) -> tuple[StageBody, Partition]:
    """Replace the body ``ref`` of ``module`` by this stage's :class:`StageBody`, which
    recomputes its activations (``recompute``) or follows ``memory_plan``.

    The other stages' blocks are dropped (and freed when nothing else holds them); blocks built
    on the meta device (``configure_model``) are materialised here, owned ones only, and
    initialised with ``init`` (called for every submodule, like ``nn.Module.apply``), else the
    body's model's ``_init_weights``, else ``reset_parameters()`` (see :func:`_materialize`);
    a tensor left uninitialised raises :class:`UninitializedError`. A body that
    an earlier ``trainer`` call already partitioned is reused with its blocks, and takes this
    call's ``recompute`` and ``memory_plan``.

    With virtual stages, ``num_stages`` counts the pipeline's stages and ``stages`` names those
    this rank holds (``stage`` is then the rank's place in the pipeline): the body holds their
    blocks, stage by stage.
    """
    held = tuple(stages) if stages is not None else (stage,)
    current = ref.module
    if isinstance(current, StageBody):
        if current.num_stages != num_stages or current.stages != held:
            raise ValueError(
                f"this module was partitioned for {_stages(current.stages)} of "
                f"{current.num_stages} and cannot be re-used as {_stages(held)} of {num_stages}"
            )
        current.run_again(recompute, memory_plan)
        return current, Partition(current.balance)
    # the body's model initialiser, looked up on the body itself before it is replaced (for a
    # body built on meta only: a bound method of the body would keep every block alive)
    model_init = _nearest_model_init(_owners(module, ref.path)) if _has_meta(module) else None
    blocks = list(current.children())
    check_callable_blocks(blocks, ref.path)
    partition = make_partition(len(blocks), num_stages, balance)
    owned = [i for v in held for i in partition.blocks_of(v)]
    model_body = current if isinstance(current, PipeModelBody) else None
    model = model_body.spec.model if model_body is not None else None
    stage_body = StageBody(
        ((i, blocks[i]) for i in owned),
        stage=stage,
        num_stages=num_stages,
        balance=partition.balance,
        recompute=recompute,
        memory_plan=memory_plan,
        takes_any_call=model_body is not None,
        owner=model_body.owner if model_body is not None else None,
        ties=find_ties(blocks),
        model=model,
        restore=functools.partial(restore_model, model) if model is not None else None,
        release=functools.partial(release, model) if model is not None else None,
        built_on_meta=any(_has_meta(blocks[i]) for i in owned),
        stages=held,
    )
    if model_body is not None:
        stage_body.unused_by_model = model_body.unused_by_model
    if model is not None:
        release(model, [b for i, b in enumerate(blocks) if i not in owned])
    setattr(ref.parent, ref.attr, stage_body)  # the other stages' blocks are released here
    del blocks, current, model_body, model
    _check_params_outside_body(module, ref.path)
    _materialize(module, stage_body, owned, device, model_init=model_init, init=init)
    if stage_body.built_on_meta:
        retie(stage_body)
    return stage_body, partition


def _stages(stages: Sequence[int]) -> str:
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {list(stages)}"


def retie(body: StageBody) -> None:
    """Make the blocks of ``body`` that share a parameter share it again (materialising each
    block on its own gives each its own copy): every use on this stage becomes the primary's."""
    for tie in body.ties:
        mine = [f"{b}.{n}" for b, n in tie.uses if b in body.indices]
        if len(mine) > 1:
            share_parameter(body, mine[0], mine[1:])


def check_callable_blocks(blocks: list[nn.Module], body: str) -> None:
    """Every block is called with the previous block's output: a container without a forward
    (``nn.ModuleList``, ``nn.ModuleDict``) cannot be one. (``torch.compile``'s
    ``OptimizedModule`` sets its forward on the instance.)"""
    bad = [
        f"{body}.{i} ({type(b).__name__})"
        for i, b in enumerate(blocks)
        if type(b).forward is nn.Module.forward and "forward" not in vars(b)
    ]
    if bad:
        raise TypeError(
            f"blocks of the pipeline body have no forward: {', '.join(bad)}. The body calls each "
            "block with the previous block's output; put the layers of a list into the body "
            "itself (nn.Sequential(*layers)), or wrap them in a module whose forward runs them"
        )


def _check_params_outside_body(module: nn.Module, body_path: str) -> None:
    stray = [name for name, _ in module.named_parameters() if not name.startswith(body_path + ".")]
    if stray:
        raise ValueError(
            f"parameters outside the pipeline body {body_path!r}: {stray}. Every layer with "
            "parameters must be a block of the body so that exactly one stage owns it; move "
            "these layers into the body (e.g. an embedding as its first block, a head as its last)"
        )


# ----------------------------------------------------------------------------- materialising


@dataclass(frozen=True)
class Uninitialized:
    """A tensor materialised from the meta device that no initialiser wrote: its full dotted
    name in the user's module, its kind (``parameter``, ``buffer``, ``non-persistent buffer``),
    the class of the module that holds it, what it holds (``NaN``, ``inf``, or ``unwritten``
    for a tensor that cannot hold NaN) and which initialiser ran on its module."""

    name: str
    kind: str
    cls: str
    value: str
    initialiser: str
    # the sort key: the module's path in natural order, then the tensor's place in it
    order: tuple[tuple[int, int | str], ...] = ()

    def describe(self) -> str:
        held = {"NaN": "holds NaN (never written)", "inf": "holds inf"}.get(
            self.value, "was never written"
        )
        return f"{self.name} ({self.kind} of {self.cls}) {held}: {self.initialiser}"


class UninitializedError(ValueError):
    """Tensors built on the meta device that nothing initialised (``entries``, in module
    order)."""

    def __init__(self, entries: Iterable[Uninitialized]) -> None:
        self.entries = tuple(sorted(set(entries), key=lambda u: u.order))
        super().__init__(uninitialized_message(self.entries))


def uninitialized_message(entries: Sequence[Uninitialized], shown: int = 10) -> str:
    lines = [f"  - {u.describe()}" for u in entries[:shown]]
    if len(entries) > shown:
        lines.append(f"  - ... and {len(entries) - shown} more")
    message = (
        f"{len(entries)} tensor{'s' if len(entries) != 1 else ''} built on the meta device "
        "(in configure_model) hold no initial value after materialisation; training would read "
        "uninitialised memory:\n" + "\n".join(lines) + "\nFix one of: define "
        "reset_parameters() on that module (each block is initialised under seed "
        "initial_seed + its index); define pipeline_init(self, module) on the LightningModule, "
        "called for every submodule of a block like nn.Module.apply (it replaces "
        "reset_parameters, so initialise every module it receives); or build the body in "
        "__init__ instead of configure_model."
    )
    if any(u.kind != "parameter" for u in entries):
        message += (
            " A buffer computed in __init__ (a causal mask, a position table) is lost on the "
            "meta device as well: recompute it in reset_parameters() or pipeline_init, or "
            "create it with an explicit device."
        )
    return message


def _model_init(module: nn.Module) -> Init | None:
    """``module._init_weights`` when it is a per-module initialiser, as Hugging Face models
    have (``_init_weights(module)``); ``None`` for anything else of that name (e.g. a
    LightningModule's ``_init_weights(self, n_layer: int)``)."""
    fn = getattr(module, "_init_weights", None)
    if not callable(fn):
        return None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if len(required) != 1 or required[0].kind not in positional:
        return None
    annotation = required[0].annotation
    if annotation is inspect.Parameter.empty:
        return fn  # type: ignore[no-any-return]
    if isinstance(annotation, str):
        return fn if "Module" in annotation else None  # type: ignore[return-value]
    if isinstance(annotation, type):
        related = issubclass(annotation, nn.Module) or issubclass(nn.Module, annotation)
        return fn if related else None  # type: ignore[return-value]
    return fn  # type: ignore[no-any-return]


def _owners(root: nn.Module, path: str) -> list[nn.Module]:
    """The module at dotted ``path`` and every module containing it, nearest first."""
    chain = [root]
    if path:
        for name in path.split("."):
            chain.append(getattr(chain[-1], name))
    return chain[::-1]


def _nearest_model_init(owners: Sequence[nn.Module]) -> tuple[Init, str] | None:
    for owner in owners:
        fn = _model_init(owner)
        if fn is not None:
            return fn, f"{type(owner).__name__}._init_weights"
    return None


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """``nn.Module.apply``'s order: every child's subtree, then the module."""
    for child in module.children():
        yield from _post_order(child)
    yield module


def _reset(sub: nn.Module, labels: dict[int, str]) -> None:
    reset = getattr(sub, "reset_parameters", None)
    if callable(reset):
        reset()
        labels[id(sub)] = f"{type(sub).__name__}.reset_parameters() left it unset"
    else:
        labels[id(sub)] = f"{type(sub).__name__} has no reset_parameters()"


def _initialise_block(
    block: nn.Module,
    init: Init | None,
    inherited: tuple[Init, str] | None,
    labels: dict[int, str],
) -> None:
    """Initialise every submodule of ``block``: with ``init`` (the user's ``pipeline_init``),
    else with the nearest ``_init_weights`` (the body's model's, ``inherited``, or that of a
    submodule that is a model itself), children before parents as Hugging Face's
    ``initialize_weights`` does, else with ``reset_parameters()`` in ``modules()`` order."""
    if init is not None:
        for sub in _post_order(block):
            init(sub)
            labels[id(sub)] = "pipeline_init left it unset"
        return
    if inherited is None and not any(_model_init(sub) is not None for sub in block.modules()):
        for sub in block.modules():
            _reset(sub, labels)
        return

    def visit(sub: nn.Module, current: tuple[Init, str] | None) -> None:
        own = _model_init(sub)
        if own is not None:
            current = (own, f"{type(sub).__name__}._init_weights")
        for child in sub.children():
            visit(child, current)
        if current is None:
            _reset(sub, labels)
        else:
            current[0](sub)
            labels[id(sub)] = f"{current[1]} left it unset"

    visit(block, inherited)


def _direct_tensors(sub: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    for name, param in sub._parameters.items():
        if param is not None:
            yield name, param, True
    for name, buf in sub._buffers.items():
        if buf is not None:
            yield name, buf, False


def _allocate(sub: nn.Module, device: torch.device, recurse: bool) -> list[_Fresh]:
    """``to_empty`` with every floating tensor filled with NaN, so that one no initialiser
    writes is detectable; what was allocated, to check after initialisation."""
    sub.to_empty(device=device, recurse=recurse)
    fresh = []
    with torch.no_grad():
        for owner in sub.modules() if recurse else (sub,):
            for name, tensor, _ in _direct_tensors(owner):
                if tensor.is_floating_point() or tensor.is_complex():
                    tensor.fill_(math.nan)
                fresh.append(_Fresh(owner, name, tensor, tensor._version))
    return fresh


@dataclass(frozen=True)
class _Fresh:
    owner: nn.Module
    name: str
    tensor: torch.Tensor
    version: int


def _non_finite(tensor: torch.Tensor) -> str | None:
    """``"NaN"`` or ``"inf"`` if ``tensor`` holds one, else ``None``; a sum first, which needs
    no temporary as large as the tensor (a peak during set-up), the exact test only when the
    sum is not finite."""
    with torch.no_grad():
        if bool(torch.isfinite(tensor.sum()).all()):
            return None
        if bool(torch.isnan(tensor).any()):
            return "NaN"
        return "inf" if not bool(torch.isfinite(tensor).all()) else None


def _uninitialized(
    root: nn.Module, fresh: Iterable[_Fresh], labels: dict[int, str]
) -> list[Uninitialized]:
    """The allocated tensors that still hold NaN (or, for parameters, inf), and those that
    cannot hold NaN (integer, bool) and were neither written in place nor replaced."""
    names: dict[int, str] = {}
    for prefix, sub in root.named_modules(remove_duplicate=False):
        names.setdefault(id(sub), prefix)
    found = []
    for place, f in enumerate(fresh):
        is_param = f.name in f.owner._parameters
        current = f.owner._parameters.get(f.name) if is_param else f.owner._buffers.get(f.name)
        if current is None:
            continue
        if current.is_floating_point() or current.is_complex():
            value = _non_finite(current)
            if value is None or (value == "inf" and not is_param):  # a mask may hold -inf
                continue
        elif current is f.tensor and current._version == f.version:
            value = "unwritten"
        else:
            continue
        if is_param:
            kind = "parameter"
        elif f.name in f.owner._non_persistent_buffers_set:
            kind = "non-persistent buffer"
        else:
            kind = "buffer"
        prefix = names.get(id(f.owner), "")
        found.append(
            Uninitialized(
                name=f"{prefix}.{f.name}" if prefix else f.name,
                kind=kind,
                cls=type(f.owner).__name__,
                value=value,
                initialiser=labels.get(id(f.owner), "nothing initialised it"),
                order=(*_natural(prefix), (0, place)),
            )
        )
    return found


def _natural(path: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key that puts ``body.2`` before ``body.10``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in path.split(".") if p)


def _materialize(
    module: nn.Module,
    stage_body: StageBody,
    owned: Sequence[int],
    device: torch.device,
    *,
    model_init: tuple[Init, str] | None = None,
    init: Init | None = None,
) -> None:
    """Allocate meta tensors (from ``configure_model``) on ``device`` and initialise them.

    Each owned block holding meta tensors is allocated, its floating tensors filled with NaN,
    and initialised under seed ``initial_seed + index`` (so a block's initial weights do not
    depend on the partition): with ``init`` for every submodule (the user's
    ``pipeline_init``), else with ``model_init`` (the ``_init_weights`` of the body or of the
    nearest module containing it, and its name), else with each
    submodule's ``reset_parameters()``. Modules outside the body holding meta tensors
    (parameter-free ones: buffers) are allocated and initialised alike, under the current
    seed. Raises :class:`UninitializedError` naming every tensor still uninitialised."""
    if not _has_meta(module):
        return
    base_seed = torch.initial_seed()
    fresh: list[_Fresh] = []
    labels: dict[int, str] = {}
    for index, block in zip(owned, stage_body.children(), strict=True):
        if not _has_meta(block):
            continue  # built on a real device: its values are the user's
        fresh += _allocate(block, device, recurse=True)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(base_seed + index)
            _initialise_block(block, init, model_init, labels)
    # modules outside the body built on meta (parameter-free ones, or buffers): allocate only
    # what is still on meta, never re-allocating the blocks initialised above
    for path, sub in module.named_modules():
        if not any(t.is_meta for _, t, _ in _direct_tensors(sub)):
            continue
        fresh += _allocate(sub, device, recurse=False)
        with torch.no_grad():
            if init is not None:
                init(sub)
                labels[id(sub)] = "pipeline_init left it unset"
            elif (found := _nearest_model_init(_owners(module, path))) is not None:
                found[0](sub)
                labels[id(sub)] = f"{found[1]} left it unset"
            else:
                _reset(sub, labels)
    problems = _uninitialized(module, fresh, labels)
    if problems:
        raise UninitializedError(problems)

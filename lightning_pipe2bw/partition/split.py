"""Finding a module's pipeline body and splitting its blocks into contiguous stages."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_pipe2bw.partition.carry import LayerCall
from lightning_pipe2bw.partition.guard import observed_problems
from lightning_pipe2bw.partition.hf import hf_layout, known_models, pipe_model_for
from lightning_pipe2bw.partition.observe import TURN_OFF, SplitError, compare_outputs, evaluating
from lightning_pipe2bw.partition.pipemodel import PipeModel, PipeModelBody
from lightning_pipe2bw.partition.replay import ReadsBlanks
from lightning_pipe2bw.partition.standin import split_call, training_kwargs
from lightning_pipe2bw.runtime.call import BodyInput
from lightning_pipe2bw.runtime.stage import StageBody

# the arguments the user's step passes to a model on the first micro-batch, or None
CallOf = Callable[[nn.Module], BodyInput | None]

__all__ = ["BodyRef", "Partition", "find_body", "make_partition"]


@dataclass(frozen=True)
class BodyRef:
    """Where the body lives: ``parent.<attr>`` is the ``nn.Sequential`` of blocks. ``call``:
    the body's arguments on the first micro-batch, where finding it took one (a model whose
    structure is learnt from its forward), for the default split's FLOP count."""

    parent: nn.Module
    attr: str
    path: str  # dotted path from the LightningModule, for messages and state_dict keys
    call: BodyInput | None = None

    @property
    def module(self) -> nn.Module:
        return getattr(self.parent, self.attr)  # type: ignore[no-any-return]


def _resolve(
    root: nn.Module, path: str, call_of: CallOf | None = None, check: bool = True
) -> BodyRef:
    parent = root
    *heads, attr = path.split(".")
    for name in heads:
        child = getattr(parent, name, None)
        if not isinstance(child, nn.Module):
            raise ValueError(
                f"body path {path!r}: {name!r} is not a submodule of {type(parent).__name__}"
            )
        parent = child
    body = getattr(parent, attr, None)
    if body is None:
        raise ValueError(
            f"body path {path!r}: {type(parent).__name__} has no attribute {attr!r}; pass the name of the nn.Sequential attribute that holds the blocks"
        )
    if not isinstance(body, (nn.Sequential, StageBody)) and isinstance(body, nn.Module):
        if hf_layout(body) is not None:
            call = call_of(body) if call_of is not None else None
            spec = pipe_model_for(body, call)
            assert spec is not None
            return _install(parent, attr, path, spec, call, check)
    if not isinstance(body, (nn.Sequential, StageBody)):
        hint = (
            " (a ModuleList has no forward: nn.Sequential(*layers) holds the same layers under "
            "the same names and runs them in order; or, when a model's forward loops over the "
            "list, leave the model as it is and describe it with a `pipeline_body()` method "
            "returning PipeModel(model, blocks='<the list's path in the model>', pre=[...], "
            "post=[...]), docs/models.md)"
            if isinstance(body, nn.ModuleList)
            else ""
        )
        raise TypeError(
            f"the pipeline body {path!r} must be an nn.Sequential of blocks, got {type(body).__name__}; "
            f"wrap the blocks in nn.Sequential, or describe the model with `pipeline_body()` "
            f"returning a PipeModel(model, blocks=..., pre=[...], post=[...]){hint}"
        )
    return BodyRef(parent, attr, path)


def _install(
    parent: nn.Module,
    attr: str,
    path: str,
    spec: PipeModel,
    call: BodyInput | None,
    check: bool = True,
) -> BodyRef:
    """Put ``spec``'s body in place of its model at ``parent.<attr>``: the model's own modules
    as a sequence of blocks (see ``partition.pipemodel``). With ``check``, first check that the
    body computes what the model does on ``call`` (the step's arguments on the first
    micro-batch, where there is one), and the body proves every micro-batch of new shapes to
    split exactly (``partition.guard``)."""
    body = spec.body(check)
    try:
        if check and call is not None:
            check_split(spec, body, call)
    finally:
        spec.observed = None  # the whole model's output: not kept
    setattr(parent, attr, body)
    return BodyRef(parent, attr, path, call)


def check_split(spec: PipeModel, body: nn.Module, call: BodyInput) -> None:
    """Raise :class:`SplitError` unless the split ``body`` of ``spec.model``, run block after
    block in this process, returns what the whole model returns on ``call`` (eval mode, no
    gradient, the random state put back): every tensor of the output both have (``loss``,
    ``logits``) within rtol 1e-4, atol 1e-5; and, where the whole model's forward was watched,
    unless every layer is passed what the whole model passed it.

    Where a stage's replay of the forward reads a part an earlier stage holds (an
    encoder-decoder's output holds the encoder's), the part's output is made to travel to it
    (``PipeModel.carried``) and the check runs again."""
    model = spec.model
    for attempt in range(4):
        try:
            with evaluating(model):
                if spec.observed is not None:
                    whole = spec.observed.output
                else:
                    whole = model(*call.args, **training_kwargs(model, call.kwargs))
                with _layer_calls(spec) as seen:
                    split = body(*call.args, **call.kwargs)
        except ReadsBlanks as err:
            new = [p for p in err.paths if p not in spec.carried]
            if not new or attempt == 3 or not isinstance(body, PipeModelBody):
                raise
            body.carry_parts(new)
            continue
        break
    if spec.observed is not None:
        _check_calls(spec, seen)
    problems = compare_outputs(whole, split)
    if problems:
        raise SplitError(
            f"the pipeline split of {type(model).__name__} computes something else than the "
            f"whole model on the first micro-batch ({'; '.join(problems)}). pipe2bw put "
            f"{list(spec.pre)} before its layers {spec.blocks!r} (first stage) and "
            f"{list(spec.post)} after them (last stage). Describe the model with "
            "PipeModel(model, blocks=..., pre=[...], post=[...], head=...) from a "
            "`pipeline_body()` method of your LightningModule (docs/models.md), or turn the "
            f"check off with {TURN_OFF}"
        )


@contextmanager
def _layer_calls(spec: PipeModel) -> Iterator[dict[int, tuple[Any, LayerCall]]]:
    """What each layer (by index over all lists) is called with while the block runs."""
    seen: dict[int, tuple[Any, LayerCall]] = {}
    handles = []
    g = 0
    for path in spec.stacks:
        for layer in spec.model.get_submodule(path).children():

            def hook(module: nn.Module, args: Any, kwargs: Any, g: int = g) -> None:
                seen.setdefault(g, (module, split_call(module, g, tuple(args), dict(kwargs))[1]))

            handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            g += 1
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _check_calls(spec: PipeModel, seen: dict[int, tuple[Any, LayerCall]]) -> None:
    """Raise :class:`SplitError` unless each layer was passed, in the split, what the whole
    model's forward passed it (``spec.observed.calls``): the arguments of a layer that the
    forward computes from what an earlier layer returns, other than the values the split
    carries from layer to layer, are not what a run with stand-ins for the layers gives."""
    problems = []
    for g, (args, kwargs) in enumerate(spec.observed.calls):
        if g not in seen:
            problems.append(f"layer {g} did not run")
            continue
        layer, split = seen[g]
        _, whole = split_call(layer, g, args, kwargs)
        problems += observed_problems(g, whole, split)
    if problems:
        shown = problems if len(problems) <= 4 else [*problems[:4], f"{len(problems) - 4} more"]
        raise SplitError(
            f"the pipeline split of {type(spec.model).__name__} cannot pass its layers "
            f"{spec.blocks!r} what the whole model passes them: {'; '.join(shown)}. The forward "
            "computes these arguments from what earlier layers return, besides the hidden "
            "state, which does not travel between stages. Describe the model with "
            "PipeModel(model, blocks=..., embed=...) (docs/models.md) or train it on one "
            f"device; {TURN_OFF} turns this guard off"
        )


def _path_of(module: nn.Module, target: nn.Module) -> str | None:
    return next((path for path, sub in module.named_modules() if sub is target and path), None)


def find_body(
    module: nn.Module, name: str | None = None, call_of: CallOf | None = None, check: bool = True
) -> BodyRef:
    """Locate the body: the ``name`` given, else ``module.pipeline_body()``'s answer, else the only
    outermost ``nn.Sequential`` attribute of ``module`` that holds parameters. A body already
    replaced by its :class:`StageBody` (by an earlier ``trainer`` call) is found the same way.

    ``call_of(model)``: the arguments the step passes to a model on the first micro-batch (or
    None): a Hugging Face model's structure is then learnt from one forward, and with ``check``
    a model's split (Hugging Face or ``PipeModel``) must compute what the whole model does.
    """
    if name is not None:
        return _resolve(module, name, call_of, check)
    hook = getattr(module, "pipeline_body", None)
    if callable(hook):
        target = hook()
        if isinstance(target, PipeModel):
            where = _path_of(module, target.model)
            if where is None:
                raise ValueError(
                    f"{type(module).__name__}.pipeline_body() returned a PipeModel of a "
                    f"{type(target.model).__name__} that is not a submodule of the module; "
                    "describe the model your step calls (e.g. PipeModel(self.model, ...))"
                )
            parent_path, _, attr = where.rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            call = call_of(target.model) if call_of is not None and check else None
            return _install(parent, attr, where, target, call, check)
        for path, sub in module.named_modules():
            if sub is target and path:
                return _resolve(module, path, call_of, check)
        raise ValueError(
            f"{type(module).__name__}.pipeline_body() must return a submodule (an nn.Sequential "
            f"attribute) of the module; got {type(target).__name__} that is not one of its submodules"
        )
    candidates = [
        path
        for path, sub in module.named_modules()
        if path
        and isinstance(sub, (nn.Sequential, StageBody))
        and any(True for _ in sub.parameters())
    ]
    # keep only the outermost Sequentials (a Sequential inside a block is part of that block)
    top = [p for p in candidates if not any(p.startswith(q + ".") for q in candidates if q != p)]
    known = known_models(module)
    if len(known) == 1 and all(p.startswith(known[0] + ".") for p in top):
        # a Hugging Face model (its Sequentials are inside)
        return _resolve(module, known[0], call_of, check)
    if len(top) == 1:
        return _resolve(module, top[0], call_of, check)
    if not top:
        raise TypeError(
            f"{type(module).__name__} has no nn.Sequential attribute to split into pipeline stages. "
            "pipe2bw's rule: the layers that hold parameters live in one nn.Sequential (the body) that "
            "forward/training_step call once per step. Either build such an attribute, define "
            "`pipeline_body(self) -> nn.Sequential`, or pass Pipe2BWStrategy(body='<attribute name>')"
            + _list_hint(module)
        )
    parents = {p.rpartition(".")[0] for p in top}
    within = ""
    if len(parents) == 1 and isinstance(getattr(module, next(iter(parents)), None), nn.ModuleList):
        within = (
            f" (the items of the nn.ModuleList {next(iter(parents))!r}: make it an nn.Sequential, "
            "and it is the body; or, when a model's forward loops over the list, describe that "
            "model with a PipeModel from `pipeline_body()`, docs/models.md)"
        )
    raise ValueError(
        f"{type(module).__name__} has several nn.Sequential attributes with parameters: {top}; name the "
        f"pipeline body with Pipe2BWStrategy(body=...) or a `pipeline_body()` method{within}"
    )


def _list_hint(module: nn.Module) -> str:
    """For a module whose layers sit in an ``nn.ModuleList``: the rule that takes it as is."""
    lists = [
        path
        for path, sub in module.named_modules()
        if path and isinstance(sub, nn.ModuleList) and any(True for _ in sub.parameters())
    ]
    if not lists:
        return ""
    return (
        f". Its layers are in the nn.ModuleList {lists[0]!r}: when a model's forward loops over "
        "such a list, leave the model as it is and return PipeModel(model, blocks='<the list's "
        "path in the model>', pre=[...], post=[...]) from `pipeline_body()` (docs/models.md)"
    )


@dataclass(frozen=True)
class Partition:
    """Blocks ``[bounds[s], bounds[s+1])`` of the body run on stage ``s``."""

    balance: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    @property
    def num_blocks(self) -> int:
        return sum(self.balance)

    def blocks_of(self, stage: int) -> range:
        start = sum(self.balance[:stage])
        return range(start, start + self.balance[stage])

    def stage_of(self, block: int) -> int:
        """The stage that runs ``block``."""
        return next(s for s in range(self.num_stages) if block in self.blocks_of(s))

    def moves_to(self, other: Partition) -> list[tuple[int, int, int]]:
        """``(block, stage here, stage in other)`` for every block whose stage differs, in
        block order (the same body split two ways)."""
        return [
            (b, self.stage_of(b), s)
            for s in range(other.num_stages)
            for b in other.blocks_of(s)
            if self.stage_of(b) != s
        ]


def make_partition(num_blocks: int, num_stages: int, balance: Sequence[int] | None) -> Partition:
    """Validate ``balance`` (or split evenly when None) for a body of ``num_blocks`` blocks.

    The even split gives any extra blocks to the *last* stages: under 1F1B the first stages stash
    the most activations, so they get the lighter share.
    """
    problems: list[str] = []
    if num_stages > num_blocks:
        raise ValueError(
            f"the body has {num_blocks} blocks but the pipeline has {num_stages} stages; use at most "
            f"{num_blocks} devices/stages or split the body into more blocks"
        )
    if balance is None:
        q, r = divmod(num_blocks, num_stages)
        return Partition(tuple(q + (1 if s >= num_stages - r else 0) for s in range(num_stages)))
    values = list(balance)
    if any(not isinstance(b, int) or isinstance(b, bool) for b in values):
        raise TypeError(f"balance must be a list of ints (block counts per stage), got {values}")
    if len(values) != num_stages:
        problems.append(
            f"balance has {len(values)} entries but the pipeline has {num_stages} stages"
        )
    if sum(values) != num_blocks:
        problems.append(
            f"module has {num_blocks} blocks but balance sums to {sum(values)} (balance={values})"
        )
    if any(b <= 0 for b in values):
        problems.append(
            f"every stage needs at least one block, but balance={values} has {min(values)}"
        )
    if problems:
        raise ValueError("invalid balance: " + "; ".join(problems))
    return Partition(tuple(values))

"""What travels between the stages of a model split by ``PipeModel``: the hidden state and, for
every layer still to run, the arguments the model's forward passes that layer.

A model's layers need not take the same arguments: Gemma 2 passes its sliding-window layers one
attention mask and its full-attention layers another, Gemma 3 and ModernBERT give each kind of
layer its own rotary table, T5 passes the position bias its first layer computes on to the
others, and an encoder-decoder's decoder layers take the encoder's output. The stage that opens a
stack of layers learns what each layer is passed from the model's own forward
(``partition.standin``), once per micro-batch, and packs it here:

- ``shared``: every distinct tensor among the layers' arguments, once (the masks and rotary
  tables most layers share travel once, not once per layer);
- ``calls``: for each layer still to run (by its index over all stacks), its positional and
  keyword arguments with each tensor replaced by a :class:`Ref` to its place in ``shared`` (a
  pytree node without leaves: the message's header stays plain values, see ``runtime.wire``);
- ``fills``: the places in ``shared`` that a layer's output fills when it has run (a value the
  layer returns besides its hidden state that the forward passes to a later layer, or an item
  of one: a :class:`Pending` says which);
- ``last``: the last layer that uses each shared tensor; once it has run, the tensor is dropped
  (``None``) and no later stage receives it (:data:`KEEP`: never, a part's output the last
  stage's replay needs);
- ``blanks``: what each part run by an earlier block returned, for the replays of the model's
  forward on later stages: its structure with each tensor as :class:`Zeros` (its shape and
  dtype), or as a :class:`Ref` where the value itself travels;
- ``outputs``: the output of an earlier stack (by its index) where a later replay needs it (an
  encoder's output, which the decoder's end returns), as a :class:`Ref`;
- ``forms``: what each stack's layers return (0 a tensor, n a tuple of n, hidden state first),
  as the layers that ran found it;
- ``collects``: the keys of the values the model's forward collects from its layers' modules
  (a router's logits), which each layer records; ``recorded``: what the layers that ran
  recorded, by layer (``partition.recorded``), for the replays after them;
- ``rest``: after the last layer of a stack, the rest of its output (besides the hidden state),
  which the forward's code after the stack may read.

A carry is a dict of plain containers, so that the transports, the activation stash and the
hand-over between stages of one rank treat it like any payload; a stage never modifies the carry
it received (its backward and a recomputation read it again), it builds the next one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = [
    "Carry",
    "LayerCall",
    "Pending",
    "Zeros",
    "advance",
    "call_of",
    "fill",
    "pack",
    "resolve",
]

# one layer's call: its positional arguments after the hidden state, its keyword arguments, and
# the keyword that passes the hidden state (None: the first positional argument)
LayerCall = tuple[tuple[Any, ...], dict[str, Any], "str | None"]
Carry = dict[str, Any]
KEEP = -1  # a shared tensor no layer's run drops


class Ref:
    """A tensor, by its place in the carry's ``shared`` tuple."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Ref({self.index})"


class Zeros:
    """A tensor of a part's output by its shape and dtype only: a later stage's replay of the
    model's forward fills it in (zeros) where an earlier stage ran the part."""

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype

    def __repr__(self) -> str:
        return f"Zeros({self.shape}, {self.dtype})"


class Pending:
    """In a captured call: the value layer ``layer`` (by its index over all stacks) returns at
    ``position`` of its output, which the forward passes to a later layer; or an item of it
    (``path``: the keys the forward indexed it with, Swinv2's ``output_dimensions[-2]``)."""

    __slots__ = ("layer", "path", "position")

    def __init__(self, layer: int, position: int, path: tuple[Any, ...] = ()) -> None:
        self.layer, self.position, self.path = layer, position, path

    def __getitem__(self, key: Any) -> Pending:
        if not isinstance(key, (int, str)):
            raise TypeError(
                f"{self!r} is indexed with {key!r}: pipe2bw carries an item of a layer's "
                "output to a later layer by an int or str key only"
            )
        return Pending(self.layer, self.position, (*self.path, key))

    def __iter__(self) -> Any:  # no iteration by __getitem__ over ever larger ints
        raise TypeError(
            f"{self!r} is unpacked: pipe2bw carries a layer's other outputs to later layers "
            "whole or indexed, not unpacked"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pending) and (other.layer, other.position, other.path) == (
            self.layer,
            self.position,
            self.path,
        )

    def __hash__(self) -> int:
        return hash((self.layer, self.position, self.path))

    def __repr__(self) -> str:
        items = "".join(f"[{k!r}]" for k in self.path)
        return f"<output [{self.position}]{items} of layer {self.layer}>"

    def take(self, output: Any) -> Any:
        """This value, from the layer's ``output``."""
        value = output[self.position]
        for key in self.path:
            value = value[key]
        return value


class Size:
    """A ``torch.Size`` among a layer's arguments (a resolution): torch's pytree would rebuild
    it as a plain tuple, so it travels as this node and is a ``torch.Size`` again when read."""

    __slots__ = ("dims",)

    def __init__(self, dims: tuple[int, ...]) -> None:
        self.dims = dims


# pytree nodes without leaves: what they stand for is in the tree's structure, which the
# transports send as a header of plain values (compared, not pickled, while it stays the same)
pytree.register_pytree_node(
    Size,
    lambda z: ([], z.dims),
    lambda _, dims: Size(dims),
    serialized_type_name="lightning_pipe2bw.carry.Size",
)
pytree.register_pytree_node(
    Ref,
    lambda r: ([], r.index),
    lambda _, index: Ref(index),
    serialized_type_name="lightning_pipe2bw.carry.Ref",
)
pytree.register_pytree_node(
    Zeros,
    lambda z: ([], (z.shape, z.dtype)),
    lambda _, meta: Zeros(*meta),
    serialized_type_name="lightning_pipe2bw.carry.Zeros",
)


def _is_ref(x: Any) -> bool:
    return isinstance(x, (Ref, Size))


def resolve(tree: Any, shared: tuple[Any, ...]) -> Any:
    """``tree`` with each :class:`Ref` replaced by its tensor in ``shared`` (and each
    :class:`Size` by a ``torch.Size``)."""

    def read(x: Any) -> Any:
        if isinstance(x, Ref):
            return shared[x.index]
        return torch.Size(x.dims) if isinstance(x, Size) else x

    return pytree.tree_map(read, tree, is_leaf=_is_ref)


def pack(
    hidden: Any,
    calls: Mapping[int, LayerCall],
    parts: Mapping[str, tuple[Any, bool]] | None = None,
    outputs: Mapping[int, Any] | None = None,
    before: Carry | None = None,
    collects: tuple[str, ...] = (),
) -> Carry:
    """The carry of the stage that opens a stack: its first layer's hidden state, the layers'
    ``calls`` (by index over all stacks), what the parts it ran returned (``parts``: path ->
    (output, whether the value itself travels)), the outputs of earlier stacks that travel to
    later replays (``outputs``: stack -> its last layer's output), and what the carry ``before``
    it held for later replays (its blanks, outputs and forms)."""
    shared: list[Tensor | None] = []
    slot: dict[int, int] = {}  # id(tensor) -> its place in shared
    last: list[int] = []
    fills: dict[int, list[tuple[int, tuple[Any, ...], int]]] = {}
    pending: dict[Pending, int] = {}

    def place(t: Any, use: int) -> Ref:
        if isinstance(t, Pending):
            k = pending.get(t)
            if k is None:
                k = pending[t] = len(shared)
                shared.append(None)  # the layer's run fills it
                last.append(use)
                fills.setdefault(t.layer, []).append((t.position, t.path, k))
        else:
            k = slot.get(id(t))
            if k is None:
                k = slot[id(t)] = len(shared)
                shared.append(t)
                last.append(use)
        if last[k] != KEEP:
            last[k] = KEEP if use == KEEP else max(last[k], use)
        return Ref(k)

    def is_value(x: Any) -> bool:
        return isinstance(x, (Tensor, Pending, torch.Size))

    def stored(x: Any, use: int) -> Any:
        if isinstance(x, torch.Size):
            return Size(tuple(x))
        return place(x, use) if is_value(x) else x

    packed = {}
    for j in sorted(calls):
        args, kwargs, key = calls[j]
        a, k = pytree.tree_map(
            lambda x, j=j: stored(x, j), (tuple(args), dict(kwargs)), is_leaf=is_value
        )
        packed[j] = (a, k, key)
    blanks: dict[str, Any] = {}
    if before is not None:  # what earlier blocks' parts returned: kept for later replays
        for path, shape in before["blanks"].items():
            refs = pytree.tree_leaves(shape, is_leaf=_is_ref)
            if not any(isinstance(r, Ref) for r in refs):
                blanks[path] = shape  # shapes only: nothing in shared to keep
                continue
            blanks[path] = pytree.tree_map(
                lambda x: place(before["shared"][x.index], KEEP) if isinstance(x, Ref) else x,
                shape,
                is_leaf=_is_ref,
            )
    for path, (output, carried) in (parts or {}).items():
        blanks[path] = _template(output, (lambda t: place(t, KEEP)) if carried else None)
    kept = dict(resolve(before["outputs"], before["shared"])) if before is not None else {}
    kept.update(outputs or {})
    travelled = {k: _template(v, lambda t: place(t, KEEP)) for k, v in kept.items()}
    return {
        "hidden": hidden,
        "shared": tuple(shared),
        "calls": packed,
        "fills": {j: tuple(f) for j, f in fills.items()},
        "last": tuple(last),
        "blanks": blanks,
        "outputs": travelled,
        "forms": dict(before["forms"]) if before is not None else {},
        "collects": collects,
        "recorded": dict(before.get("recorded", {})) if before is not None else {},
    }


def call_of(carry: Carry, layer: int) -> LayerCall:
    """Layer ``layer``'s arguments, its tensors taken from the carry."""
    calls = carry["calls"]
    if layer not in calls:
        raise RuntimeError(
            f"the carry between pipeline stages has no arguments for layer {layer} (it holds "
            f"those of layers {sorted(calls)}): the stages ran the layers out of order"
        )
    args, kwargs, key = calls[layer]
    a, k = resolve((args, kwargs), carry["shared"])
    return a, k, key


def advance(carry: Carry, layer: int, stack: int, output: Any, final: bool = False) -> Carry:
    """The carry after layer ``layer`` (of ``stack``) returned ``output``: its hidden state, the
    values it returns that later layers take, without its call nor the shared tensors no later
    layer uses (a new carry; ``carry`` is left as it was). The last layer of a stack (``final``)
    also leaves the rest of its output (``rest``), which the forward's own code after the stack
    may read (Cvt's class token) and the next replay hands over with the hidden state."""
    form = len(output) if isinstance(output, (tuple, list)) else 0
    hidden = output[0] if form else output
    shared = list(carry["shared"])
    for position, path, k in carry["fills"].get(layer, ()):
        if position >= form:
            raise RuntimeError(
                f"layer {layer} returned {form or 'a tensor, not a tuple'} values, but the "
                f"forward passed its output [{position}] on to a later layer"
            )
        shared[k] = Pending(layer, position, path).take(output)
    last = carry["last"]
    for k, use in enumerate(last):
        if use == layer:
            shared[k] = None
    calls = {j: c for j, c in carry["calls"].items() if j != layer}
    forms = carry["forms"]
    if forms.get(stack) != form:
        forms = {**forms, stack: form}
    out = {**carry, "hidden": hidden, "shared": tuple(shared), "calls": calls, "forms": forms}
    if final and form:
        out["rest"] = tuple(output[1:])
    return out


def _template(output: Any, value: Any = None) -> Any:
    """What a replay needs of a part's output: its structure, each tensor as :class:`Zeros`
    (``value`` given: as what ``value`` makes of it, a :class:`Ref`), plain values as they are,
    other objects dropped (None)."""

    def meta(x: Any) -> Any:
        if isinstance(x, Tensor):
            return value(x) if value is not None else Zeros(tuple(x.shape), x.dtype)
        if isinstance(x, torch.Size):
            return Size(tuple(x))
        if x is None or isinstance(x, (bool, int, float, str, torch.dtype)):
            return x
        return None

    return pytree.tree_map(meta, output, is_leaf=lambda x: isinstance(x, torch.Size))


def fill(
    shape: Any,
    device: torch.device,
    shared: tuple[Any, ...] = (),
    generator: torch.Generator | None = None,
) -> Any:
    """A part's output from its template in ``blanks``: the values that travel (:class:`Ref`
    into ``shared``), zeros for the others, or with ``generator`` random values (the guard's
    second replay, which must give the same result if the forward does not read them)."""

    def make(z: Any) -> Any:
        if isinstance(z, Ref):
            return shared[z.index]
        if isinstance(z, Size):
            return torch.Size(z.dims)
        if not isinstance(z, Zeros):
            return z  # a plain value, as the part returned it
        if generator is None:
            return torch.zeros(z.shape, dtype=z.dtype, device=device)
        if z.dtype.is_floating_point or z.dtype.is_complex:
            return torch.randn(z.shape, generator=generator, device="cpu").to(device, z.dtype)
        return torch.randint(1, 3, z.shape, generator=generator, device="cpu").to(device, z.dtype)

    return pytree.tree_map(make, shape, is_leaf=lambda x: isinstance(x, (Zeros, Ref, Size)))


def template(output: Any) -> Any:
    """:func:`_template` without values: every tensor as :class:`Zeros`."""
    return _template(output)

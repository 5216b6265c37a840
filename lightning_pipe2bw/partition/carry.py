"""What travels between the stages of a model split by ``PipeModel``: the hidden state and, for
every layer still to run, the arguments the model's forward passes that layer.

A model's layers need not take the same arguments: Gemma 2 passes its sliding-window layers one
attention mask and its full-attention layers another, Gemma 3 and ModernBERT give each kind of
layer its own rotary table. The first stage learns what each layer is passed from the model's own
forward (``partition.standin``), once per micro-batch, and packs it here:

- ``shared``: every distinct tensor among the layers' arguments, once (the masks and rotary
  tables most layers share travel once, not once per layer);
- ``calls``: for each layer still to run, its positional and keyword arguments with each tensor
  replaced by a :class:`Ref` to its place in ``shared`` (a pytree node without leaves: the
  message's header stays plain values, see ``runtime.wire``);
- ``last``: the last layer that uses each shared tensor; once it has run, the tensor is dropped
  (``None``) and no later stage receives it;
- ``blanks``: the shape of what each part of the first stage returned (see
  :class:`Zeros`), which the last stage's replay of the model's forward returns in its place;
- ``form``: what a layer returns, 0 a tensor, n a tuple of n (hidden state first), -1 not yet
  known: the replay's stand-ins return that form.

A carry is a dict of plain containers, so that the transports, the activation stash and the
hand-over between stages of one rank treat it like any payload; a stage never modifies the carry
it received (its backward and a recomputation read it again), it builds the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["Carry", "LayerCall", "Ref", "Zeros", "advance", "call_of", "fill", "pack", "template"]

# one layer's call: its positional arguments after the hidden state, its keyword arguments, and
# the keyword that passes the hidden state (None: the first positional argument)
LayerCall = tuple[tuple[Any, ...], dict[str, Any], "str | None"]
Carry = dict[str, Any]


class Ref:
    """A tensor of a layer's arguments, by its place in the carry's ``shared`` tuple."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Ref({self.index})"


class Zeros:
    """A tensor of a part's output by its shape and dtype only: the last stage's replay of the
    model's forward fills it in (zeros) where the first stage ran the part."""

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype

    def __repr__(self) -> str:
        return f"Zeros({self.shape}, {self.dtype})"


# pytree nodes without leaves: what they stand for is in the tree's structure, which the
# transports send as a header of plain values (compared, not pickled, while it stays the same)
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
    return isinstance(x, Ref)


def pack(
    hidden: Any,
    calls: Sequence[LayerCall],
    blanks: dict[str, Any] | None = None,
    form: int = -1,
) -> Carry:
    """The carry of the first stage: the first layer's hidden state and every layer's call
    (``calls[j]`` for layer j), each distinct tensor once."""
    shared: list[Tensor] = []
    slot: dict[int, int] = {}  # id(tensor) -> its place in shared
    last: list[int] = []

    def ref_at(layer: int) -> Any:
        def ref(t: Tensor) -> Ref:
            k = slot.get(id(t))
            if k is None:
                k = slot[id(t)] = len(shared)
                shared.append(t)
                last.append(layer)
            last[k] = layer
            return Ref(k)

        return ref

    packed = {}
    for j, (args, kwargs, key) in enumerate(calls):
        a, k = pytree.tree_map_only(Tensor, ref_at(j), (tuple(args), dict(kwargs)))
        packed[j] = (a, k, key)
    return {
        "hidden": hidden,
        "shared": tuple(shared),
        "calls": packed,
        "last": tuple(last),
        "blanks": blanks or {},
        "form": form,
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
    shared = carry["shared"]
    a, k = pytree.tree_map(
        lambda x: shared[x.index] if isinstance(x, Ref) else x, (args, kwargs), is_leaf=_is_ref
    )
    return a, k, key


def advance(carry: Carry, layer: int, hidden: Any, form: int) -> Carry:
    """The carry after layer ``layer`` ran: its output ``hidden``, without that layer's call nor
    the shared tensors no later layer uses (a new carry; ``carry`` is left as it was)."""
    shared = carry["shared"]
    last = carry["last"]
    if any(k == layer for k in last):
        shared = tuple(None if last[k] == layer else t for k, t in enumerate(shared))
    calls = {j: c for j, c in carry["calls"].items() if j != layer}
    return {**carry, "hidden": hidden, "shared": shared, "calls": calls, "form": form}


def template(output: Any) -> Any:
    """What the replay needs of a part's output: its structure, each tensor as :class:`Zeros`
    (its shape and dtype), plain values as they are, other objects dropped (None)."""

    def meta(x: Any) -> Any:
        if isinstance(x, Tensor):
            return Zeros(tuple(x.shape), x.dtype)
        if x is None or isinstance(x, (bool, int, float, str, torch.dtype)):
            return x
        return None

    return pytree.tree_map(meta, output)


def fill(shape: Any, device: torch.device, generator: torch.Generator | None = None) -> Any:
    """A part's output from its :func:`template`: zeros, or with ``generator`` random values
    (the guard's second replay, which must give the same result if the end of the forward does
    not read the part's output)."""

    def make(z: Any) -> Any:
        if not isinstance(z, Zeros):
            return z  # a plain value, as the part returned it
        if generator is None:
            return torch.zeros(z.shape, dtype=z.dtype, device=device)
        if z.dtype.is_floating_point or z.dtype.is_complex:
            return torch.randn(z.shape, generator=generator, device="cpu").to(device, z.dtype)
        return torch.randint(1, 3, z.shape, generator=generator, device="cpu").to(device, z.dtype)

    return pytree.tree_map(make, shape, is_leaf=lambda x: isinstance(x, Zeros))

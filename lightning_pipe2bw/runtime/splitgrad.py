"""A backward in two passes that together do the work of one: the gradients of a stage's inputs
first, the gradients of its weights later.

A pipeline stage's predecessor waits for the gradient of its inputs only; the weights'
gradients are this stage's own business and may come later (zero-bubble pipelining's "B" and
"W"). Autograd computes both in one pass. :class:`SplitBackward` cuts the pass in two, with
public autograd calls only:

- The graph under the roots is read once. A node is *on the input path* when some stage input
  is reachable from it; every other node belongs to the weights' pass. A node on the path with
  edges into the weights' pass (a linear layer's node: to its bias and to its weight) *owns*
  the weights' nodes it reaches, and the weights among them.
- :meth:`SplitBackward.inputs_pass` differentiates the roots with respect to the inputs alone
  (``torch.autograd.grad``). Autograd asks each node only for the outputs the call needs, so a
  linear layer computes the gradient of its input and not of its weight. A pre-hook on each
  owning node keeps the gradient that flowed into it. Nothing is accumulated into ``.grad``.
- :meth:`SplitBackward.weights_pass` runs each owning node again with the gradient it received
  (``torch.autograd.backward`` from its ``GradientEdge``s, with ``inputs=`` its weights: the
  node is asked only for its outputs toward them, the weight's matrix product this time), and
  autograd accumulates into ``.grad`` as one backward does (layout, parameter hooks).

Each output of each node is computed once, by the same function on the same tensors with the
same incoming gradient, and each weight's gradient comes from one owner, so the gradients are
bitwise those of one backward. :meth:`SplitBackward.plan` refuses (returns None) where that
could not be shown:

- a weights' node that two owners reach (a weight applied twice in a row, such as a layer
  applied to its own output): one owner's share cannot be computed apart, and its call would
  run the other owner's part of the input path again;
- a weights' node input gathering three or more gradients: one backward adds them as they
  arrive, and two additions commute exactly where three need not;
- a root without a graph, or inputs the roots do not reach.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

__all__ = ["SplitBackward"]


class SplitBackward:
    """One backward of ``roots`` cut into the inputs' pass and the weights' pass (see the module
    notes). Build it with :meth:`plan`; call :meth:`inputs_pass` once, then :meth:`weights_pass`
    once."""

    def __init__(
        self,
        roots: list[Tensor],
        seeds: list[Tensor | None],
        inputs: list[Tensor],
        regions: dict[Any, list[Tensor]],
        weight_roots: list[int],
        weight_roots_leaves: list[Tensor],
    ) -> None:
        self._roots, self._seeds, self._inputs = roots, seeds, inputs
        # input-path node with cuts: the leaves (weights) its weight-pass region accumulates
        self._regions = regions
        # the roots from which no input is reachable, and the leaves they reach
        self._weight_roots, self._weight_roots_leaves = weight_roots, weight_roots_leaves
        self._captured: dict[Any, tuple[Tensor | None, ...]] | None = None

    @classmethod
    def plan(
        cls, roots: Sequence[Tensor], seeds: Sequence[Tensor | None], inputs: Sequence[Tensor]
    ) -> SplitBackward | None:
        """The split of the backward of ``roots`` (seeded with ``seeds``, None for a scalar's
        implicit 1) for ``inputs`` (leaves that require grad), or None where it cannot be exact
        (see the module notes)."""
        if not roots or not inputs or any(r.grad_fn is None for r in roots):
            return None
        # every node under the roots, its edges, and who points at it
        nodes: dict[Any, list[tuple[Any, int]]] = {}
        parents: dict[Any, list[Any]] = {}
        todo: list[Any] = [r.grad_fn for r in roots]
        while todo:
            node = todo.pop()
            if node in nodes:
                continue
            edges = [(nxt, nr) for nxt, nr in node.next_functions if nxt is not None]
            nodes[node] = edges
            for nxt, _ in edges:
                parents.setdefault(nxt, []).append(node)
                if nxt not in nodes:
                    todo.append(nxt)
        # the input path: nodes from which an input's accumulator is reachable
        wanted = {id(x) for x in inputs}
        on_path = {n for n in nodes if id(_leaf_of(n)) in wanted}
        if not on_path:
            return None
        todo = list(on_path)
        while todo:
            for parent in parents.get(todo.pop(), ()):
                if parent not in on_path:
                    on_path.add(parent)
                    todo.append(parent)
        # each start of the weight pass (an input-path node with cuts, or a root off the path)
        # owns the weight-pass nodes it reaches; a node two starts reach is refused
        owner: dict[Any, Any] = {}
        starts = [n for n in nodes if n in on_path] + [
            r.grad_fn for r in roots if r.grad_fn not in on_path
        ]
        leaves: dict[Any, list[Tensor]] = {}
        for start in starts:
            if start in leaves:
                continue
            todo = [nxt for nxt, _ in nodes[start] if nxt not in on_path]
            if start not in on_path:
                todo.append(start)
            if not todo:
                continue
            mine: list[Tensor] = []
            while todo:
                node = todo.pop()
                if node in owner:
                    if owner[node] is start:
                        continue
                    return None  # reached from two starts: their shares add up in one buffer
                owner[node] = start
                leaf = _leaf_of(node)
                if leaf is not None:
                    mine.append(leaf)
                todo.extend(nxt for nxt, _ in nodes[node])
            leaves[start] = mine
        # a weight-pass node input gathering three or more gradients: refused (order of sums)
        feeds = Counter((r.grad_fn, r.output_nr) for r in roots)
        feeds.update(
            (nxt, nr) for edges in nodes.values() for nxt, nr in edges if nxt not in on_path
        )
        if any(n >= 3 for (node, _), n in feeds.items() if node not in on_path):
            return None
        regions = {n: leaves[n] for n in leaves if n in on_path and leaves[n]}
        weight_roots = [k for k, r in enumerate(roots) if r.grad_fn not in on_path]
        off_path = {roots[k].grad_fn: leaves.get(roots[k].grad_fn, []) for k in weight_roots}
        reached = [leaf for found in off_path.values() for leaf in found]
        return cls(list(roots), list(seeds), list(inputs), regions, weight_roots, reached)

    def inputs_pass(self) -> list[Tensor | None]:
        """The gradients of the inputs (None for an input the roots do not reach); the graph is
        kept for :meth:`weights_pass`."""
        on_path = [k for k in range(len(self._roots)) if k not in self._weight_roots]
        captured: dict[Any, tuple[Tensor | None, ...]] = {}

        def capture(node: Any) -> Any:
            def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
                captured[node] = grad_outputs

            return node.register_prehook(hook)

        handles = [capture(node) for node in self._regions]
        try:
            grads = torch.autograd.grad(
                [self._roots[k] for k in on_path],
                self._inputs,
                [self._seeds[k] for k in on_path],
                retain_graph=True,
                allow_unused=True,
            )
        finally:
            for handle in handles:
                handle.remove()
        self._captured = captured
        return list(grads)

    @property
    def kept_bytes(self) -> int:
        """The bytes the inputs' pass keeps for the weights' pass (the gradients flowing into
        the weights' nodes, each storage once); 0 before the inputs' pass or after the
        weights'."""
        storages = {
            g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
            for grads in (self._captured or {}).values()
            for g in grads
            if g is not None
        }
        return sum(storages.values())

    def weights_pass(self) -> None:
        """Accumulate the weights' gradients into their ``.grad`` (after :meth:`inputs_pass`);
        the weights' part of the graph is freed (the rest goes with the graph)."""
        if self._captured is None:
            raise RuntimeError("SplitBackward.weights_pass runs after inputs_pass")
        captured, self._captured = self._captured, None
        for node, weights in self._regions.items():
            received = captured.pop(node, None)
            if received is None:
                continue  # the input pass did not reach it: no gradient flows past it
            outs = [(GradientEdge(node, k), g) for k, g in enumerate(received) if g is not None]
            if outs:
                # the node again, now computing only its outputs into its region (autograd
                # asks a node only for the outputs the call needs: here, toward ``weights``),
                # then the region, accumulating as one backward does
                edges, grads = [e for e, _ in outs], [g for _, g in outs]
                del outs, received
                torch.autograd.backward(edges, grads, inputs=weights)
        if self._weight_roots_leaves:  # in one call, so that roots on one node add up as in one
            torch.autograd.backward(
                [self._roots[k] for k in self._weight_roots],
                [self._seeds[k] for k in self._weight_roots],
                inputs=self._weight_roots_leaves,
            )
        # drop every reference into the graph: a node kept by this object keeps the graph's
        # accumulators, so the stage's weights and gradients, alive after the step
        self._roots, self._seeds, self._inputs = [], [], []
        self._regions, self._weight_roots, self._weight_roots_leaves = {}, [], []


def _leaf_of(node: Any) -> Tensor | None:
    """The leaf tensor a gradient accumulator node writes to (None for other nodes)."""
    return getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None

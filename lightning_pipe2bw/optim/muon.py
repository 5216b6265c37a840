"""Muon on the hidden matrices and AdamW on the rest, as one optimizer.

``torch.optim.Muon`` orthogonalises the momentum of 2-D weights and refuses every other
parameter; embeddings, norms, biases and the output head are trained with AdamW in the recipes
that use it. Lightning's automatic optimization steps one optimizer, a pipeline stage checkpoints
one state per optimizer, and a sharded checkpoint reloads it by parameter name on another
partition. :class:`MuonAdamW` is one ``torch.optim.Optimizer`` whose param groups are either
Muon's or AdamW's (``group["muon"]``), whose state is one dict in torch's format, and whose step
runs ``torch.optim.Muon`` and ``torch.optim.AdamW`` on their groups: the arithmetic is theirs,
bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["MuonAdamW", "hidden_matrix"]

# modules whose weight is an output head by name (the usual names in torch and Hugging Face)
_HEAD = re.compile(r"(^|\.)(lm_head|head|heads|classifier|score|output|embed_out|decoder)$")


def hidden_matrix(name: str, param: Tensor, module: nn.Module) -> bool:
    """The default rule for Muon: the weight matrix of an ``nn.Linear`` that is not an output
    head by its module's name (``lm_head``, ``head``, ``classifier``, ``score``, ``output``,
    ``embed_out``, ``decoder``). Embeddings, norms, biases and the head stay with AdamW, as in
    Muon's recipes. A head named otherwise needs a rule of its own (``muon_params``): the rule
    sees one stage's modules at a time, so it cannot tell the model's last layer by position.
    ``name`` is the parameter's qualified name, ``module`` the module that holds it."""
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    return (
        isinstance(module, nn.Linear)
        and param is module.weight
        and param.ndim == 2
        and not _HEAD.search(owner)
    )


def _defaults(cls: type[Optimizer], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every hyper-parameter an optimizer class keeps per group, with ``kwargs`` applied."""
    probe = nn.Parameter(torch.zeros(2, 2))
    return dict(cls([probe], **kwargs).defaults)


class MuonAdamW(Optimizer):
    """``torch.optim.Muon`` on the hidden matrices, ``torch.optim.AdamW`` on everything else, as
    one optimizer (for Lightning's ``configure_optimizers``).

    Build it from a module, which picks Muon's parameters with ``muon_params`` (default
    :func:`hidden_matrix`)::

        def configure_optimizers(self):
            return MuonAdamW.for_module(self, lr=2e-3, weight_decay=0.1)

    Under a pipeline strategy the module holds only its stage's blocks, so every stage builds
    its own share. Or give param groups, each with ``"muon": True`` or ``False`` (Muon's groups
    must hold 2-D tensors only); a group's other keys override the defaults of its kind.

    Args:
        params: param groups with a ``"muon"`` key.
        lr: Muon's learning rate, and AdamW's unless ``adamw_lr`` is given (a group may set its
            own).
        adamw_lr: AdamW's learning rate (embeddings, norms, biases, head), if not ``lr``. Muon's
            best rate is several times AdamW's, and with one rate the AdamW part runs at Muon's
            (8x AdamW's best on the recipes' GPT: ``docs/pipedream-2bw.md``). Schedulers scale
            each group's own rate (``LambdaLR``'s ``initial_lr`` is per group), or take one
            function per group.
        weight_decay: decoupled weight decay of both kinds; ``for_module`` gives 1-D tensors
            (biases, norms) none.
        momentum, nesterov, ns_steps, adjust_lr_fn: Muon's (``adjust_lr_fn="match_rms_adamw"``,
            the default here, scales Muon's step to AdamW's RMS so that one learning rate serves
            both kinds, as in "Muon is Scalable for LLM Training").
        betas, eps: AdamW's.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        adamw_lr: float | None = None,
    ) -> None:
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(
                f"MuonAdamW runs torch.optim.Muon, which torch 2.9 added; this is torch "
                f"{torch.__version__}. Install torch 2.9 or newer (pip install 'torch>=2.9'), or "
                "train with another optimizer (the main job: model.optimizer=adamw)"
            )
        for name, value in (("lr", lr), ("adamw_lr", adamw_lr)):
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"MuonAdamW: {name}={value!r} must be a number >= 0")
        muon_defaults = _defaults(
            torch.optim.Muon,
            dict(
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
            ),
        )
        adamw_defaults = _defaults(
            torch.optim.AdamW,
            dict(
                lr=lr if adamw_lr is None else adamw_lr,
                weight_decay=weight_decay,
                betas=betas,
                eps=eps,
            ),
        )
        groups = []
        for group in params:
            if not isinstance(group, dict) or "muon" not in group:
                raise TypeError(
                    "MuonAdamW takes param groups with a 'muon' key (True: Muon, False: AdamW); "
                    "build it from a module with MuonAdamW.for_module(module, ...)"
                )
            base = muon_defaults if group["muon"] else adamw_defaults
            groups.append({**base, **group})
        self._kinds = {"muon": muon_defaults, "adamw": adamw_defaults}
        self.muon_names: list[str] = []  # for_module: the parameters Muon trains, by name
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        for group in self.param_groups:
            if group["muon"]:
                bad = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
                if bad:
                    raise ValueError(
                        f"Muon takes 2-D parameters only; a Muon group holds tensors of shape "
                        f"{bad[:3]}: put them in a group with 'muon': False (AdamW)"
                    )
        self._link()

    @classmethod
    def for_module(
        cls,
        module: nn.Module,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        muon_params: Callable[[str, Tensor, nn.Module], bool] = hidden_matrix,
        **kwargs: Any,
    ) -> MuonAdamW:
        """Muon on the parameters of ``module`` that ``muon_params(name, param, owner)`` picks,
        AdamW on the others: with ``weight_decay`` on tensors of two or more dimensions, none on
        biases and norms. A parameter shared by several modules (tied weights) goes with Muon
        only if every module that holds it is picked."""
        picked: dict[int, bool] = {}
        order: list[Tensor] = []
        for owner_name, owner in module.named_modules():
            for name, param in owner.named_parameters(recurse=False):
                if not param.requires_grad:
                    continue
                full = f"{owner_name}.{name}" if owner_name else name
                choice = muon_params(full, param, owner)
                if id(param) not in picked:
                    order.append(param)
                    picked[id(param)] = choice
                else:
                    picked[id(param)] = picked[id(param)] and choice
        muon = [p for p in order if picked[id(p)]]
        decay = [p for p in order if not picked[id(p)] and p.ndim >= 2]
        no_decay = [p for p in order if not picked[id(p)] and p.ndim < 2]
        groups = [
            {"params": muon, "muon": True},
            {"params": decay, "muon": False},
            {"params": no_decay, "muon": False, "weight_decay": 0.0},
        ]
        optimizer = cls(
            [g for g in groups if g["params"]], lr=lr, weight_decay=weight_decay, **kwargs
        )
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        optimizer.muon_names = [names[id(p)] for p in muon]
        return optimizer

    def _link(self) -> None:
        """The two inner optimizers read this one's groups and state (the same objects)."""
        inner: dict[bool, Optimizer] = {}
        for muon, cls in ((True, torch.optim.Muon), (False, torch.optim.AdamW)):
            groups = [g for g in self.param_groups if bool(g["muon"]) is muon]
            if not groups:
                continue
            kind = self._kinds["muon" if muon else "adamw"]
            optimizer = cls([nn.Parameter(torch.zeros(2, 2))], **_ctor_args(cls, kind))
            optimizer.param_groups = groups
            optimizer.state = self.state
            inner[muon] = optimizer
        self._inner = inner

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self._inner.values():
            optimizer.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()  # loading replaced the groups and the state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "muon" not in param_group:
            raise TypeError("a MuonAdamW param group needs a 'muon' key (True: Muon, False: AdamW)")
        if hasattr(self, "_kinds"):
            base = self._kinds["muon" if param_group["muon"] else "adamw"]
            param_group = {**base, **param_group}
        super().add_param_group(param_group)
        if hasattr(self, "_inner"):
            self._link()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_kinds" in self.__dict__:
            self._link()


def _ctor_args(cls: type[Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The constructor keywords among an optimizer's group defaults."""
    import inspect

    accepted = set(inspect.signature(cls.__init__).parameters)
    return {k: v for k, v in defaults.items() if k in accepted}

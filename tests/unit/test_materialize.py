"""A body built in ``configure_model`` (on the meta device) is never left uninitialised.

Each rank allocates its own blocks, fills their floating tensors with NaN and initialises block
``i`` under seed ``initial_seed + i`` with the LightningModule's ``pipeline_init`` (called like
``nn.Module.apply``), else the body's model's ``_init_weights`` (Hugging Face's order: children
before parents), else ``reset_parameters()``. A tensor that none of them wrote raises
``UninitializedError`` naming it.

"The same model initialised on one device with the same init", the reference here, is: each
block ``i`` built on the CPU, then, under ``torch.manual_seed(base + i)``, the initialiser
applied to every submodule of the block in the order above. The materialised blocks must equal
it bitwise.

These tests call ``build_stage`` for each stage in turn (it needs no process group). Fits
through the 2-rank pool, one of which also trains both models and compares the weights:
``tests/ranks/test_materialize.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import workers
from torch import Tensor, nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2PreTrainedModel

from lightning_pipe2bw.partition import build_stage, find_body
from lightning_pipe2bw.partition.build import UninitializedError

CPU = torch.device("cpu")
SEED = 7


class Holder(nn.Module):
    """A LightningModule stand-in whose body is built on the meta device."""

    def __init__(self, make: Callable[[], nn.Module], attr: str = "body") -> None:
        super().__init__()
        with torch.device("meta"):
            setattr(self, attr, make())


def materialise(
    make: Callable[[], nn.Module],
    num_stages: int = 1,
    body: str = "body",
    init: Callable[[nn.Module], None] | None = None,
) -> dict[str, Tensor]:
    """Every stage's materialised state, built stage by stage under seed ``SEED``."""
    state: dict[str, Tensor] = {}
    for stage in range(num_stages):
        torch.manual_seed(SEED)
        holder = Holder(make, body.split(".")[0])
        build_stage(holder, find_body(holder, body), stage, num_stages, None, CPU, init=init)
        state.update(holder.state_dict())
    return state


def post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from post_order(child)
    yield module


def reference(
    body: nn.Sequential, fn: Callable[[nn.Module], None], order: str, prefix: str = "body."
) -> dict[str, Tensor]:
    """``body`` (built on the CPU) with block i initialised by ``fn`` under seed SEED + i."""
    for i, block in enumerate(body):
        torch.manual_seed(SEED + i)
        with torch.no_grad():
            for sub in post_order(block) if order == "post" else block.modules():
                fn(sub)
    return {prefix + k: v for k, v in body.state_dict().items()}


def assert_same(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def reset(module: nn.Module) -> None:
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()  # type: ignore[operator]


# ----------------------------------------------------------------------------- one process


def test_a_block_without_reset_parameters_raises_naming_its_parameters() -> None:
    with pytest.raises(UninitializedError) as info:
        materialise(workers.conv_body)
    message = str(info.value)
    for i in (1, 2):
        assert (
            f"body.{i}.proj.weight (parameter of Conv1D) holds NaN (never written): Conv1D has "
            "no reset_parameters()"
        ) in message
        assert f"body.{i}.proj.bias (parameter of Conv1D)" in message
    assert message.startswith("4 tensors built on the meta device (in configure_model)")
    assert "define reset_parameters() on that module" in message
    assert "define pipeline_init(self, module) on the LightningModule" in message
    assert "build the body in __init__" in message
    assert "A buffer computed in __init__" not in message  # said for buffers only
    assert [u.name for u in info.value.entries] == [
        "body.1.proj.weight",
        "body.1.proj.bias",
        "body.2.proj.weight",
        "body.2.proj.bias",
    ]


def test_pipeline_init_initialises_each_block_under_its_seed() -> None:
    for stages in (1, 2, 4):
        state = materialise(workers.conv_body, num_stages=stages, init=workers.conv_init)
        assert all(bool(torch.isfinite(v).all()) for v in state.values())
        assert_same(state, reference(workers.conv_body(), workers.conv_init, "post"))


def test_reset_parameters_is_unchanged() -> None:
    """Without an initialiser, block i is reset_parameters() of its modules in modules()
    order under seed SEED + i, as before pipeline_init existed (bitwise)."""

    def make() -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(4, 8), nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)), nn.Linear(8, 2)
        )

    for stages in (1, 3):
        assert_same(materialise(make, num_stages=stages), reference(make(), reset, "pre"))


def test_a_lightning_style_init_weights_that_takes_no_module_is_not_called() -> None:
    """The GPT recipe's ``_init_weights(self, n_layer: int)`` is not a per-module
    initialiser: reset_parameters() runs instead."""

    class Recipe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

        def _init_weights(self, n_layer: int) -> None:
            raise AssertionError("called with a module")

    torch.manual_seed(SEED)
    holder = Recipe()
    build_stage(holder, find_body(holder), 0, 1, None, CPU)
    body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert_same(holder.state_dict(), reference(body, reset, "pre"))


def test_a_block_built_on_a_real_device_keeps_its_values() -> None:
    def make() -> nn.Sequential:
        real = nn.Linear(4, 4, device="cpu")
        with torch.no_grad():
            real.weight.fill_(3.0)
        return nn.Sequential(nn.Linear(4, 4), real)

    state = materialise(make)
    assert bool((state["body.1.weight"] == 3.0).all())


# ----------------------------------------------------------------------------- Hugging Face

CONFIG = GPT2Config(
    n_embd=16, n_head=2, n_layer=3, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0
)


class Trunk(GPT2PreTrainedModel):
    """An HF model whose blocks are the pipeline body (``model.h``)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__(config)
        self.h = nn.Sequential(*[GPT2Block(config, layer_idx=i) for i in range(config.n_layer)])
        self.post_init()


def test_the_body_of_an_hf_model_is_initialised_by_its_init_weights() -> None:
    """GPT-2's ``_init_weights``: N(0, 0.02) for Conv1D, then the residual projections
    re-drawn with std 0.02 / sqrt(2 n_layer) when their parent (attention, MLP) is visited,
    so children go first; Conv1D has no reset_parameters, so nothing else could do it."""
    for stages in (1, 3):
        state = materialise(lambda: Trunk(CONFIG), num_stages=stages, body="model.h")
        ref_model = Trunk(CONFIG)
        expected = reference(ref_model.h, ref_model._init_weights, "post", prefix="model.h.")
        assert_same(state, expected)
    proj = torch.cat([state[f"model.h.{i}.attn.c_proj.weight"].flatten() for i in range(3)])
    attn = torch.cat([state[f"model.h.{i}.attn.c_attn.weight"].flatten() for i in range(3)])
    assert float(proj.std()) < 0.6 * float(attn.std())  # scaled by 1 / sqrt(6) after N(0, 0.02)


def test_pipeline_init_comes_before_the_models_init_weights() -> None:
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        ref_model._init_weights(module)

    ref_model = Trunk(CONFIG)
    materialise(lambda: Trunk(CONFIG), body="model.h", init=init)
    # every submodule of every block, children before parents (nn.Module.apply's order)
    assert calls.count("GPT2Block") == 3
    assert calls.count("Conv1D") == 12
    first = calls.index
    assert first("LayerNorm") < first("Conv1D") < first("GPT2Attention") < first("GPT2Block")
    assert calls[-1] == "GPT2Block"


# ----------------------------------------------------------------------------- buffers


class Masked(nn.Module):
    """Causal attention weights over 4 positions, with its mask computed in ``__init__``."""

    def __init__(self, dtype: torch.dtype = torch.float32, recompute: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.recompute = recompute
        self.register_buffer("mask", self._mask(dtype), persistent=False)

    @staticmethod
    def _mask(dtype: torch.dtype) -> Tensor:
        if dtype == torch.bool:
            return torch.ones(4, 4, dtype=torch.bool).tril()
        return torch.full((4, 4), float("-inf")).triu(1)

    def reset_parameters(self) -> None:
        if self.recompute:
            self.mask.copy_(self._mask(self.mask.dtype))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_a_non_persistent_buffer_lost_on_meta_is_reported_as_a_buffer(dtype: torch.dtype) -> None:
    with pytest.raises(UninitializedError) as info:
        materialise(lambda: nn.Sequential(nn.Linear(4, 4), Masked(dtype)))
    message = str(info.value)
    held = "holds NaN (never written)" if dtype == torch.float32 else "was never written"
    assert (
        f"body.1.mask (non-persistent buffer of Masked) {held}: Masked.reset_parameters() left "
        "it unset"
    ) in message
    assert "A buffer computed in __init__ (a causal mask, a position table) is lost" in message
    assert message.startswith("1 tensor built on the meta device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_a_buffer_recomputed_by_reset_parameters_passes(dtype: torch.dtype) -> None:
    """A -inf mask is a legitimate buffer value; only parameters must be finite."""
    holder = Holder(lambda: nn.Sequential(Masked(dtype, recompute=True)))
    build_stage(holder, find_body(holder), 0, 1, None, CPU)
    assert torch.equal(holder.get_buffer("body.0.mask"), Masked._mask(dtype))


def test_a_buffer_outside_the_body_is_checked() -> None:
    holder = Holder(lambda: nn.Sequential(nn.Linear(4, 4)))
    with torch.device("meta"):
        holder.register_buffer("scale", torch.ones(()), persistent=False)
    with pytest.raises(UninitializedError) as info:
        build_stage(holder, find_body(holder), 0, 1, None, CPU)
    assert "scale (non-persistent buffer of Holder) holds NaN (never written): Holder has no " in (
        str(info.value)
    )


# ----------------------------------------------------------------------------- real ranks

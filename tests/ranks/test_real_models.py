"""Third-party models trained as they come (Hugging Face GPT-2, Llama, ViT): the module holds the
model, its step calls it; the strategy finds the layer list, splits it, carries what the layers
take between stages (hidden state, mask, position ids, rotary cos/sin), and keeps tied weights
(GPT-2's embedding and head) as one copy per stage, summed gradients and one saved name.

Tolerance: max abs difference <= 1e-5 after 5 AdamW steps against the whole model on one device
(1f1b: gradient accumulation over the same micro-batches; 2bw: the delayed-update rule)."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import torch.distributed as dist
from helpers import hf_models, hf_zoo
from helpers.models import (
    RegressionModel,
    TiedModel,
    loader,
    max_abs_diff,
    quiet_trainer,
    reference_2bw,
    reference_train,
)
from torch import Tensor, nn

from lightning_pipe2bw import Pipe2BWStrategy, PipeModel
from lightning_pipe2bw.schedule import REGISTRY

STEPS, M = 5, 4
TOL = 1e-5


def _fit(family: str, schedule: str, **kwargs: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hf_models.HFModule(family)
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=M, **kwargs)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS)
    trainer.fit(module, hf_models.loader(family, STEPS))
    whole = {f"model.{k}": v.detach().clone() for k, v in module.model.state_dict().items()}
    state = strategy.full_state_dict()  # collective
    return {
        "state": state if dist.get_rank() == 0 else None,
        "whole": whole,
        "type": type(module.model).__name__,
        "blocks": list(strategy.engine.body.indices) if strategy.engine else [],
        "split": strategy.split.rule if strategy.split else "",
    }


# families the intake learns from one observed forward: OPT (final norm registered before the
# layers), BERT and DistilBERT classifiers (pooler; pre_classifier on the first token), masked
# language models (BERT, RoBERTa): each trains exactly with zero lines
LEARNT = [
    *[(f, "1f1b") for f in ("opt", "bert_cls", "bert_mlm", "distilbert_cls", "roberta_mlm")],
    *[(f, "2bw") for f in ("opt", "distilbert_cls")],
]


@pytest.mark.parametrize(
    ("family", "schedule"),
    [
        (f, s)
        for f in ("gpt2", "gpt2_untied", "llama", "llama_masked", "vit")
        for s in ("1f1b", "2bw")
    ]
    + LEARNT
    # decoder layers the user compiled (torch.compile, aot_eager): zb-h1 runs their backwards
    # whole (a compiled backward is not cut), 2bw's delayed rule as on one device
    + [("gpt2_compiled", "1f1b"), ("gpt2_compiled", "zb-h1"), ("llama_compiled", "2bw")],
)
def test_hf_model_as_it_comes(pools: Any, family: str, schedule: str) -> None:
    results = pools(2).run(_fit, family, schedule)
    ref = hf_models.reference(family, STEPS, M, delayed=schedule == "2bw")
    state = results[0]["state"]
    diff = max_abs_diff(state, ref)
    worst = max(state, key=lambda k: (state[k].double() - ref[k].double()).abs().max().item())
    print(
        f"{family} {schedule}: max|dW| vs one device {diff:.3e} (at {worst}); "
        f"blocks {[r['blocks'] for r in results]}"
    )
    assert diff <= TOL
    if family.endswith("_compiled"):  # the user's keys, as the one-device model has them
        assert any("._orig_mod." in key for key in state), sorted(state)[:5]
    for r in results:  # after fit: the Hugging Face model again, whole, on every rank
        assert r["type"] == type(hf_models.FAMILIES[family]()).__name__
        assert max_abs_diff(r["whole"], ref) <= TOL
        # split by the FLOPs counted on the step's call the intake learnt the model from
        assert r["split"] == "forward FLOPs on the first micro-batch", r["split"]


# ---------------------------------------------------------------------- a tie in a plain body
def _fit_tied(schedule: str, clip: float | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = TiedModel()
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=M)
    extra = {"gradient_clip_val": clip} if clip is not None else {}
    world = dist.get_world_size()
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=STEPS, **extra)
    trainer.fit(module, loader(8))
    state = strategy.full_state_dict()
    return {
        "state": state if dist.get_rank() == 0 else None,
        "tied_again": module.body[6].weight is module.body[1].weight,
    }


@pytest.mark.parametrize(
    ("schedule", "clip"), [("1f1b", None), ("1f1b", 0.05), ("gpipe", None), ("2bw", None)]
)
def test_a_weight_tied_across_stages(pools: Any, schedule: str, clip: float | None) -> None:
    """Each stage trains a copy; the copies' gradients are summed before every update (and
    counted once by clipping), so the copies stay equal and equal one device with the tie."""
    results = pools(2).run(_fit_tied, schedule, clip)
    state = results[0]["state"]
    norm = ("norm", clip) if clip is not None else None
    if schedule == "2bw":
        ref = reference_2bw(STEPS, M, clip=norm, model_name="tied")
    else:
        ref = reference_train(STEPS, M, clip=norm, model_name="tied")[0]
    diff = max_abs_diff(state, ref)
    print(f"tie {schedule} clip={clip}: max|dW| vs one device {diff:.3e}")
    assert diff <= TOL
    assert torch.equal(state["body.1.weight"], state["body.6.weight"])
    assert all(r["tied_again"] for r in results)  # one parameter again after fit


def test_a_weight_tied_within_one_stage_takes_its_version(pools: Any) -> None:
    """One stage holding both uses: under 2BW both run on the micro-batch's weight version
    (the version names the shared parameter once), exact against the delayed rule."""
    state = pools(1).run(_fit_tied, "2bw", None)[0]["state"]
    diff = max_abs_diff(state, reference_2bw(STEPS, M, model_name="tied"))
    print(f"tie within a stage, 2bw: max|dW| vs the delayed rule {diff:.3e}")
    assert diff <= TOL


# ---------------------------------------------------------------------- checkpoints and meta
def _fit_and_save(path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hf_models.HFModule("gpt2")
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=2)
    trainer.fit(module, hf_models.loader("gpt2", 2))
    trainer.save_checkpoint(path)
    x, _ = hf_models.batches("gpt2", 1, seed=5)[0]
    with torch.no_grad():
        logits = module.model.eval()(input_ids=x).logits
    return {"logits": logits}


def test_a_checkpoint_keeps_the_model_names_and_loads_on_one_device(pools: Any, tmp_path) -> None:
    """``trainer.save_checkpoint`` writes the Hugging Face keys (``model.transformer.h.0...``),
    the tied weight once under both its names (one storage, as one device saves it), and the
    file loads, strictly, into the model on one device."""
    path = str(tmp_path / "gpt2.ckpt")
    results = pools(2).run(_fit_and_save, path)
    checkpoint = torch.load(path, weights_only=True)
    state = checkpoint["state_dict"]
    fresh = hf_models.gpt2()
    assert set(state) == {f"model.{k}" for k in fresh.state_dict()}
    wte, head = state["model.transformer.wte.weight"], state["model.lm_head.weight"]
    assert wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    fresh.load_state_dict({k[len("model.") :]: v for k, v in state.items()}, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied
    x, _ = hf_models.batches("gpt2", 1, seed=5)[0]
    with torch.no_grad():
        logits = fresh.eval()(input_ids=x).logits
    for r in results:  # the handed-back model on each rank computes the same
        assert torch.equal(r["logits"], logits)


class _BuiltLate(hf_models.HFModule):
    """The model built in configure_model: on the meta device, each rank allocating its part."""

    def __init__(self, family: str) -> None:
        super(hf_models.HFModule, self).__init__()
        self.family = family
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = hf_models.FAMILIES[self.family]()


def _fit_late(family: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = _BuiltLate(family)
    losses: list[float] = []
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=3)
    trainer.fit(module, hf_models.loader(family, 3))
    params = [p for p in strategy.engine.body.parameters()]
    losses.append(float(trainer.callback_metrics.get("train_loss", float("nan"))))
    return {
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "largest": max(float(p.abs().max()) for p in params),
        "loss": losses[0],
    }


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_built_in_configure_model_is_initialised_by_its_own_init(
    pools: Any, family: str
) -> None:
    """GPT-2's Conv1D has no reset_parameters: the model's _init_weights initialises each
    rank's part (std 0.02), so nothing is left as uninitialised memory."""
    results = pools(2).run(_fit_late, family)
    for r in results:
        assert r["finite"] and r["largest"] < 10, r
    assert results[0]["loss"] == results[0]["loss"]  # not NaN
    assert 2.0 < results[0]["loss"] < 6.0, results[0]  # about log(64) = 4.16 at the start


# ---------------------------------------------------------------------- a model described by hand
class _TinyViT(nn.Module):
    """timm's VisionTransformer in miniature: parameters directly on the model (class token,
    position table), the blocks in an nn.Sequential called as a whole, a head on the class token."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, 16, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 16) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 17, 16) * 0.02)
        self.blocks = nn.Sequential(
            *[
                nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                for _ in range(4)
            ]
        )
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward_features(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.blocks(x)  # type: ignore[no-any-return]

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.forward_features(x))[:, 0])  # type: ignore[no-any-return]


def vit_head(model: nn.Module, hidden: Tensor, args: Any, kwargs: Any) -> Tensor:
    return model.head(model.norm(hidden)[:, 0])  # type: ignore[no-any-return, operator]


class _DescribedModule(RegressionModel):
    def __init__(self, post: tuple[str, ...] = ("norm", "head")) -> None:
        super().__init__()
        torch.manual_seed(3)
        del self.body
        self.net = _TinyViT()
        self.post = post

    def pipeline_body(self) -> PipeModel:
        return PipeModel(
            self.net,
            blocks="blocks",
            pre=["patch_embed", "cls_token", "pos_embed"],
            post=list(self.post),
            head=vit_head,
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _images(n: int = 5) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g))
        for _ in range(n)
    ]


def image_loader(n: int = 5) -> torch.utils.data.DataLoader[Any]:
    """:func:`_images` as a loader of batches of 8."""
    xs, ys = zip(*_images(n), strict=True)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8
    )


def _fit_described(schedule: str, post: tuple[str, ...] = ("norm", "head")) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = _DescribedModule(post)
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=M)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=STEPS)
    try:
        trainer.fit(module, image_loader())
    except ValueError as err:
        return {"error": str(err)}
    state = strategy.full_state_dict()
    return {"state": state if dist.get_rank() == 0 else None}


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_a_model_described_with_pipe_model(pools: Any, schedule: str) -> None:
    """A model the strategy does not know, described in pipeline_body(): parameters as ``pre``,
    a Sequential of blocks called as a whole, a head function; exact against one device."""
    results = pools(2).run(_fit_described, schedule)

    def cross_entropy(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(net(x), y)

    state = hf_models.train_reference(
        lambda: _DescribedModule().net, _images(), M, cross_entropy, lr=1e-3,
        delayed=schedule == "2bw",
    )  # fmt: skip
    ref = {f"net.{k}": v for k, v in state.items()}
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"described {schedule}: max|dW| vs one device {diff:.3e}")
    assert diff <= TOL


def test_a_parameter_in_no_part_is_named(pools: Any) -> None:
    for r in pools(2).run(_fit_described, "1f1b", ("head",)):
        assert r["error"].startswith(
            "parameters of _TinyViT in none of its pipeline parts: ['norm.weight', 'norm.bias']"
        ), r


def _fit_auto(family: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hf_models.HFModule(family)
    strategy = Pipe2BWStrategy(schedule="2bw", balance="auto")
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=10)
    trainer.fit(module, hf_models.loader(family, 10))
    assert strategy.plan is not None and strategy.plan_check is not None
    return {"balance": strategy.plan.best.balance, "check": strategy.plan_check.result}


@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_balance_auto_plans_a_real_model_and_reports_how_far_to_trust_it(
    pools: Any, family: str
) -> None:
    """The planner profiles the model's blocks (the first one on the step's own arguments) and
    the run reports its measured throughput against the prediction."""
    results = pools(2).run(_fit_auto, family)
    check = results[0]["check"]
    print(f"auto {family}: balance {results[0]['balance']}, {check}")
    assert sum(results[0]["balance"]) == 6  # first block, 4 layers, last block
    assert check is not None and check["measured"] > 0 and check["steps"] == 5
    assert abs(check["ratio"] - check["measured"] / check["predicted"]) < 1e-9


def _fit_resume(
    path: str, steps: int, resume: bool, state_dict_type: str, family: str = "gpt2"
) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hf_models.HFModule(family)
    strategy = Pipe2BWStrategy(schedule="2bw", microbatches=M, state_dict_type=state_dict_type)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=steps)
    # one batch per epoch: the checkpoint falls on an epoch's end, where Lightning resumes
    trainer.fit(module, hf_models.loader(family, 1), ckpt_path=path if resume else None)
    if not resume:
        trainer.save_checkpoint(path)
    state = strategy.full_state_dict()
    return {"state": state if dist.get_rank() == 0 else None}


@pytest.mark.parametrize("family", ["gpt2", "gpt2_untied"])
@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_run_resumed_from_a_checkpoint_goes_on_exactly(
    pools: Any, tmp_path, state_dict_type: str, family: str
) -> None:
    """GPT-2 (tied) under 2BW: 2 steps, a checkpoint, 3 more steps from it equal 5 straight
    steps (the checkpoint keeps the model's names, both weight versions and the tie)."""
    path = str(tmp_path / ("ckpt" if state_dict_type == "sharded" else "gpt2.ckpt"))
    pool = pools(2)
    args = (state_dict_type, family)
    straight = pool.run(_fit_resume, path + ".unused", STEPS, False, *args)[0]["state"]
    pool.run(_fit_resume, path, 2, False, *args)
    resumed = pool.run(_fit_resume, path, STEPS, True, *args)[0]["state"]
    diff = max_abs_diff(resumed, straight)
    print(f"resume {family} {state_dict_type}: max|dW| vs straight {diff:.3e}")
    assert diff <= 1e-6


# ---------------------------------------------------------------------- live repartitioning
def _slow_layer(module: nn.Module, args: Any, output: Any) -> None:
    # a layer much slower than the others: the split should change. (10 ms left the split
    # as it was once in five clean-clone CI runs; 30 ms makes the signal three times the size)
    time.sleep(0.03)


def _fit_moving(repartition: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hf_models.HFModule("gpt2")
    for layer in module.model.transformer.h[:2]:  # both on stage 0 with the even split
        layer.register_forward_hook(_slow_layer)
    extra = {"repartition_every": 2} if repartition else {}
    strategy = Pipe2BWStrategy(schedule="2bw", microbatches=M, **extra)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=STEPS)
    trainer.fit(module, hf_models.loader("gpt2", STEPS))
    state = strategy.full_state_dict()
    return {
        "state": state if dist.get_rank() == 0 else None,
        "balance": list(strategy.partition.balance) if strategy.partition else [],
        "whole": {f"model.{k}": v.clone() for k, v in module.model.state_dict().items()},
        "tied": module.model.lm_head.weight is module.model.transformer.wte.weight,
    }


def test_live_repartitioning_moves_a_models_layers_and_changes_no_weight(pools: Any) -> None:
    """Two slow GPT-2 layers on stage 0: blocks move to stage 1 at a flush point, with their
    weights, 2BW's second version and the optimizer state; the weights equal the run without
    moving, and after fit the model object is whole again, tie included."""
    pool = pools(2)
    still = pool.run(_fit_moving, False)
    moved = pool.run(_fit_moving, True)
    print(f"repartition: balance {still[0]['balance']} -> {moved[0]['balance']}")
    assert moved[0]["balance"] != still[0]["balance"] == [3, 3]
    assert max_abs_diff(moved[0]["state"], still[0]["state"]) == 0.0
    for r in moved:
        assert max_abs_diff(r["whole"], still[0]["state"]) == 0.0 and r["tied"]


class _Predicting(hf_models.HFModule):
    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, _ = batch
        return self.model(input_ids=x).logits  # type: ignore[no-any-return]


def _fit_validate_predict() -> dict[str, Any]:
    torch.set_num_threads(1)
    module = _Predicting("gpt2")
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=2)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=2, limit_val_batches=2)
    data = hf_models.loader("gpt2", 2)
    trainer.fit(module, data, data)
    validated = trainer.validate(module, data)
    predicted = trainer.predict(module, data)
    return {"val": validated[0]["val_loss"], "pred": predicted, "model": module.model}


def test_validate_and_predict_a_model_as_it_comes(pools: Any) -> None:
    """The evaluation loops run the model's own call too: the validation loss and the
    predicted logits (merged over micro-batches, in batch order) equal the trained model's on
    one device."""
    results = pools(2).run(_fit_validate_predict)
    model = results[0]["model"].eval()
    data = hf_models.batches("gpt2", 2)
    with torch.no_grad():
        logits = [model(input_ids=x).logits for x, _ in data]
        loss = sum(float(model(input_ids=x, labels=y).loss) for x, y in data) / len(data)
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["pred"], logits, strict=True))
        assert abs(r["val"] - loss) < 1e-6


def test_the_model_may_be_named_as_the_body(pools: Any) -> None:
    """``Pipe2BWStrategy(body="model")`` names the Hugging Face model instead of finding it."""
    results = pools(2).run(_fit, "llama", "1f1b", body="model")
    assert max_abs_diff(results[0]["state"], hf_models.reference("llama", STEPS, M)) == 0.0


# ---------------------------------------------------------------------- the layers' own arguments
def _fit_zoo(family: str, schedule: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hf_zoo.ZooModule(family)
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=M)
    steps = len(hf_zoo.LENGTHS)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=steps)
    trainer.fit(module, hf_zoo.loader(family))
    state = strategy.full_state_dict()  # collective
    return {
        "state": state if dist.get_rank() == 0 else None,
        "blocks": list(strategy.engine.body.indices) if strategy.engine else [],
    }


def _zoo_exact(pools: Any, family: str, schedule: str, ranks: int) -> None:
    results = pools(ranks).run(_fit_zoo, family, schedule)
    # 2BW's rule, on one list of stages or on a V (2bw-v): the delayed reference
    ref = hf_zoo.reference(family, M, delayed=REGISTRY[schedule].one_step_delay)
    state = results[0]["state"]
    diff = max_abs_diff(state, ref)
    worst = max(state, key=lambda k: (state[k].double() - ref[k].double()).abs().max().item())
    blocks = [r["blocks"] for r in results]
    print(f"ZOO {family} {schedule} p={ranks}: max|dW| {diff:.3e} (at {worst}); blocks {blocks}")
    assert diff <= TOL


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
@pytest.mark.parametrize("family", ["gemma2", "qwen2_sw", "modernbert"])
def test_layers_that_take_their_own_arguments_train_exactly(
    pools: Any, family: str, schedule: str, ranks: int
) -> None:
    """Gemma 2 (sliding and full attention, one mask each), Qwen2 with sliding layers then full
    ones, and ModernBERT (local and global attention, each with its own mask and rotary table,
    chosen by an attribute of the layer): every layer is called with what the model's forward
    gives it, on batches of 4, then 12 tokens (windows of 8), against one device."""
    _zoo_exact(pools, family, schedule, ranks)


@pytest.mark.parametrize(
    ("family", "schedule", "ranks"),
    [
        ("bart", "1f1b", 2),
        ("bart", "2bw", 4),
        ("t5", "1f1b", 4),
        ("t5", "2bw", 2),
        ("whisper", "1f1b", 2),
        ("prophetnet", "1f1b", 2),
    ],
)
def test_an_encoder_decoder_trains_as_two_stacks_of_layers(
    pools: Any, family: str, schedule: str, ranks: int
) -> None:
    """BART, T5 (whose layers pass a position bias on), Whisper and ProphetNet: the encoder's
    layers and the decoder's split over the stages, the decoder's stage replaying the forward up
    to its layers with the encoder's output; exact against one device. ProphetNet's decoder
    reads a weight of a part the junction's stage holds and calls a method of another before
    its layers: on the last stage those come from the parts' skeletons as zeros (random in the
    guard's replay, which proves the output does not depend on them; before: "Tensor on device
    meta")."""
    _zoo_exact(pools, family, schedule, ranks)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_layers_that_return_a_list_train_exactly(pools: Any, schedule: str) -> None:
    """OpenAI GPT's blocks return a list (``[hidden, ...]``), which the forward indexes as a
    tuple: the stand-ins hand the hidden state over as the first of the layer's outputs, not as
    the output itself (which the forward's ``[0]`` took a row of: "changes the hidden state
    between layer 0 and layer 1" before)."""
    _zoo_exact(pools, "openai_gpt", schedule, 2)


def _fit_zoo_error(family: str) -> str:
    try:
        _fit_zoo(family, "1f1b")
    except ValueError as err:
        return str(err)
    return "no error"


def test_layers_skipped_at_random_are_refused_at_set_up_naming_the_setting(pools: Any) -> None:
    """XGLM with LayerDrop (``layerdrop=0.5``) skips each layer at random in training: each stage
    would draw its own skips, so the stages would not run one model. Refused before the first
    step, naming the setting and its fix; with the fix (``layerdrop=0.0``) it trains exactly."""
    for message in pools(2).run(_fit_zoo_error, "xglm_layerdrop"):
        assert "model.config.layerdrop=0.5" in message, message
        assert "Set it to 0.0 before trainer.fit (model.config.layerdrop = 0.0" in message, message
    _zoo_exact(pools, "xglm", "1f1b", 2)


@pytest.mark.parametrize("family", ["swin", "swinv2", "wav2vec2_ctc"])
def test_layers_that_change_resolution_and_a_ctc_head_train_exactly(
    pools: Any, family: str
) -> None:
    """Swin's stages change resolution (the forward computes each stage's size from the layer
    list's own attributes); Swinv2's forward takes each stage's size from items of the layer's
    output (``output_dimensions[-2]``), which travel to the next layer as such (before:
    "'Pending' object is not subscriptable"); Wav2Vec2's CTC head needs the convolutional
    encoder's output lengths (the last stage replays them on blanks shaped as the first
    stage's outputs)."""
    _zoo_exact(pools, family, "1f1b", 2)


def _fit_zoo_module_state(family: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hf_zoo.ZooModule(family)
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2)
    trainer.fit(module, hf_zoo.loader(family))
    whole = strategy.full_state_dict()  # collective
    mine = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"module": mine, "whole": whole if dist.get_rank() == 0 else None}


def test_after_fit_the_module_holds_the_whole_model_parametrized_modules_included(
    pools: Any,
) -> None:
    """Wav2Vec2's positional convolution is weight-normed (a parametrized module, which torch
    does not pickle): after ``fit`` every rank's module holds the whole trained model, and its
    ``state_dict()`` is the checkpoint's, bit for bit (it raised before)."""
    results = pools(2).run(_fit_zoo_module_state, "wav2vec2_ctc")
    whole = results[0]["whole"]
    assert any("parametrizations" in k for k in whole)
    for rank, r in enumerate(results):
        assert sorted(r["module"]) == sorted(whole), rank
        assert max_abs_diff(r["module"], whole) == 0.0, rank


# ---------------------------------------------------------------------- router losses (MoE)
ROUTED = ("mixtral_router", "qwen3_moe_router", "qwen2_moe_router", "olmoe_router")


@pytest.mark.parametrize(
    ("family", "schedule"),
    [(f, "1f1b") for f in (*ROUTED, "granitemoe_router")]
    + [("mixtral_router", s) for s in ("2bw", "zb-h1", "zb-v", "interleaved-1f1b", "2bw-v")]
    + [("qwen3_moe_router", "2bw"), ("nllb_moe_router", "1f1b")],
)
def test_a_routers_load_balancing_loss_trains_exactly(
    pools: Any, family: str, schedule: str
) -> None:
    """Mixture-of-experts models with ``output_router_logits=True``: the model's own loss is
    the LM loss plus the router coefficient times the load-balancing loss, which the end of the
    forward computes from every layer's router logits. Those are recorded where each layer
    runs, travel with the carry to the last stage's replay and their gradients come back, so
    the routers of every stage train as on one device (before: "tuple index out of range" on
    the last stage, which had no router logits). NLLB-MoE, an encoder-decoder, sums both
    stacks' router losses; its router keeps an expert capacity that a forward in eval mode
    overwrites with the batch's token count, which the intake's own eval forward must not
    leave behind (before: 6e-3 off, with or without the router loss)."""
    _zoo_exact(pools, family, schedule, 2)


def _fit_routed_then_call(family: str) -> dict[str, Any]:
    out = _fit_zoo_module_state(family)
    module = hf_zoo.ZooModule(family)  # a fresh model with the trained weights, on one device
    module.load_state_dict(out["module"])
    x, y = hf_zoo.batches(family)[0]
    torch.manual_seed(0)
    again = hf_zoo.call(module.model, family, x, y)
    return {**out, "logits": len(again.router_logits), "aux": float(again.aux_loss)}


def test_after_fit_a_routed_model_is_whole_and_records_its_router_logits_again(
    pools: Any,
) -> None:
    """transformers' own hooks that record the router logits are local functions, which no
    pickle carries: blocks travel without them (the hand-back after ``fit``), and the whole
    model installs them again at its next forward on one device."""
    results = pools(2).run(_fit_routed_then_call, "mixtral_router")
    whole = results[0]["whole"]
    for rank, r in enumerate(results):
        assert max_abs_diff(r["module"], whole) == 0.0, rank
        assert r["logits"] == 4 and r["aux"] > 0, r  # one per layer, on every rank


def test_a_routers_loss_trains_as_lightning_on_one_device_accumulating(pools: Any) -> None:
    """The same against Lightning itself: one device, the module unchanged, each batch's 4
    micro-batches accumulated (``accumulate_grad_batches=4``): the router loss is each
    micro-batch's own, as on one device."""
    results = pools(2).run(_fit_zoo, "mixtral_router", "1f1b")
    torch.set_num_threads(1)
    module = hf_zoo.ZooModule("mixtral_router")
    micro = [
        (x, y)
        for x_b, y_b in hf_zoo.batches("mixtral_router")
        for x, y in zip(torch.tensor_split(x_b, M), torch.tensor_split(y_b, M), strict=True)
    ]
    steps = len(hf_zoo.LENGTHS)
    trainer = quiet_trainer(devices=1, max_steps=steps, accumulate_grad_batches=M)
    trainer.fit(module, torch.utils.data.DataLoader(micro, batch_size=None))  # type: ignore[arg-type]
    ref = {f"model.{k}": v.detach() for k, v in module.model.state_dict().items()}
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"mixtral_router 1f1b vs Lightning on one device, accumulating: max|dW| {diff:.3e}")
    assert diff <= TOL

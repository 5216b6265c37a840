"""Small third-party models (Hugging Face transformers: GPT-2, Llama, ViT) as a user hands them
over: the LightningModule holds the model as it comes and its step calls it as usual; nothing is
rewritten for the pipeline. And the single-device references they are compared with."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.models import corrected_step, correction_terms, predicted

warnings.filterwarnings("ignore", message=".*token_id.*")
transformers = __import__("transformers")
transformers.logging.set_verbosity_error()

VOCAB, SEQ, IMAGE = 64, 12, 16
LABELS = 3
BATCH = 8
LR = 1e-3


def gpt2(tie: bool = True) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama(tie: bool = False) -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def vit() -> nn.Module:
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        image_size=IMAGE, patch_size=4, num_labels=5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def opt() -> nn.Module:
    """OPT registers its final norm before its layer list: only the forward tells it runs after."""
    config = transformers.OPTConfig(
        hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    return transformers.OPTForCausalLM(config)


def bert(task: str = "classify") -> nn.Module:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, num_labels=LABELS,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    if task == "mlm":
        return transformers.BertForMaskedLM(config)
    return transformers.BertForSequenceClassification(config)


def distilbert() -> nn.Module:
    """DistilBERT's classifier runs ``pre_classifier`` on the first token before ``classifier``."""
    config = transformers.DistilBertConfig(
        dim=32, n_layers=4, n_heads=2, hidden_dim=64, vocab_size=VOCAB,
        max_position_embeddings=64, num_labels=LABELS, dropout=0.0, attention_dropout=0.0,
        seq_classif_dropout=0.0, pad_token_id=0,
    )  # fmt: skip
    return transformers.DistilBertForSequenceClassification(config)


def roberta() -> nn.Module:
    config = transformers.RobertaConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return transformers.RobertaForMaskedLM(config)


def compiled_layers(model: nn.Module) -> nn.Module:
    """``model`` with each layer of its layer list compiled by the user, as one compiles a
    Hugging Face model's layers (``layers[i] = torch.compile(layers[i])``: an ``OptimizedModule``
    in the list, its keys under ``_orig_mod``), with the ``aot_eager`` backend (see
    ``helpers.models.CompiledModel``)."""
    base = getattr(model, model.base_model_prefix)
    layers = base.h if hasattr(base, "h") else base.layers
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, backend="aot_eager")
    return model


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "gpt2_untied": lambda: gpt2(tie=False),
    "gpt2": gpt2,
    "llama": llama,
    "llama_tied": lambda: llama(tie=True),
    "llama_masked": llama,  # called with a padding mask: a 4-d float mask crosses stages
    "vit": vit,
    "opt": opt,
    "bert_cls": bert,  # called with a padding mask and class labels
    "bert_mlm": lambda: bert("mlm"),
    "distilbert_cls": distilbert,  # called with a padding mask and class labels
    "roberta_mlm": roberta,
    # each decoder layer compiled by the user
    "gpt2_compiled": lambda: compiled_layers(gpt2()),
    "llama_compiled": lambda: compiled_layers(llama()),
}
CLASSIFIERS = ("bert_cls", "distilbert_cls")


def batches(family: str, n: int = 5, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if family == "vit":
            out.append(
                (
                    torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
                    torch.randint(0, 5, (BATCH,), generator=g),
                )
            )
        elif family in CLASSIFIERS:
            ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
            out.append((ids, torch.randint(0, LABELS, (BATCH,), generator=g)))
        else:
            ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
            out.append((ids, ids))
    return out


def loader(family: str, n: int = 5) -> DataLoader[Any]:
    xs, ys = zip(*batches(family, n), strict=True)
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=BATCH)


def call(model: nn.Module, family: str, x: Tensor, y: Tensor) -> Any:
    """The model's own call, as a user writes it."""
    if family == "vit":
        return model(pixel_values=x, labels=y)
    if family in CLASSIFIERS:  # every other sequence padded on the right by 3 tokens
        mask = torch.ones_like(x)
        mask[::2, -3:] = 0
        return model(input_ids=x, attention_mask=mask, labels=y)
    if family.endswith("_masked"):  # every other sequence padded on the left by 3 tokens
        mask = torch.ones_like(x)
        mask[::2, :3] = 0
        return model(input_ids=x, attention_mask=mask, labels=y.masked_fill(mask == 0, -100))
    return model(input_ids=x, labels=y)


class HFModule(LightningModule):
    """The whole user code: the model as it comes, and its call in the step."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        torch.manual_seed(0)
        self.model = FAMILIES[family]()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = call(self.model, self.family, x, y).loss
        self.log("train_loss", loss)
        return loss  # type: ignore[no-any-return]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", call(self.model, self.family, x, y).loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR)


# the loss of one micro-batch, as the step computes it: (model, inputs, targets) -> loss
Loss = Callable[[nn.Module, Tensor, Tensor], Tensor]


def train_reference(
    build: Callable[[], nn.Module],
    data: Sequence[tuple[Tensor, Tensor]],
    m: int,
    loss: Loss,
    lr: float = LR,
    delayed: bool = False,
    correction: str = "auto",
    eps: float = 1e-8,
) -> dict[str, Tensor]:
    """One device, the whole model (``build()``, called twice: it must seed itself): AdamW on
    the gradient accumulated over ``m`` micro-batches of each batch (micro-batch i's loss
    weighted by its share); with ``delayed``, 2BW's rule W(t+1) = W(t) - step(grad f(W(t-1))),
    W(-1) = W(0), with its delay ``correction`` (as ``helpers.models.reference_2bw``). The final state
    dict."""
    model, shadow = build().train(), build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    history = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    terms = correction_terms(correction) if delayed else {}
    points = {0: history[0]}  # where each batch is evaluated, under a prediction
    previous: dict[Any, Tensor] = {}
    for step, (x, y) in enumerate(data):
        net = model
        if delayed:  # the gradient of the version before the newest, on the shadow copy
            if "predict" in terms:
                points[step + 1] = predicted(
                    model, opt, lambda params: torch.optim.AdamW(params, lr=lr, eps=eps)
                )
                shadow.load_state_dict(points[step])
            else:
                shadow.load_state_dict(history[max(step - 1, 0)])
            net = shadow
        net.zero_grad()
        for xs, ys in zip(torch.tensor_split(x, m), torch.tensor_split(y, m), strict=True):
            (loss(net, xs, ys) * (xs.shape[0] / x.shape[0])).backward()
        if delayed:
            for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
                p.grad = None if q.grad is None else q.grad.clone()
        corrected_step(opt, list(model.parameters()), correction if delayed else "none", previous)
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return history[-1]


def reference(family: str, steps: int, m: int, delayed: bool = False) -> dict[str, Tensor]:
    """:func:`train_reference` for a family, on :func:`batches`, under the module's names."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return FAMILIES[family]()

    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return call(model, family, x, y).loss  # type: ignore[no-any-return]

    state = train_reference(build, batches(family, steps), m, loss, delayed=delayed)
    return {f"model.{k}": v for k, v in state.items()}

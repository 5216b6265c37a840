"""Hugging Face families whose layers take different arguments, or whose forward runs two stacks
of layers, as a user hands them over (tiny random configs, no downloads), with batches whose
sequence length changes from one step to the next, and the one-device references they are
compared with.

- per-layer arguments: Gemma 2 (sliding-window and full-attention layers, one mask each),
  Qwen2 with ``layer_types`` (sliding layers, then full ones), ModernBERT (local and global
  attention, each with its own mask and rotary table; its forward reads each layer's
  ``attention_type``), Gemma 3, a sliding-window Mistral (every layer sliding);
- two stacks (encoder-decoders): BART, T5 (its layers pass a position bias on), Whisper
  (audio features in), mBART, Marian;
- layers that change the resolution (Swin) and a CTC head over a convolutional feature encoder
  (Wav2Vec2).

The windows are 8 tokens and the first batch has 4: a split that gives every layer the first
layer's arguments (what pipe2bw did before) passes a check on the first batch and trains the
longer ones wrong.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader

from helpers.hf_models import train_reference

warnings.filterwarnings("ignore", message=".*token_id.*")
T = __import__("transformers")
T.logging.set_verbosity_error()

VOCAB, BATCH, WINDOW, LR = 64, 8, 8, 1e-3
# AdamW's epsilon: a gradient entry near zero (|g| ~ 1e-8) turns rounding noise in the order
# of a sum into a step of the learning rate's size with the default 1e-8
EPS = 1e-6
LENGTHS = (4, 12, 12, 8)  # the first batch fits in the window, the next do not


def _decoder(**kw: Any) -> dict[str, Any]:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return base | kw


# a router's load-balancing loss in the model's loss, with a coefficient that makes it count
_ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.1)
_QWEN2_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)


def _xglm(layerdrop: float) -> nn.Module:
    return T.XGLMForCausalLM(
        T.XGLMConfig(
            d_model=32,
            ffn_dim=64,
            num_layers=4,
            attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            layerdrop=layerdrop,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=1,
        )
    )


def _seq2seq(**kw: Any) -> dict[str, Any]:
    base = dict(
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    return base | kw


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "gemma2": lambda: T.Gemma2ForCausalLM(
        T.Gemma2Config(**_decoder(head_dim=8, sliding_window=WINDOW))
    ),
    "gemma3": lambda: T.Gemma3ForCausalLM(
        T.Gemma3TextConfig(**_decoder(head_dim=8, sliding_window=WINDOW, sliding_window_pattern=2))
    ),
    "qwen2_sw": lambda: T.Qwen2ForCausalLM(
        T.Qwen2Config(
            **_decoder(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
        )
    ),
    "mistral_sw": lambda: T.MistralForCausalLM(T.MistralConfig(**_decoder(sliding_window=WINDOW))),
    "modernbert": lambda: T.ModernBertForMaskedLM(
        T.ModernBertConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            global_attn_every_n_layers=2,
            local_attention=WINDOW,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            cls_token_id=0,
            sep_token_id=0,
            embedding_dropout=0.0,
            attention_dropout=0.0,
            mlp_dropout=0.0,
        )
    ),
    "bart": lambda: T.BartForConditionalGeneration(
        T.BartConfig(**_seq2seq(decoder_start_token_id=2))
    ),
    "mbart": lambda: T.MBartForConditionalGeneration(T.MBartConfig(**_seq2seq())),
    "marian": lambda: T.MarianMTModel(
        T.MarianConfig(**_seq2seq(bos_token_id=None, decoder_start_token_id=1))
    ),
    "t5": lambda: T.T5ForConditionalGeneration(
        T.T5Config(
            d_model=32,
            d_ff=64,
            d_kv=8,
            num_layers=2,
            num_heads=4,
            vocab_size=VOCAB,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    ),
    "whisper": lambda: T.WhisperForConditionalGeneration(
        T.WhisperConfig(
            **_seq2seq(
                num_mel_bins=8,
                max_source_positions=16,
                max_target_positions=32,
                decoder_start_token_id=0,
            )
        )
    ),
    "swin": lambda: T.SwinForImageClassification(
        T.SwinConfig(
            image_size=32,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1, 2],
            num_heads=[2, 2, 4],
            window_size=2,
            num_labels=5,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            drop_path_rate=0.0,
        )
    ),
    # its forward indexes a layer's output dimensions and passes the items to the next layer
    "swinv2": lambda: T.Swinv2ForImageClassification(
        T.Swinv2Config(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1, 2], num_heads=[2, 2, 4],
            window_size=2, num_labels=5, drop_path_rate=0.0, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    ),
    "wav2vec2_ctc": lambda: T.Wav2Vec2ForCTC(
        T.Wav2Vec2Config(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=64,
            conv_dim=(16, 16),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            vocab_size=VOCAB,
            pad_token_id=0,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            feat_proj_dropout=0.0,
            final_dropout=0.0,
            layerdrop=0.0,
            mask_time_prob=0.0,
            ctc_loss_reduction="mean",
        )
    ),
    # its blocks return a list, not a tuple
    "openai_gpt": lambda: T.OpenAIGPTLMHeadModel(
        T.OpenAIGPTConfig(
            n_embd=32,
            n_layer=4,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ),
    # LayerDrop: each layer skipped at random in training (refused; layerdrop=0.0 trains)
    # mixture-of-experts with the router's load-balancing loss in the model's own loss
    "mixtral_router": lambda: T.MixtralForCausalLM(
        T.MixtralConfig(**_decoder(num_local_experts=4, num_experts_per_tok=2), **_ROUTER)
    ),
    "qwen3_moe_router": lambda: T.Qwen3MoeForCausalLM(
        T.Qwen3MoeConfig(
            **_decoder(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), **_ROUTER
        )
    ),
    "qwen2_moe_router": lambda: T.Qwen2MoeForCausalLM(
        T.Qwen2MoeConfig(**_decoder(**_QWEN2_MOE), **_ROUTER)
    ),
    "olmoe_router": lambda: T.OlmoeForCausalLM(
        T.OlmoeConfig(**_decoder(num_experts=4, num_experts_per_tok=2), **_ROUTER)
    ),
    "granitemoe_router": lambda: T.GraniteMoeForCausalLM(
        T.GraniteMoeConfig(**_decoder(num_local_experts=4, num_experts_per_tok=2), **_ROUTER)
    ),
    # an encoder-decoder whose every other layer is sparse: both stacks' router logits count;
    # its router sets its expert capacity from the batch in eval mode (the intake's forward)
    "nllb_moe_router": lambda: T.NllbMoeForConditionalGeneration(
        T.NllbMoeConfig(
            **_seq2seq(
                num_experts=4, expert_capacity=64, encoder_sparse_step=2, decoder_sparse_step=2,
                attention_dropout=0.0, activation_dropout=0.0, moe_token_dropout=0.0,
                encoder_layerdrop=0.0, decoder_layerdrop=0.0, decoder_start_token_id=0,
            ),
            **_ROUTER,
        )
    ),
    # its decoder reads the n-gram embeddings' weight and calls a method of its position
    # embeddings before its layers, parts the junction's stage holds
    "prophetnet": lambda: T.ProphetNetForConditionalGeneration(
        T.ProphetNetConfig(
            hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=2,
            num_decoder_layers=2, num_encoder_attention_heads=2, num_decoder_attention_heads=2,
            vocab_size=VOCAB, max_position_embeddings=64, ngram=2, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=0,
        )
    ),
    "xglm_layerdrop": lambda: _xglm(layerdrop=0.5),
    "xglm": lambda: _xglm(layerdrop=0.0),
}
SEQ2SEQ = ("bart", "mbart", "marian", "t5", "whisper", "nllb_moe_router", "prophetnet")


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]()


def batches(
    family: str, lengths: Sequence[int] = LENGTHS, seed: int = 0
) -> list[tuple[Tensor, Tensor]]:
    """One batch per step, of ``lengths[i]`` tokens (audio: 40 samples a token; images keep
    their size)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        if family in ("swin", "swinv2"):
            out.append(
                (
                    torch.randn(BATCH, 3, 32, 32, generator=g),
                    torch.randint(0, 5, (BATCH,), generator=g),
                )
            )
        elif family == "wav2vec2_ctc":
            out.append(
                (
                    torch.randn(BATCH, 40 * n, generator=g),
                    torch.randint(1, VOCAB, (BATCH, 3), generator=g),
                )
            )
        elif family == "whisper":
            out.append(
                (
                    torch.randn(BATCH, 8, 32, generator=g),
                    torch.randint(3, VOCAB, (BATCH, n), generator=g),
                )
            )
        elif family in SEQ2SEQ:
            ids = torch.randint(3, VOCAB, (BATCH, n), generator=g)
            out.append((ids, torch.randint(3, VOCAB, (BATCH, n // 2 + 1), generator=g)))
        else:
            ids = torch.randint(2, VOCAB, (BATCH, n), generator=g)
            out.append((ids, ids))
    return out


def loader(family: str, lengths: Sequence[int] = LENGTHS) -> DataLoader[Any]:
    """The batches as they come, one a step (``batch_size=None``: the loader does not batch)."""
    return DataLoader(batches(family, lengths), batch_size=None)  # type: ignore[arg-type]


def call(model: nn.Module, family: str, x: Tensor, y: Tensor) -> Any:
    """The model's own call, as a user writes it."""
    if family in ("swin", "swinv2"):
        return model(pixel_values=x, labels=y)
    if family == "wav2vec2_ctc":
        return model(input_values=x, labels=y)
    if family == "whisper":
        return model(input_features=x, labels=y)
    return model(input_ids=x, labels=y)


class ZooModule(LightningModule):
    """The whole user code: the model as it comes, and its call in the step."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        self.model = build(family)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = call(self.model, self.family, x, y).loss
        self.log("train_loss", loss)
        return loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR, eps=EPS)


def reference(
    family: str, m: int, lengths: Sequence[int] = LENGTHS, delayed: bool = False
) -> dict[str, Tensor]:
    """One device: AdamW on the gradient accumulated over ``m`` micro-batches of each batch
    (2BW's delayed rule with ``delayed``), under the module's names."""

    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return call(model, family, x, y).loss  # type: ignore[no-any-return]

    state = train_reference(
        lambda: build(family), batches(family, lengths), m, loss, delayed=delayed, eps=EPS
    )
    return {f"model.{k}": v for k, v in state.items()}

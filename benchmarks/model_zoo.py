"""Hugging Face families as they come, each against Lightning's reference on one device: the
README's model table.

    python benchmarks/model_zoo.py [--families gemma2,t5,...] [--out benchmarks/results/model_zoo.json]

Each family is a tiny random config (no download), held by a LightningModule whose step calls the
model as a user writes it, trained with ``Pipe2BWStrategy(schedule="1f1b", microbatches=4)`` on
2 CPU ranks for 5 AdamW steps (epsilon 1e-6, see ``tests/helpers/hf_zoo.py``) on batches whose
length changes (4, 12, 12, 8, 12 tokens; sliding windows of 8), and compared with one device
accumulating the same micro-batches: the largest difference of any weight after the 5 steps, or
the error pipe2bw refuses the model with. About 8 minutes on 2 cores (EfficientNet and
Qwen3-Next's one-device references take most of it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import RankPool, TaskError

RESULTS = Path(__file__).resolve().parent / "results"
LENGTHS = (4, 12, 12, 8, 12)
BATCH, M, STEPS = 8, 4, 5


def _families() -> dict[str, tuple[Callable[[], Any], str]]:
    """name -> (builder, input kind)."""
    import transformers as T
    from helpers import hf_zoo

    T.logging.set_verbosity_error()
    small = dict(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
        vocab_size=64, max_position_embeddings=64, num_key_value_heads=2,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    seq2seq = dict(
        d_model=32, d_ff=64, num_layers=2, num_heads=4, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_experts=4, decoder_start_token_id=0,
    )  # fmt: skip

    def make(cls: Any, base: bool = True, **kw: Any) -> Callable[[], Any]:
        def build() -> Any:
            config = cls.config_class()
            for key, value in ((small if base else {}) | kw).items():
                try:
                    setattr(config, key, value)
                except Exception:  # a property the family computes, or refuses
                    pass
            for key, value in list(vars(config).items()):  # no dropout, no drop path: exactness
                if "drop" in key or key.endswith("pdrop"):
                    if isinstance(value, float):
                        setattr(config, key, 0.0)
                    elif isinstance(value, (list, tuple)) and all(
                        isinstance(v, float) for v in value
                    ):
                        setattr(config, key, [0.0] * len(value))
            return cls(config)

        return build

    image = dict(image_size=32, patch_size=8, num_channels=3, num_labels=5)
    # mixtures of experts measured both without and with their router loss: one config each
    moe: dict[str, dict[str, Any]] = {
        "Jamba": dict(
            num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
            attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_expand=2,
            mamba_dt_rank=4, use_mamba_kernels=False,
        ),
        "Qwen3-MoE": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        "JetMoe": dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=8),
        "GraniteMoe": dict(num_local_experts=4, num_experts_per_tok=2),
        "GPT-OSS": dict(
            head_dim=8, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    }  # fmt: skip
    families: dict[str, tuple[Callable[[], Any], str]] = {
        "GPT-2": (make(T.GPT2LMHeadModel), "causal"),
        "Llama": (make(T.LlamaForCausalLM), "causal"),
        "OPT": (make(T.OPTForCausalLM, ffn_dim=64, word_embed_proj_dim=32), "causal"),
        "GPT-J": (make(T.GPTJForCausalLM, rotary_dim=4), "causal"),
        "CodeGen": (make(T.CodeGenForCausalLM, rotary_dim=4), "causal"),
        "GPTBigCode": (make(T.GPTBigCodeForCausalLM), "causal"),
        "GPT-Neo": (
            make(T.GPTNeoForCausalLM, attention_types=[[["global", "local"], 2]], window_size=8),
            "causal",
        ),
        "MPT": (make(T.MptForCausalLM), "causal"),
        "StableLM": (make(T.StableLmForCausalLM), "causal"),
        "Starcoder2": (make(T.Starcoder2ForCausalLM, sliding_window=8), "causal"),
        "XGLM": (make(T.XGLMForCausalLM, d_model=32, ffn_dim=64, num_layers=4), "causal"),
        "Mistral (sliding window)": (lambda: hf_zoo.build("mistral_sw"), "causal"),
        "Qwen2 (layer_types)": (lambda: hf_zoo.build("qwen2_sw"), "causal"),
        "Qwen3 (layer_types)": (
            make(
                T.Qwen3ForCausalLM,
                head_dim=8,
                use_sliding_window=True,
                sliding_window=8,
                max_window_layers=2,
                layer_types=["sliding_attention"] * 2 + ["full_attention"] * 2,
            ),
            "causal",
        ),
        "Gemma 2": (lambda: hf_zoo.build("gemma2"), "causal"),
        "Gemma 3": (lambda: hf_zoo.build("gemma3"), "causal"),
        "Cohere2": (
            make(
                T.Cohere2ForCausalLM,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            "causal",
        ),
        "GPT-OSS": (make(T.GptOssForCausalLM, **moe["GPT-OSS"]), "causal"),
        "BERT (classifier)": (make(T.BertForSequenceClassification, num_labels=3), "seqcls"),
        "BERT (masked LM)": (make(T.BertForMaskedLM), "causal"),
        "RoBERTa (masked LM)": (make(T.RobertaForMaskedLM, pad_token_id=1), "causal"),
        "DistilBERT (classifier)": (
            make(
                T.DistilBertForSequenceClassification,
                dim=32,
                hidden_dim=64,
                n_layers=4,
                n_heads=2,
                num_labels=3,
                seq_classif_dropout=0.0,
            ),
            "seqcls",
        ),
        "DeBERTa-v2 (classifier)": (
            make(T.DebertaV2ForSequenceClassification, num_labels=3, pooler_hidden_size=32),
            "seqcls",
        ),
        "ELECTRA (classifier)": (
            make(T.ElectraForSequenceClassification, embedding_size=32, num_labels=3),
            "seqcls",
        ),
        "ELECTRA (tokens)": (
            make(T.ElectraForTokenClassification, embedding_size=32, num_labels=3),
            "tokcls",
        ),
        "Qwen2 (classifier)": (make(T.Qwen2ForSequenceClassification, num_labels=3), "seqcls"),
        "ModernBERT": (lambda: hf_zoo.build("modernbert"), "causal"),
        "ViT": (make(T.ViTForImageClassification, **image), "image"),
        "Swin": (lambda: hf_zoo.build("swin"), "image"),
        "Swinv2": (lambda: hf_zoo.build("swinv2"), "image"),
        "ConvNeXt": (
            lambda: T.ConvNextForImageClassification(
                T.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 2], num_labels=5)
            ),
            "image",
        ),
        "ResNet": (
            make(
                T.ResNetForImageClassification,
                embedding_size=8,
                hidden_sizes=[8, 16],
                depths=[1, 2],
                num_labels=5,
            ),
            "image",
        ),
        "CLIP (text)": (make(T.CLIPTextModel), "text_features"),
        "CLIP (vision)": (make(T.CLIPVisionModel, **image), "image_features"),
        "BART": (lambda: hf_zoo.build("bart"), "seq2seq"),
        "mBART": (lambda: hf_zoo.build("mbart"), "seq2seq"),
        "Marian": (lambda: hf_zoo.build("marian"), "seq2seq"),
        "T5": (lambda: hf_zoo.build("t5"), "seq2seq"),
        "Whisper": (lambda: hf_zoo.build("whisper"), "whisper"),
        "Wav2Vec2 (CTC)": (lambda: hf_zoo.build("wav2vec2_ctc"), "ctc"),
        **{
            label: (
                make(getattr(T, cls), head_dim=8, partial_rotary_factor=0.5, rotary_dim=4),
                "causal",
            )
            for label, cls in (
                ("Falcon", "FalconForCausalLM"),
                ("Phi", "PhiForCausalLM"),
                ("Phi-3", "Phi3ForCausalLM"),
                ("Bloom", "BloomForCausalLM"),
                ("GPT-NeoX", "GPTNeoXForCausalLM"),
                ("Gemma", "GemmaForCausalLM"),
                ("Mixtral", "MixtralForCausalLM"),
                ("Qwen2-MoE", "Qwen2MoeForCausalLM"),
                ("OLMo 2", "Olmo2ForCausalLM"),
                ("OLMoE", "OlmoeForCausalLM"),
                ("Persimmon", "PersimmonForCausalLM"),
                ("Granite", "GraniteForCausalLM"),
                ("Nemotron", "NemotronForCausalLM"),
                ("Cohere", "CohereForCausalLM"),
                ("Llama 4 (text)", "Llama4ForCausalLM"),
                ("Qwen3-Next", "Qwen3NextForCausalLM"),
                ("RWKV", "RwkvForCausalLM"),
                ("BART decoder alone", "BartForCausalLM"),
                ("BigBird (causal LM)", "BigBirdForCausalLM"),
            )
        },
        **{
            label: (make(getattr(T, cls)), "causal")
            for label, cls in (
                ("XLNet", "XLNetLMHeadModel"),
                ("Longformer", "LongformerForMaskedLM"),
                ("FNet", "FNetForMaskedLM"),
                ("ESM", "EsmForMaskedLM"),
                ("MPNet", "MPNetForMaskedLM"),
            )
        },
        **{
            label: (make(getattr(T, cls), **image), "image")
            for label, cls in (
                ("BEiT", "BeitForImageClassification"),
                ("DINOv2", "Dinov2ForImageClassification"),
                ("MobileViT", "MobileViTForImageClassification"),
                ("EfficientNet", "EfficientNetForImageClassification"),
            )
        },
        "Segformer": (make(T.SegformerForImageClassification, base=False, num_labels=5), "image"),
        "ConvNeXt V2": (
            lambda: T.ConvNextV2ForImageClassification(
                T.ConvNextV2Config(num_stages=2, hidden_sizes=[8, 16], depths=[1, 2], num_labels=5)
            ),
            "image",
        ),
        **{
            label: (make(getattr(T, cls), **seq2seq), "seq2seq")
            for label, cls in (
                ("Pegasus", "PegasusForConditionalGeneration"),
                ("M2M100", "M2M100ForConditionalGeneration"),
                ("mT5", "MT5ForConditionalGeneration"),
                ("UMT5", "UMT5ForConditionalGeneration"),
                ("Blenderbot", "BlenderbotForConditionalGeneration"),
                ("PLBart", "PLBartForConditionalGeneration"),
                ("ProphetNet", "ProphetNetForConditionalGeneration"),
                ("NLLB-MoE", "NllbMoeForConditionalGeneration"),
            )
        },
        # the fifth outside round's families (issue 60): state-space and hybrid models, more
        # mixtures of experts (without their router loss), OpenAI GPT's list-returning blocks
        **{
            label: (make(getattr(T, cls), **kw), "causal")
            for label, cls, kw in (
                ("Mamba", "MambaForCausalLM", dict(state_size=8, expand=2)),
                ("Mamba2", "Mamba2ForCausalLM", dict(head_dim=8, num_heads=8, n_groups=1,
                                                      state_size=8, expand=2, chunk_size=4)),
                ("FalconMamba", "FalconMambaForCausalLM", dict(state_size=8, expand=2)),
                ("RecurrentGemma", "RecurrentGemmaForCausalLM", dict(
                    lru_width=32, attention_window_size=8, block_types=["recurrent", "attention"],
                    head_dim=8)),
                ("Jamba", "JambaForCausalLM", moe["Jamba"]),
                ("Bamba", "BambaForCausalLM", dict(
                    mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8,
                    mamba_expand=2, mamba_chunk_size=4, attn_layer_indices=[1, 3])),
                ("Zamba", "ZambaForCausalLM", dict(
                    attention_hidden_size=64, attention_head_dim=16, mamba_d_state=8,
                    mamba_expand=2, mamba_dt_rank=4, n_mamba_heads=2, num_hidden_layers=4,
                    attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False)),
                ("DeepSeek-V3", "DeepseekV3ForCausalLM", dict(
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                    q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                    head_dim=4, qk_head_dim=8)),
                ("Qwen3-MoE", "Qwen3MoeForCausalLM", moe["Qwen3-MoE"]),
                ("JetMoe", "JetMoeForCausalLM", moe["JetMoe"]),
                ("GraniteMoe", "GraniteMoeForCausalLM", moe["GraniteMoe"]),
                ("OpenAI GPT", "OpenAIGPTLMHeadModel", dict(n_embd=32, n_layer=4, n_head=4,
                                                            n_positions=64)),
            )
        },
        # mixtures of experts with the router's load-balancing loss in the model's own loss
        # (output_router_logits=True): every layer's router logits reach the last stage
        **{
            f"{label} (router loss)": (
                make(getattr(T, cls), output_router_logits=True, router_aux_loss_coef=0.1, **kw),
                "causal",
            )
            for label, cls, kw in (
                ("Mixtral", "MixtralForCausalLM", dict(num_local_experts=4,
                                                       num_experts_per_tok=2)),
                ("Qwen2-MoE", "Qwen2MoeForCausalLM", dict(
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)),
                ("Qwen3-MoE", "Qwen3MoeForCausalLM", moe["Qwen3-MoE"]),
                ("OLMoE", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
                ("GraniteMoe", "GraniteMoeForCausalLM", moe["GraniteMoe"]),
                ("JetMoe", "JetMoeForCausalLM", moe["JetMoe"]),
                ("Jamba", "JambaForCausalLM", moe["Jamba"]),
                ("GPT-OSS", "GptOssForCausalLM", moe["GPT-OSS"]),
                ("Ernie 4.5 MoE", "Ernie4_5_MoeForCausalLM", dict(
                    moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                    moe_layer_start_index=0)),
                ("Qwen3-Next", "Qwen3NextForCausalLM", dict(
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, head_dim=8, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)),
                ("MiniMax", "MiniMaxForCausalLM", dict(num_local_experts=4,
                                                       num_experts_per_tok=2, head_dim=8)),
                ("FlexOlmo", "FlexOlmoForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
                ("GraniteMoeShared", "GraniteMoeSharedForCausalLM", dict(
                    num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32)),
            )
        },
        "DBRX": (lambda: _dbrx(T, router=False), "causal"),
        "DBRX (router loss)": (lambda: _dbrx(T, router=True), "causal"),
        "NLLB-MoE (sparse layers)": (
            make(
                T.NllbMoeForConditionalGeneration, encoder_sparse_step=2, decoder_sparse_step=2,
                **seq2seq,
            ),
            "seq2seq",
        ),
        "NLLB-MoE (router loss)": (
            make(
                T.NllbMoeForConditionalGeneration, output_router_logits=True,
                encoder_sparse_step=2, decoder_sparse_step=2, **seq2seq,
            ),
            "seq2seq",
        ),
        "Switch Transformers": (
            make(
                T.SwitchTransformersForConditionalGeneration, d_kv=8, router_jitter_noise=0.0,
                **seq2seq,
            ),
            "seq2seq",
        ),
        "Switch Transformers (router loss)": (
            make(T.SwitchTransformersForConditionalGeneration, output_router_logits=True,
                 d_kv=8, router_jitter_noise=0.0, **seq2seq),
            "seq2seq",
        ),
        "ALBERT (masked LM)": (make(T.AlbertForMaskedLM, embedding_size=32), "causal"),
        "XLM": (make(T.XLMWithLMHeadModel, emb_dim=32, n_layers=4, n_heads=4), "causal"),
    }
    return families


def _dbrx(T: Any, router: bool) -> Any:
    """DBRX keeps its attention and experts' settings in sub-configs."""
    config = T.DbrxConfig(
        d_model=32, n_heads=4, n_layers=4, max_seq_len=64, vocab_size=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2,
                    "moe_loss_weight": 0.1},
        output_router_logits=router, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        use_cache=False,
    )  # fmt: skip
    return T.DbrxForCausalLM(config)


def _batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from helpers import hf_zoo

    g = torch.Generator().manual_seed(0)
    if kind == "seq2seq":
        return hf_zoo.batches("bart", LENGTHS)
    if kind == "whisper":
        return hf_zoo.batches("whisper", LENGTHS)
    if kind == "ctc":
        return hf_zoo.batches("wav2vec2_ctc", LENGTHS)
    out = []
    for n in LENGTHS:
        if kind in ("image", "image_features"):
            out.append(
                (
                    torch.randn(BATCH, 3, 32, 32, generator=g),
                    torch.randint(0, 5, (BATCH,), generator=g),
                )
            )
        elif kind == "seqcls":
            out.append(
                (
                    torch.randint(2, 64, (BATCH, n), generator=g),
                    torch.randint(0, 3, (BATCH,), generator=g),
                )
            )
        elif kind == "tokcls":
            out.append(
                (
                    torch.randint(2, 64, (BATCH, n), generator=g),
                    torch.randint(0, 3, (BATCH, n), generator=g),
                )
            )
        else:
            ids = torch.randint(2, 64, (BATCH, n), generator=g)
            out.append((ids, ids))
    return out


def _loss(model: Any, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "image":
        return model(pixel_values=x, labels=y).loss  # type: ignore[no-any-return]
    if kind == "image_features":
        return model(pixel_values=x).pooler_output.pow(2).mean()  # type: ignore[no-any-return]
    if kind == "text_features":
        return model(input_ids=x).pooler_output.pow(2).mean()  # type: ignore[no-any-return]
    if kind == "whisper":
        return model(input_features=x, labels=y).loss  # type: ignore[no-any-return]
    if kind == "ctc":
        return model(input_values=x, labels=y).loss  # type: ignore[no-any-return]
    return model(input_ids=x, labels=y).loss  # type: ignore[no-any-return]


def _fit(name: str) -> dict[str, Any]:
    import torch.distributed as dist
    from helpers.models import quiet_trainer
    from lightning.pytorch import LightningModule
    from torch.utils.data import DataLoader

    from lightning_pipe2bw import Pipe2BWStrategy

    torch.set_num_threads(1)
    build, kind = _families()[name]

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = build()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return _loss(self.model, kind, *batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-6)

    module = Module()
    kind_of_model = type(module.model).__name__  # before fit: a model that cannot travel back
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS)
    trainer.fit(module, DataLoader(_batches(kind), batch_size=None))  # type: ignore[arg-type]
    state = strategy.full_state_dict()
    return {"state": state if dist.get_rank() == 0 else None, "class": kind_of_model}


def _reference(name: str) -> dict[str, torch.Tensor]:
    from helpers.hf_models import train_reference

    build, kind = _families()[name]

    def seeded() -> Any:
        torch.manual_seed(0)
        return build()

    state = train_reference(
        seeded, _batches(kind), M, lambda m, x, y: _loss(m, kind, x, y), eps=1e-6
    )
    return {f"model.{k}": v for k, v in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", help="comma-separated names (default: all)")
    parser.add_argument("--out", default=str(RESULTS / "model_zoo.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.families.split(",") if args.families else list(_families())
    pool = RankPool(2)
    rows = []
    try:
        for name in names:
            start = time.perf_counter()
            try:
                result = pool.run(_fit, name, timeout=600)[0]
                ref = _reference(name)
                state = result["state"]
                diff = max((state[k].double() - ref[k].double()).abs().max().item() for k in ref)
                row = {"family": name, "class": result["class"], "max_dw": diff}
            except TaskError as err:
                lines = [
                    line
                    for line in str(err).splitlines()
                    if "Error: " in line and not line.startswith(" ")
                ]
                row = {
                    "family": name,
                    "error": (lines[-1] if lines else err.reason).split("Error: ", 1)[-1],
                }
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            shown = (
                f"max|dW| {row['max_dw']:.1e}"
                if "max_dw" in row
                else f"refused: {row['error'][:150]}"
            )
            print(f"{name}: {shown}", flush=True)
    finally:
        pool.close()
    print("\n| family | class | result (p = 2, m = 4, 5 AdamW steps) |")
    print("| --- | --- | --- |")
    for row in rows:
        if "max_dw" in row:
            result = "exact" if row["max_dw"] == 0 else f"exact, max abs dW {row['max_dw']:.1e}"
            print(f"| {row['family']} | `{row['class']}` | {result} |")
        elif "reference failed" in row:
            print(
                f"| {row['family']} | | (the one-device reference failed: {row['reference failed'][:100]}) |"
            )
        else:
            print(f"| {row['family']} | | refused: {row['error'][:160]} |")
    Path(args.out).write_text(json.dumps({"lengths": LENGTHS, "rows": rows}, indent=2))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()

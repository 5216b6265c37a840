"""A Hugging Face GPT-2 (small config, random weights, no download) trained as it comes, on 2 CPU
processes: the module holds the model and its step calls it; nothing is rewritten for the
pipeline. The embedding tied to the head is kept as one copy per stage (gradients summed).

    python examples/hf_gpt2.py                     # 1F1B, 2 stages (--schedule 2bw: PipeDream-2BW)
    python examples/hf_gpt2.py --schedule 1f1b --steps 40

At the end, rank 0 saves the trained model with ``save_pretrained`` (the keys are GPT-2's) and
reloads it on one device to check it computes the same loss.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_pipe2bw import Pipe2BWStrategy

VOCAB, SEQ = 256, 64


class LitGPT2(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=6, n_head=4,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(n: int = 512) -> DataLoader[Any]:
    """Sequences that count upwards (mod VOCAB) from a random start: easy to learn."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    return DataLoader(TensorDataset((start + torch.arange(SEQ)) % VOCAB), batch_size=16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seed_everything(0)
    module = LitGPT2()
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_model_summary=False,
        strategy=Pipe2BWStrategy(schedule=args.schedule, microbatches=4),
    )  # fmt: skip
    trainer.fit(module, data())
    if trainer.global_rank == 0:  # module.model is the whole trained GPT-2 again
        (ids,) = next(iter(data()))
        with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
            module.model.save_pretrained(folder)
            again = GPT2LMHeadModel.from_pretrained(folder).eval()
            before = module.model.eval()(input_ids=ids, labels=ids).loss
            after = again(input_ids=ids, labels=ids).loss
        print(
            f"loss after {args.steps} steps: {float(before):.4f}; reloaded on one device: {float(after):.4f}"
        )


if __name__ == "__main__":
    main()

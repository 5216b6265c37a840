"""The main job's recipe: a byte-level GPT on the Python standard library, pipelined.

* :mod:`~lightning_pipe2bw.recipes.gpt.model`: the ``GPT`` LightningModule (one ``nn.Sequential``
  body: embeddings, pre-LN blocks, LM head);
* :mod:`~lightning_pipe2bw.recipes.gpt.data`: ``StdlibTextDataModule``;
* :mod:`~lightning_pipe2bw.recipes.gpt.config`: its Hydra structured configs (``configs/``);
* :mod:`~lightning_pipe2bw.recipes.gpt.train`: the Hydra entry point (``make train``, also
  ``python -m lightning_pipe2bw.train``);
* :mod:`~lightning_pipe2bw.recipes.gpt.cli`: the Lightning CLI with the GPT as its default model.
"""

from lightning_pipe2bw.recipes.gpt.data import StdlibTextDataModule
from lightning_pipe2bw.recipes.gpt.model import GPT

__all__ = ["GPT", "StdlibTextDataModule"]

"""The main job's Lightning CLI: ``python -m lightning_pipe2bw.recipes.gpt.cli fit ...`` trains the
GPT with ``Pipe2BWStrategy``.

The library's CLI (``lightning_pipe2bw.cli``, where the strategy's options, names and config
forms are described) with this recipe's GPT and standard-library text data as the defaults, so
that a bare ``fit`` trains the default GPT on the devices given::

    python -m lightning_pipe2bw.recipes.gpt.cli fit --trainer.accelerator=cpu \\
        --trainer.devices=2 --trainer.max_steps=20

GPT is imported here, so its short name resolves too (``--model=GPT``); another model or data
module replaces the default as usual (``--model=my_package.MyModel``).

A bare ``fit`` takes the library's defaults, which are not the main job's: ``Pipe2BWStrategy()``
(1F1B) and the GPT class's own (AdamW at 2e-3). ``examples/cli_gpt.yaml`` trains the main job
the way ``python -m lightning_pipe2bw.train`` does (DualPipeV, ``MuonAdamW`` at 1.6e-2; a test
holds the two to one another): ``--config examples/cli_gpt.yaml``.
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType

from lightning_pipe2bw.cli import Pipe2BWCLI, import_path
from lightning_pipe2bw.cli import main as cli_main
from lightning_pipe2bw.recipes.gpt.data import StdlibTextDataModule
from lightning_pipe2bw.recipes.gpt.model import GPT

__all__ = []


class GPTCLI(Pipe2BWCLI):
    """The library's CLI with the GPT and its data as the default model and data."""

    defaults = {
        "model": {"class_path": import_path(GPT)},
        "data": {"class_path": import_path(StdlibTextDataModule)},
    }


def main(args: ArgsType = None) -> Pipe2BWCLI:
    """Run the CLI on ``args`` (a list of command-line arguments, or a dict), or on ``sys.argv``."""
    return cli_main(args, GPTCLI)


if __name__ == "__main__":
    main()

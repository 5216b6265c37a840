"""The Lightning CLI with ``Pipe2BWStrategy``: ``python -m lightning_pipe2bw.cli fit --model=... ...``.

A ``LightningCLI`` whose default strategy is the pipeline strategy; the model and the data are
the user's (any ``LightningModule`` / ``LightningDataModule``)::

    python -m lightning_pipe2bw.cli fit --model=my_package.MyModel --data=my_package.MyData \\
        --trainer.accelerator=cpu --trainer.devices=2 --trainer.max_steps=20

``Pipe2BWCLI`` is the class to build a CLI of your own on (the main job's, with its GPT as the
default model, is ``lightning_pipe2bw.recipes.gpt.cli``).

The strategy is configured in any of these forms:

* the class with its init arguments (jsonargparse's subclass syntax; the short class name works
  because the class is imported)::

      --trainer.strategy=Pipe2BWStrategy --trainer.strategy.schedule=1f1b \\
          --trainer.strategy.microbatches=4

  or only the options, as the default strategy is already ``Pipe2BWStrategy``:
  ``--trainer.strategy.schedule=1f1b``;
* a registered name (``pipe2bw``, ``pipe2bw_spawn``, ``pipe2bw_<schedule>`` such as
  ``pipe2bw_2bw``), also followed by options: ``--trainer.strategy=pipe2bw_1f1b
  --trainer.strategy.microbatches=4``. On the command line this CLI rewrites such a name into the
  class form with the name's registered arguments (see ``expand_strategy_names``), so the options
  apply and ``--print_config`` lists every option of the strategy;
* a YAML config (``--config run.yaml``) with ``trainer: strategy: {class_path: Pipe2BWStrategy,
  init_args: {schedule: 1f1b}}``. In a config file a registered name is a plain string, which
  takes no options.

``model`` and ``data`` are any ``LightningModule`` / ``LightningDataModule``
(``--model=my_package.MyModel``).

With the default ``start_method="popen"`` the strategy re-runs this process's command line for
ranks 1..n-1 (like ``ddp``), so run the CLI from a shell (``python -m lightning_pipe2bw.cli``).
``main(args=[...])`` from Python needs ``--trainer.strategy.start_method=spawn``: a re-run of
``sys.argv`` would not carry ``args``, and the CLI refuses to start rather than diverge.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from lightning_pipe2bw.compat import SubprocessScriptLauncher
from lightning_pipe2bw.strategy import Pipe2BWStrategy

__all__ = ["Pipe2BWCLI", "expand_strategy_names", "import_path", "main"]

_STRATEGY_KEY = "--trainer.strategy"


def import_path(cls: type) -> str:
    """The dotted name a config gives for ``cls`` (the public one for the strategy)."""
    if cls is Pipe2BWStrategy:
        return "lightning_pipe2bw.Pipe2BWStrategy"  # the public name, as users write it
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_form(name: str) -> str | None:
    """The JSON class form of a registered name of ``Pipe2BWStrategy`` (or a subclass), else None."""
    if name not in StrategyRegistry:
        return None
    entry = StrategyRegistry[name]
    cls = entry["strategy"]
    if not (isinstance(cls, type) and issubclass(cls, Pipe2BWStrategy)):
        return None  # other strategies' names keep Lightning's own resolution
    return json.dumps({"class_path": import_path(cls), "init_args": dict(entry["init_params"])})


def expand_strategy_names(argv: Sequence[str]) -> list[str]:
    """``argv`` with every ``--trainer.strategy NAME`` / ``--trainer.strategy=NAME`` whose NAME is
    a registered name of ``Pipe2BWStrategy`` replaced by the class form with the name's
    registered arguments, e.g. ``pipe2bw_1f1b`` by
    ``{"class_path": "lightning_pipe2bw.Pipe2BWStrategy", "init_args": {"schedule": "1f1b"}}``.

    jsonargparse reads a strategy name as a plain string, to which later
    ``--trainer.strategy.KEY VALUE`` options cannot apply; the class form takes them (a later
    option overrides a registered argument). Other arguments are returned unchanged.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == _STRATEGY_KEY and i + 1 < len(argv):
            form = _class_form(argv[i + 1])
            if form is not None:
                out += [arg, form]
                i += 2
                continue
        elif arg.startswith(_STRATEGY_KEY + "="):
            form = _class_form(arg[len(_STRATEGY_KEY) + 1 :])
            if form is not None:
                out.append(f"{_STRATEGY_KEY}={form}")
                i += 1
                continue
        out.append(arg)
        i += 1
    return out


class Pipe2BWCLI(LightningCLI):
    """``LightningCLI`` with ``Pipe2BWStrategy`` as the default strategy, registered strategy
    names that take options, and a check that the popen launcher can re-run it. ``defaults``
    (``{"model": {"class_path": ...}, ...}``) are set on the parser."""

    _argv: list[str] | None = None  # the command line parsed, when one was
    defaults: dict[str, Any] = {}

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        if self.defaults:
            parser.set_defaults(self.defaults)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        if args is None or isinstance(args, (list, tuple)):
            self._argv = list(sys.argv[1:] if args is None else args)
            self.config = parser.parse_args(expand_strategy_names(self._argv))
        else:  # a dict or Namespace: already the structured (class_path / init_args) form
            super().parse_arguments(parser, args)

    @override
    def after_instantiate_classes(self) -> None:
        self._check_relaunch()

    def _check_relaunch(self) -> None:
        """Refuse a popen launch whose children would parse a different command line."""
        launcher = self.trainer.strategy.launcher
        if not isinstance(launcher, SubprocessScriptLauncher):
            return
        if launcher.num_processes <= 1:
            return  # nothing to start on this node
        if launcher.cluster_environment.creates_processes_externally:
            return  # torchrun or a cluster started every rank; nothing is re-run
        if self._argv == sys.argv[1:]:
            return
        raise ValueError(
            f"the strategy starts ranks 1..{launcher.num_processes - 1} by re-running this "
            f"process's command line, but the arguments were given to main(args=...) and are not "
            f"in sys.argv[1:]={sys.argv[1:]!r}, so those ranks would run another command; start "
            "the workers from this process instead (--trainer.strategy.start_method=spawn, or a "
            "spawn strategy such as pipe2bw_spawn or ddp_spawn), or run "
            "`python -m lightning_pipe2bw.cli ...` from a shell"
        )


def main(args: ArgsType = None, cli: type[Pipe2BWCLI] = Pipe2BWCLI) -> Pipe2BWCLI:
    """Run ``cli`` on ``args`` (a list of command-line arguments, or a dict), or on
    ``sys.argv``."""
    return cli(
        model_class=None,
        datamodule_class=None,
        trainer_defaults={"strategy": {"class_path": import_path(Pipe2BWStrategy)}},
        args=args,
    )


if __name__ == "__main__":
    main()

"""The ``vlfuse`` command: ``fit``, ``validate``, ``test`` (LightningCLI) and vlfuse's own tools."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vlfuse.analysis.analyze import main as analyze_main
from vlfuse.datamodules import VQADataModule
from vlfuse.lit import ExportBestModel, VLFuseLitModule
from vlfuse.predict import main as predict_main
from vlfuse.prune import main as prune_main
from vlfuse.resume import SIGTERM_EXIT_CODE, ResumeTraining, default_checkpoint_dir

USER_ERRORS = (ValueError, FileNotFoundError, KeyError)


class VLFuseCLI(LightningCLI):
    """LightningCLI with a best-model checkpoint, the export of the best model and an optional test."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {"checkpoint.monitor": "val/acc", "checkpoint.mode": "max", "checkpoint.save_last": True}
        )
        parser.add_lightning_class_args(ExportBestModel, "export")
        parser.add_lightning_class_args(ResumeTraining, "resume")
        parser.add_argument(
            "--test_after_fit", type=bool, default=False, help="after fit, test the best checkpoint on the test split"
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        if config.checkpoint.dirpath is None:  # not the logger's new version folder: --ckpt_path last finds it
            config.checkpoint.dirpath = default_checkpoint_dir(config.trainer.default_root_dir)

    def after_fit(self) -> None:
        """With ``test_after_fit``, test the best checkpoint and print one summary line.

        Under DDP every rank runs the test (its collectives need them all) and rank 0 prints.
        """
        if not self.config[self.subcommand].get("test_after_fit"):
            return
        checkpoint = self.trainer.checkpoint_callback
        ckpt_path = "best" if isinstance(checkpoint, ModelCheckpoint) and checkpoint.best_model_path else None
        results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=ckpt_path)
        exporter = next((c for c in self.trainer.callbacks if isinstance(c, ExportBestModel)), None)
        where = exporter.exported_to if exporter else None
        self._print_test_summary(results[0] if results else {}, f"; model saved to {where}")

    def after_test(self) -> None:
        self._print_test_summary(self.trainer.callback_metrics)

    def _print_test_summary(self, metrics: Mapping[str, Any], suffix: str = "") -> None:
        """On rank 0: ``vlfuse: test accuracy 0.9978 (4500 questions)``, metrics reduced over all ranks."""
        if self.trainer.is_global_zero and "test/acc" in metrics:
            accuracy, questions = float(metrics["test/acc"]), int(metrics["test/questions"])
            print(f"vlfuse: test accuracy {accuracy:.4f} ({questions} questions){suffix}")


def run_lightning(args: list[str] | None = None) -> VLFuseCLI:
    """Run a LightningCLI subcommand (``args``, default ``sys.argv``); returns the CLI object."""
    return VLFuseCLI(
        VLFuseLitModule,
        VQADataModule,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "vlfuse"},
    )


def wait_for_other_ranks(trainer: Trainer) -> int:
    """Wait for the processes Lightning started for the other ranks (DDP on one machine: rank 0
    launches them); returns the first non-zero exit code among them, else 0.

    So the command's exit status speaks for every rank, even one that fails after rank 0 finished.
    """
    launcher = getattr(trainer.strategy, "launcher", None)
    codes = [process.wait() for process in getattr(launcher, "procs", [])]
    return next((code for code in codes if code), 0)


# Subcommands implemented by vlfuse itself rather than by LightningCLI: name -> main(argv).
TOOLS: dict[str, Callable[[list[str]], int | None]] = {
    "analyze": analyze_main,
    "predict": predict_main,
    "prune": prune_main,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vlfuse`` command. Set VLFUSE_DEBUG=1 to see tracebacks of user errors."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args and args[0] in TOOLS:
            return TOOLS[args[0]](args[1:]) or 0
        cli = run_lightning(argv)
    except SIGTERMException:
        return SIGTERM_EXIT_CODE  # a checkpoint was saved (ResumeTraining)
    except USER_ERRORS as err:
        if os.environ.get("VLFUSE_DEBUG"):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"vlfuse: error: {message}", file=sys.stderr)
        return 2
    return wait_for_other_ranks(cli.trainer)


if __name__ == "__main__":
    sys.exit(main())

"""``vlfuse fit | validate | test``: Lightning's CLI with vlfuse's checkpoint, export, resume and test summary.

:mod:`vlfuse.cli` dispatches here; this module imports Lightning, so it is loaded only for these
subcommands.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vlfuse.captioning.lit import CaptionLitModule
from vlfuse.commands import LIGHTNING, SUBCOMMANDS
from vlfuse.datamodules import VQADataModule
from vlfuse.lit import ExportBestModel, VLFuseLitModule
from vlfuse.resume import SIGTERM_EXIT_CODE, BestAndLastCheckpoint, ResumeTraining, default_checkpoint_dir
from vlfuse.runtime import set_threads



def smoke_run_dir(default_root_dir: str | None) -> str:
    """``<default_root_dir>/fast_dev_run``: where a ``--trainer.fast_dev_run`` run writes its checkpoints
    and model, so that a smoke run never replaces a real run's."""
    return os.path.join(default_root_dir or os.getcwd(), "fast_dev_run")


class VLFuseCLI(LightningCLI):
    """LightningCLI with a best-model checkpoint, the export of the best model and an optional test."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's ``fit``, ``validate`` and ``test``; ``vlfuse predict`` is vlfuse's own."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in LIGHTNING}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(BestAndLastCheckpoint, "checkpoint")
        parser.set_defaults(
            {"checkpoint.monitor": "val/acc", "checkpoint.mode": "max", "checkpoint.save_last": True}
        )
        parser.add_lightning_class_args(ExportBestModel, "export")
        parser.add_lightning_class_args(ResumeTraining, "resume")
        parser.add_argument(
            "--test_after_fit", type=bool, default=False, help="after fit, test the best checkpoint on the test split"
        )
        parser.add_argument(
            "--threads", type=Optional[int], default=None,
            help="torch CPU threads (default: torch's choice, one per core; the thread count changes the "
            "order of floating-point sums, so compare runs at the same count)",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        set_threads(config.threads)
        root = config.trainer.default_root_dir
        if config.trainer.fast_dev_run:  # a smoke run leaves the real run's checkpoints and model alone
            root = smoke_run_dir(root)
            config.export.dirpath = config.export.dirpath or os.path.join(root, "model")
        if config.checkpoint.dirpath is None:  # not the logger's new version folder: --ckpt_path last finds it
            config.checkpoint.dirpath = default_checkpoint_dir(root)

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
        """On rank 0: ``vlfuse: test accuracy 0.9978 (4500 questions)``, or for a caption model
        ``vlfuse: test BLEU-4 0.9, CIDEr-D 8.1, fact precision 0.9990, object recall 0.9950 (1000 images)``
        (the last two for data with scenes), metrics reduced over all ranks."""
        if not self.trainer.is_global_zero:
            return
        if "test/acc" in metrics:
            accuracy, questions = float(metrics["test/acc"]), int(metrics["test/questions"])
            print(f"vlfuse: test accuracy {accuracy:.4f} ({questions} questions){suffix}")
        elif "test/cider" in metrics:
            names = {"bleu4": "BLEU-4", "cider": "CIDEr-D", "fact_precision": "fact precision", "object_recall": "object recall"}
            scores = ", ".join(f"{label} {float(metrics[f'test/{key}']):.4f}" for key, label in names.items() if f"test/{key}" in metrics)
            print(f"vlfuse: test {scores} ({int(metrics['test/images'])} images){suffix}")


def names_caption_model(args: Sequence[str]) -> bool:
    """Whether a ``--config`` among ``args`` trains a caption model (``model: class_path:
    vlfuse.captioning.lit.CaptionLitModule``, e.g. ``configs/shapes_captions.yaml``). Such a config
    gets a CLI over caption models and any datamodule; every other run, the answering model on a
    :class:`~vlfuse.datamodules.VQADataModule` (whose configs need no ``class_path`` for the model)."""
    paths = [value for flag, value in zip(args, args[1:]) if flag == "--config"]
    paths += [arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")]
    for path in paths:
        try:
            model = yaml.safe_load(Path(path).read_text()).get("model")
        except (OSError, yaml.YAMLError, AttributeError):
            continue  # Lightning's parser says what is wrong with the file
        if isinstance(model, dict) and str(model.get("class_path", "")).startswith(CaptionLitModule.__module__):
            return True
    return False


def run_lightning(args: list[str] | None = None) -> VLFuseCLI:
    """Run a LightningCLI subcommand (``args``, default ``sys.argv``); returns the CLI object.

    Raises:
        argparse.ArgumentError: a mistake in the arguments or the config (the usage is not printed).
    """
    own = {name: {"exit_on_error": False, "description": SUBCOMMANDS[name].description} for name in LIGHTNING}
    caption = names_caption_model(sys.argv[1:] if args is None else args)
    return VLFuseCLI(
        CaptionLitModule if caption else VLFuseLitModule,
        LightningDataModule if caption else VQADataModule,
        subclass_mode_model=caption,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "vlfuse", "exit_on_error": False, **own},
    )


def wait_for_other_ranks(trainer: Trainer) -> int:
    """Wait for the processes Lightning started for the other ranks (DDP on one machine: rank 0
    launches them); returns the first non-zero exit code among them, else 0.

    So the command's exit status speaks for every rank, even one that fails after rank 0 finished.
    """
    launcher = getattr(trainer.strategy, "launcher", None)
    codes = [process.wait() for process in getattr(launcher, "procs", [])]
    return next((code for code in codes if code), 0)


def main(args: list[str] | None = None) -> int:
    """``vlfuse fit | validate | test`` (``args``, default ``sys.argv``): the exit status of every rank
    (see :func:`wait_for_other_ranks`)."""
    try:
        cli = run_lightning(args)
    except SIGTERMException:
        return SIGTERM_EXIT_CODE  # a checkpoint was saved (ResumeTraining)
    return wait_for_other_ranks(cli.trainer)

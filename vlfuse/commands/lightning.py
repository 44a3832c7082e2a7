"""``vlfuse fit | validate | test``: Lightning's CLI with vlfuse's checkpoint, export, resume and test summary,
run folders (:mod:`vlfuse.runs`) and atomic checkpoints (:mod:`vlfuse.checkpoint_io`).

:mod:`vlfuse.cli` dispatches here; this module imports Lightning, so it is loaded only for these
subcommands.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml
from jsonargparse import Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vlfuse import model_card, runs
from vlfuse.callbacks import EpochSummary
from vlfuse.captioning.lit import CaptionLitModule
from vlfuse.checkpoint_io import AtomicCheckpointIO
from vlfuse.commands import LIGHTNING, SUBCOMMANDS
from vlfuse.commands.help_format import USAGE, ShortTrainerHelpFormatter
from vlfuse.datamodules import VQADataModule
from vlfuse.lit import ExportBestModel, VLFuseLitModule
from vlfuse.resume import SIGTERM_EXIT_CODE, BestAndLastCheckpoint, ResumeTraining, best_checkpoint, default_checkpoint_dir
from vlfuse.runtime import set_threads


def smoke_run_dir(default_root_dir: str | None) -> str:
    """``<default_root_dir>/fast_dev_run``: the root of ``--trainer.fast_dev_run`` runs, whose run folders
    (``fast_dev_run/version_N``, ``fast_dev_run/latest``) are apart from the real runs'."""
    return os.path.join(default_root_dir or os.getcwd(), "fast_dev_run")


def same_path(a: str | os.PathLike | None, b: str | os.PathLike) -> bool:
    """Whether ``a`` names the folder ``b``."""
    return a is not None and os.path.abspath(a) == os.path.abspath(b)


def logs_in_run(logger: Any, root: str) -> bool:
    """Whether ``logger`` (a config's ``trainer.logger`` entry) is a CSV or TensorBoard logger saving
    under ``root`` with Lightning's default name and version: the run folder then replaces them."""
    if not isinstance(logger, Namespace) or not isinstance(logger.get("class_path"), str):
        return False
    module, _, name = logger.class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    args = logger.get("init_args") or Namespace()
    return (
        isinstance(cls, type) and issubclass(cls, (CSVLogger, TensorBoardLogger))
        and args.get("name") == "lightning_logs" and args.get("version") is None and same_path(args.get("save_dir"), root)
    )


def log_into(loggers: Any, log_dir: Path, root: str) -> None:
    """Point the CSV and TensorBoard loggers of ``loggers`` that :func:`logs_in_run` accepts at ``log_dir``
    (``save_dir`` its parent, no name, version its name); others are left as they are."""
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if logs_in_run(logger, root):
            logger.init_args.save_dir, logger.init_args.name, logger.init_args.version = str(log_dir.parent), "", log_dir.name


def place_fit(config: Namespace, run: runs.Run) -> None:
    """Send a fit's checkpoints and model to its run folder unless ``--checkpoint.dirpath`` and
    ``--export.dirpath`` say otherwise."""
    config.checkpoint.dirpath = config.checkpoint.dirpath or default_checkpoint_dir(run.folder)
    config.export.dirpath = config.export.dirpath or str(run.folder / "model")


def place_evaluation(config: Namespace, run: runs.Run) -> None:
    """Let ``--ckpt_path last|best`` of ``validate`` or ``test`` name the run's checkpoints (the latest
    run's, or ``--run_dir``'s), unless ``--checkpoint.dirpath`` names a folder.

    Raises:
        ValueError: ``--ckpt_path best`` and no best checkpoint is known.
    """
    if config.ckpt_path not in ("last", "best"):
        return
    folder = config.checkpoint.dirpath or (default_checkpoint_dir(run.folder) if run.folder else None)
    config.checkpoint.dirpath = folder
    if config.ckpt_path == "last":
        return
    best = best_checkpoint(Path(folder)) if folder else None
    if best is None:
        raise ValueError(f"--ckpt_path best: no best checkpoint recorded in {folder or 'any run (no latest run yet)'}")
    config.ckpt_path = str(best)


def with_atomic_checkpoints(plugins: Any, strategy: Any) -> list:
    """``plugins`` (the trainer's, instantiated) with an :class:`AtomicCheckpointIO` added, unless they or
    the strategy bring a CheckpointIO of their own."""
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
    own = any(isinstance(plugin, CheckpointIO) for plugin in plugins) or getattr(strategy, "_checkpoint_io", None)
    return plugins if own else [*plugins, AtomicCheckpointIO()]


def announce(run: runs.Run) -> None:
    """``vlfuse: run folder runs/easy_vqa/version_3``, and where a continued run's new part logs."""
    part = f" (continued; this part's logs in {run.log_dir})" if run.log_dir != run.folder else ""
    print(f"vlfuse: run folder {run.folder}{part}", flush=True)


class VLFuseCLI(LightningCLI):
    """LightningCLI with a best-model checkpoint, the export of the best model and an optional test, a
    run folder for each fit and atomic checkpoints."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's ``fit``, ``validate`` and ``test``; ``vlfuse predict`` is vlfuse's own."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in LIGHTNING}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(BestAndLastCheckpoint, "checkpoint")
        parser.set_defaults(
            {"checkpoint.monitor": "val/acc", "checkpoint.mode": "max", "checkpoint.save_last": True,
             # in a log file a bar's frames are noise: the epoch lines of --progress are the progress there
             "trainer.enable_progress_bar": sys.stderr.isatty()}
        )
        parser.add_lightning_class_args(ExportBestModel, "export")
        parser.add_lightning_class_args(ResumeTraining, "resume")
        parser.add_lightning_class_args(EpochSummary, "progress")  # --progress.lines false, --progress.curves false
        parser.add_argument(
            "--test_after_fit", type=bool, default=False, help="after fit, test the best checkpoint on the test split"
        )
        parser.add_argument(
            "--threads", type=Optional[int], default=None,
            help="torch CPU threads (default: torch's choice, one per core; the thread count changes the "
            "order of floating-point sums, so compare runs at the same count). Waiting threads sleep "
            "(OMP_WAIT_POLICY=PASSIVE unless the environment sets it), so other jobs on the cores slow a run "
            "down without stalling it",
        )
        parser.add_argument(
            "--run_dir", type=Optional[str], default=None,
            help="fit: the run folder for checkpoints, model and logs (default: <trainer.default_root_dir>/version_N, "
            "the next free N; under torchrun or srun, <trainer.default_root_dir>/job_<job id>); validate, test: the "
            "run whose checkpoints --ckpt_path last|best means (default: <trainer.default_root_dir>/latest)",
        )

    def parse_arguments(self, parser, args) -> None:
        """Lightning's, keeping the command line for the model card (:attr:`command`)."""
        given = sys.argv[1:] if args is None else args
        self.command = f"vlfuse {shlex.join(map(str, given))}" if isinstance(given, (list, tuple)) else None
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        set_threads(self.config[self.subcommand].threads)

    def instantiate_classes(self) -> None:
        """Choose this run's folders and send its files there (:meth:`place_run`), then Lightning's
        instantiation and, for a fit, the check of its data (:meth:`check_splits`); a failure in any
        leaves no empty folder behind."""
        self.run: runs.Run | None = None
        try:
            self.place_run(self.config[self.subcommand])
            super().instantiate_classes()
            self.check_splits(self.config[self.subcommand])
        except BaseException:
            if self.run is not None:
                runs.release(self.run, self.run_root)
            raise

    def check_splits(self, config: Namespace) -> None:
        """Before a fit trains: have a VQA datamodule load every split the fit will read, the test split
        too with ``test_after_fit`` (:meth:`~vlfuse.datamodules.VQADataModule.check_splits`), so that a
        missing or bad one stops the run before its first step."""
        if self.subcommand == "fit" and isinstance(self.datamodule, VQADataModule):
            self.datamodule.check_splits(["fit", "test"] if config.get("test_after_fit") else ["fit"])

    def place_run(self, config: Namespace) -> None:
        """Choose this run's folders (:func:`vlfuse.runs.choose`) and send the checkpoints, the model, the
        logs and the trainer's ``default_root_dir`` there; the config as given is kept for ``config.yaml``."""
        self.config_as_given = config.clone()
        root = config.trainer.default_root_dir or os.getcwd()
        self.run_root = Path(smoke_run_dir(root) if config.trainer.fast_dev_run else root)  # smoke runs apart
        self.run = run = runs.choose(self.subcommand, self.run_root, run_dir=config.run_dir, ckpt_path=config.ckpt_path)
        if run.leader:
            runs.share_with_other_ranks(run)
        if self.subcommand == "fit":
            place_fit(config, run)
        else:
            place_evaluation(config, run)
        log_into(config.trainer.logger, run.log_dir, root)
        config.trainer.default_root_dir = str(run.log_dir)

    def before_fit(self) -> None:
        """On rank 0, now that the run starts: print its folder and point ``latest`` at it."""
        if self.run.leader:
            announce(self.run)
            runs.point_latest(self.run_root, self.run.folder)
        exporter = self.exporter()
        if exporter is not None:  # the model card's command, config and seed
            config = yaml.safe_load(self._parser(self.subcommand).dump(self.config_as_given, skip_none=False))
            seed = os.environ.get("PL_GLOBAL_SEED")
            exporter.run = model_card.RunRecord(command=self.command, seed=int(seed) if seed else None, config=config)

    def exporter(self) -> ExportBestModel | None:
        """The trainer's :class:`ExportBestModel`, if it has one."""
        return next((c for c in self.trainer.callbacks if isinstance(c, ExportBestModel)), None)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's trainer with :class:`AtomicCheckpointIO` among its plugins (see
        :func:`with_atomic_checkpoints`), whose ``config.yaml`` is the config as given: without the run
        folder's paths, so that a run started from it gets a folder of its own."""
        settings = self.config_init[self.subcommand].trainer
        plugins = with_atomic_checkpoints(settings.plugins, settings.strategy)
        placed = self.config[self.subcommand]
        self.config[self.subcommand] = self.config_as_given
        try:
            return super().instantiate_trainer(plugins=plugins, **kwargs)
        finally:
            self.config[self.subcommand] = placed

    def after_fit(self) -> None:
        """With ``test_after_fit``, test the best checkpoint and print one summary line.

        Under DDP every rank runs the test (its collectives need them all) and rank 0 prints.
        """
        if not self.config[self.subcommand].get("test_after_fit"):
            return
        checkpoint = self.trainer.checkpoint_callback
        ckpt_path = "best" if isinstance(checkpoint, ModelCheckpoint) and checkpoint.best_model_path else None
        results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=ckpt_path)
        exporter = self.exporter()
        where = exporter.exported_to if exporter else None
        if where is not None and results and self.trainer.is_global_zero:  # the card gains the test metrics
            note = "best checkpoint" if ckpt_path else "final weights"
            splits = model_card.describe_data(self.datamodule, ["test"])["splits"] if hasattr(self.datamodule, "records") else None
            model_card.add_metrics(where, model_card.metrics_of(results[0], "test", self.command, note), splits)
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
    own = {
        name: {"exit_on_error": False, "description": SUBCOMMANDS[name].description, "usage": USAGE}
        for name in LIGHTNING
    }
    caption = names_caption_model(sys.argv[1:] if args is None else args)
    try:
        return VLFuseCLI(
            CaptionLitModule if caption else VLFuseLitModule,
            LightningDataModule if caption else VQADataModule,
            subclass_mode_model=caption,
            subclass_mode_data=True,
            args=args,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "vlfuse", "exit_on_error": False, "formatter_class": ShortTrainerHelpFormatter, **own},
        )
    finally:
        runs.forget_shared()  # the other ranks have started (and inherited them)


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

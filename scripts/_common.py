"""What the scripts share: a saved or untrained model, a config's datamodule, the CPU threads.

Every failure is one line naming the argument (``error: --model runs/x: ...``) and exit status 1.
Scripts import this module as ``_common``: Python puts a script's own folder first on its path
(the tests add ``scripts/`` to theirs, see pyproject.toml).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from vlfuse import runtime
from vlfuse.model import VLFuseConfig, VLFuseModel

if TYPE_CHECKING:  # the datamodules import lightning: only the functions that read a config load them
    from vlfuse.datamodules import VQADataModule

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "easy_vqa.yaml"


def add_model_argument(parser: argparse.ArgumentParser, *, required: bool = True, help: str | None = None) -> None:
    """``--model DIR``: a saved model directory; read it with :func:`load_model` or :func:`saved_or_untrained_model`."""
    parser.add_argument("--model", type=Path, required=required, metavar="DIR",
                        help=help or "a directory written by save_pretrained")


def load_model(model_dir: str | Path) -> VLFuseModel:
    """The model saved in ``model_dir`` by ``save_pretrained``, in eval mode.

    Raises:
        SystemExit: ``model_dir`` holds no loadable model (one line naming ``--model``).
    """
    try:
        return VLFuseModel.from_pretrained(model_dir).eval()
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: --model {model_dir}: {err}") from None


def load_datamodule(config: str | Path, overrides: Sequence[str] = ()) -> VQADataModule:
    """The datamodule of a ``vlfuse fit`` config's ``data:`` section, with ``--data.*`` overrides.

    Raises:
        SystemExit: the config is missing or its data section is not a datamodule (one line naming ``--config``).
    """
    from vlfuse.analysis.data import build_datamodule

    try:
        return build_datamodule(config, overrides)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: --config {config}: {err}") from None


def untrained_model(config: str | Path, datamodule: VQADataModule) -> VLFuseModel:
    """The config's ``model.architecture``, built with seed 0, with the datamodule's answers and a
    tokenizer from its training questions (for speed, where the weights do not matter).

    The datamodule gets the model's image size, as ``vlfuse fit`` gives it.

    Raises:
        SystemExit: the config has no ``model.architecture`` (one line naming ``--config``).
    """
    from vlfuse.analysis.data import read_config

    try:
        architecture = VLFuseConfig.from_dict(read_config(config)["model"]["architecture"])
    except (KeyError, TypeError, ValueError) as err:
        raise SystemExit(f"error: --config {config}: no usable model.architecture ({err!r})") from None
    datamodule.image_size = architecture.image.image_size
    torch.manual_seed(0)
    return VLFuseModel.from_config(architecture, datamodule.answers, datamodule.train_questions)


def saved_or_untrained_model(
    model_dir: Path | None, config: str | Path, datamodule: VQADataModule | None = None
) -> VLFuseModel:
    """:func:`load_model` of ``model_dir`` when given, else :func:`untrained_model` of ``config`` (with
    ``datamodule``, default: the config's), in eval mode."""
    if model_dir is not None:
        return load_model(model_dir)
    return untrained_model(config, datamodule or load_datamodule(config)).eval()


def add_timing_arguments(parser: argparse.ArgumentParser, *, repeats: int, warmup: int) -> None:
    """``--repeats N`` timed and ``--warmup N`` untimed repetitions (see :mod:`vlfuse.analysis.timing`)."""
    parser.add_argument("--repeats", type=int, default=repeats, metavar="N",
                        help=f"timed repetitions of every case, side by side (default {repeats})")
    parser.add_argument("--warmup", type=int, default=warmup, metavar="N",
                        help=f"untimed repetitions first (default {warmup})")


def add_threads_argument(parser: argparse.ArgumentParser, default: int | None = runtime.DEFAULT_THREADS) -> None:
    """``--threads N``: torch's CPU threads (default :data:`vlfuse.runtime.DEFAULT_THREADS`); read it with :func:`set_threads`."""
    runtime.add_threads_argument(parser, default)


def set_threads(count: int | None) -> None:
    """Use ``count`` CPU threads in torch (``None``: leave torch's choice).

    Raises:
        SystemExit: ``count`` is below 1 (one line naming ``--threads``).
    """
    try:
        runtime.set_threads(count)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None

"""One line for the errors users meet at the edges of a run.

:func:`error_line` turns the exceptions that Lightning, torch, jsonargparse and the loggers raise
for a user's mistake (a GPU asked for on a machine without one, a logger whose package is not
installed, an EarlyStopping monitor that names no logged metric, a value rejected inside one of
jsonargparse's Union dumps) into the line ``vlfuse`` prints. Exceptions are recognised by name
and message, so that importing this module (from :mod:`vlfuse.cli`) loads neither torch nor
Lightning.
"""

from __future__ import annotations

import argparse
import re

UNION_DUMP = "Does not validate against any of the Union subtypes"
"""The first line of jsonargparse's error for a value that no type of a Union accepts."""

TENSORBOARD_MISSING = (
    "TensorBoardLogger needs the tensorboard package, which is not installed: pip install 'vlfuse[tensorboard]' "
    "(or log to CSV: --trainer.logger lightning.pytorch.loggers.CSVLogger)"
)

NO_GPU_MARKERS = (
    "No supported gpu backend found",
    "CUDAAccelerator` can not run on your system",
    "Found no NVIDIA driver",
    "Torch not compiled with CUDA enabled",
    "no CUDA GPUs are available",
)

MISSING_METRIC = {
    "EarlyStopping": re.compile(r"conditioned on metric `(?P<monitor>[^`]*)` which is not available.*following: (?P<names>.*)$"),
    "ModelCheckpoint": re.compile(r"ModelCheckpoint\(monitor='(?P<monitor>[^']*)'\)` could not find the monitored key in the "
                                  r"returned metrics: \[(?P<names>[^\]]*)\]"),
}
"""Lightning's errors for a callback's monitor that names no logged metric: the monitor and the logged names."""


MOVED_OPTIONS = {
    "fusion_depth": "fuser.depth",
    "fusion_heads": "fuser.heads",
    "mlp_ratio": "fuser.mlp_ratio",
    "mlp_type": "fuser.mlp",
    "dropout": "fuser.dropout and head.dropout",
    "attn_dropout": "fuser.attn_dropout",
    "text_self_attention": "fuser.self_attention",
    "gated": "fuser.gated",
    "attention_normalizer": "fuser.normalizer",
    "diversity_weight": "fuser.diversity_weight",
    "output_gate": "fuser.output_gate",
    "readout": "head.type (pool: pooled; bilinear), or fuser.type map_program, cell_steps or cell_moves with head.type existence",
}
"""The flat model options of configs written before the model became parts (issue 30), and where each went."""


def moved_option(message: str) -> str | None:
    """The line for a config that sets a flat model option of before issue 30 (``model.architecture.fusion_depth``),
    saying where it went; ``None`` for another message."""
    match = re.search(r"architecture\.(\w+)", message)
    if match is None or match.group(1) not in MOVED_OPTIONS:
        return None
    name = match.group(1)
    return (
        f"model.architecture.{name} is an option of the model's parts now: model.architecture.{MOVED_OPTIONS[name]} "
        "(docs/training.md#the-models-options)"
    )


UNSAFE_GLOBAL = re.compile(r"Unsupported global: GLOBAL (?P<name>[\w.]+)")
"""torch's ``weights_only`` refusal of a pickled object, naming its class."""


def unreadable_checkpoint(err: BaseException, subcommand: str) -> str | None:
    """The line for a checkpoint that ``torch.load(weights_only=True)`` refuses (it would run code
    to unpickle it) or cannot read (damaged, truncated); ``None`` for another error."""
    message = str(err)
    option = "--ckpt_path" if subcommand in ("fit", "validate", "test") else "the checkpoint"
    if type(err).__name__ == "UnpicklingError":
        if match := UNSAFE_GLOBAL.search(message):
            return (
                f"{option}: the checkpoint holds a Python object ({match['name']}) that loading it would have to run "
                "code for; vlfuse reads checkpoints with torch.load(weights_only=True) only: give one written by vlfuse fit"
            )
        reason = message.split("WeightsUnpickler error:", 1)[-1]
        return f"{option}: not a checkpoint torch can read ({first_line(ValueError(reason))})"
    if "PytorchStreamReader failed" in message:
        return f"{option}: the checkpoint is damaged or truncated ({first_line(err).split('. ')[0]})"
    return None


def unwrap_union(err: BaseException) -> BaseException:
    """The error inside a jsonargparse Union dump (e.g. ``batch_size must be at least 1`` raised by
    the class that the dump tried to build); ``err`` itself when it is not a dump, or when the
    dump holds nothing but the types it expected (the caller says what was expected)."""
    if not any(UNION_DUMP in str(e) for e in chain(err)):
        return err
    inner = chain(err)[-1]
    return err if UNION_DUMP in str(inner) or str(inner).startswith("Expected a") else inner


def chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes (``raise ... from``), outermost first."""
    errors = [err]
    while errors[-1].__cause__ is not None:
        errors.append(errors[-1].__cause__)
    return errors


def no_gpu(subcommand: str) -> str:
    """The line for a GPU asked for on a machine where torch finds none."""
    option = "--trainer.accelerator" if subcommand in ("fit", "validate", "test") else "--device"
    fix = "--trainer.accelerator cpu (or auto)" if option == "--trainer.accelerator" else "--device cpu"
    return f"{option}: no GPU on this machine (torch.cuda.is_available() is False); use {fix}"


def missing_metric(message: str) -> str | None:
    """EarlyStopping's or ModelCheckpoint's error for a monitor that names no logged metric, as one
    line listing the logged names; ``None`` for another message."""
    for callback, pattern in MISSING_METRIC.items():
        if match := pattern.search(" ".join(message.split())):
            names = ", ".join(name.strip("`' ") for name in match["names"].split(","))
            return f"{callback} monitor {match['monitor']!r} is not a logged metric; the logged metrics are: {names}"
    return None


def message_lines(message: str) -> list[str]:
    """The non-empty lines of ``message``, stripped."""
    return [line.strip() for line in message.strip().splitlines() if line.strip()]


def first_line(err: BaseException) -> str:
    """The first non-empty line of ``err``'s message, or its type's name when it has none."""
    lines = message_lines(str(err))
    return lines[0].rstrip(":") if lines else type(err).__name__


def one_line(err: BaseException, subcommand: str, args: list[str]) -> str:
    """The message of a user error (``ValueError``, ``FileNotFoundError``, ``KeyError``, a parser's
    ``ArgumentError``) on one line; a missing dataset says which config to give."""
    message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    if isinstance(err, argparse.ArgumentError) and f"{subcommand}.data" in message and "--config" not in args:
        return "no data given: give --config configs/easy_vqa.yaml (or any config in configs/)"
    lines = message_lines(message)
    if not lines:
        return type(err).__name__
    given = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Given value:")]
    expected = [match.group(1) for line in lines if (match := re.match(r"- Expected an? <class '(\w+)'>", line))]
    first = lines[0].rstrip(":")
    if given:  # jsonargparse: 'Parser key "trainer.max_epochs":' then the types tried, one per line
        wanted = f", expected {' or '.join(expected)}" if expected else ""
        return f"{first}: invalid value {given[0]!r}{wanted}"
    return first + (" (VLFUSE_DEBUG=1 shows the details)" if len(lines) > 1 else "")


def error_line(err: BaseException, subcommand: str) -> str | None:
    """The one line for a known error at the edges of a run, or ``None`` when ``err`` is not one.

    Args:
        err: the exception that ended the subcommand.
        subcommand: e.g. ``fit`` or ``predict`` (a missing GPU is named by the option it came from).
    """
    inner = unwrap_union(err)
    message = str(inner)
    if any(marker in message for marker in NO_GPU_MARKERS):
        return no_gpu(subcommand)
    if isinstance(inner, ImportError) and "tensorboard" in message:
        return TENSORBOARD_MISSING
    if line := missing_metric(message):
        return line
    if line := moved_option(message):
        return line
    if line := unreadable_checkpoint(inner, subcommand):
        return line
    if inner is not err:
        return first_line(inner)
    return None

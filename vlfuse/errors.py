"""One line for the errors users meet at the edges of a run.

:func:`error_line` turns the exceptions that Lightning, torch, jsonargparse and the loggers raise
for a user's mistake (a GPU asked for on a machine without one, a logger whose package is not
installed, an EarlyStopping monitor that names no logged metric, a value rejected inside one of
jsonargparse's Union dumps) into the line ``vlfuse`` prints. Exceptions are recognised by name
and message, so that importing this module (from :mod:`vlfuse.cli`) loads neither torch nor
Lightning.
"""

from __future__ import annotations

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


def first_line(err: BaseException) -> str:
    """The first non-empty line of ``err``'s message, or its type's name when it has none."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0].rstrip(":") if lines else type(err).__name__


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
    if inner is not err:
        return first_line(inner)
    return None

"""Where the commands, the predictor and the scripts run: one ``--device`` and one ``--threads`` option.

``--device`` is a torch device (``cpu``, ``cuda``, ``cuda:1``), ``cpu`` by default in every command.

``--threads`` is torch's CPU thread count. torch starts one thread per core. On a machine whose cores are shared with other processes, a
thread that waits for a busy core stalls every other one at each synchronisation: issue 14
measured ``Predictor.predict`` 33x slower with 2 threads than with 1 on a loaded 2-core machine,
and ``scripts/bench_predict.py --threads 1 2 --busy 2`` measures it again (docs/results.md#threads).
One thread loses little on an idle machine and never collapses on a loaded one, so it is the default.

``vlfuse fit`` keeps torch's thread count (its runs are then the same on every machine with that many
cores) and instead makes OpenMP's threads sleep as soon as they wait (:func:`prefer_passive_waits`):
``scripts/bench_threads_under_load.py`` measured ``fit`` 4.1x slower than its best beside two other
trainings with OpenMP's default waits, 1.02x with passive ones, at 1.04-1.09x on an idle machine
(docs/results.md#threads-under-load).
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from typing import Iterator

DEFAULT_DEVICE = "cpu"
"""The default of ``--device`` in ``vlfuse predict``, ``analyze`` and ``prune``, as of ``Predictor``."""
DEFAULT_THREADS = 1
"""The default of ``--threads`` and of ``Predictor(threads=...)``: see the module docstring."""
WAIT_POLICY = "OMP_WAIT_POLICY"


def prefer_passive_waits() -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets a policy: OpenMP threads that wait
    for the others sleep at once instead of spinning on a core, which another process may need.

    OpenMP reads it when torch is imported, so this must run first (:func:`vlfuse.cli.main` calls it
    before any subcommand imports torch); it changes no result, only how waiting threads wait.
    """
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")


def add_device_argument(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--device D``: the torch device to run on (default :data:`DEFAULT_DEVICE`); ``note`` ends its help."""
    parser.add_argument("--device", default=DEFAULT_DEVICE, metavar="D",
                        help=f"torch device: cpu, cuda, cuda:1, ... (default {DEFAULT_DEVICE}){note}")


def lightning_accelerator(device: str) -> tuple[str, list[int] | int]:
    """Lightning's ``(accelerator, devices)`` for a torch device: ``"cuda:1"`` -> ``("gpu", [1])``."""
    import torch

    where = torch.device(device)
    if where.type == "cuda":
        return "gpu", [where.index or 0]
    return where.type, 1


def add_threads_argument(parser: argparse.ArgumentParser, default: int | None = DEFAULT_THREADS) -> None:
    """``--threads N``: torch's CPU threads for the command (default :data:`DEFAULT_THREADS`)."""
    shown = "torch's choice, one per core" if default is None else default
    parser.add_argument(
        "--threads", type=int, default=default, metavar="N",
        help=f"torch CPU threads (default {shown}; 1 stays fast when other processes share the cores)",
    )


def check_threads(threads: int | None, name: str = "--threads") -> None:
    """Raise a one-line ``ValueError`` naming ``name`` unless ``threads`` is ``None`` or at least 1."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise ValueError(f"{name} must be a whole number, got {threads!r}")
    if threads < 1:
        raise ValueError(f"{name} must be at least 1, got {threads}")


def set_threads(threads: int | None, name: str = "--threads") -> None:
    """Use ``threads`` CPU threads in torch from now on (``None``: leave torch's setting)."""
    check_threads(threads, name)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


@contextmanager
def using_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` CPU threads in torch (``None``: as they are), then restore the count."""
    import torch

    before = torch.get_num_threads()
    set_threads(threads, "threads")
    try:
        yield
    finally:
        torch.set_num_threads(before)

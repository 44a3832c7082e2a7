"""``vlfuse fit`` on an idle machine and on one running other trainings, at several thread settings.

Each trial is the command a user types, shrunk to a fixed amount of work (by default the README's
main command on 200 images for 2 epochs, without the test), in a fresh process, timed from start
to end. A load of N is N other ``vlfuse fit`` processes of the default config, started before the
trials and running all through them, each with torch's default threads. By default they wait as any
torch program does (``--load-waits default``: another user's training); ``--load-waits vlfuse``
starts them as the ``vlfuse`` command does, with its passive waits (the same user's other runs).
In every repetition each setting runs once, in a rotating order, so that the load falls on all
alike; the table gives the median wall time per setting and load, and each setting's ratio to the
best setting at that load (median of paired ratios).

    .venv/bin/python scripts/bench_threads_under_load.py --loads 0 2 --repeats 3
    .venv/bin/python scripts/bench_threads_under_load.py --full --loads 0 2 --repeats 2 --settings "vlfuse's default" --load-waits vlfuse

A setting (:data:`SETTINGS`) is how the trial starts and the environment and options it gets:
``passive waits`` is ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP threads sleep at once when they wait,
instead of spinning on a core first); ``OpenMP's default waits`` imports torch before vlfuse so
that vlfuse cannot choose; ``vlfuse's default`` is the command as a user types it.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO

from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import paired_ratio

TORCH_FIRST = ["-c", "import sys, torch; from vlfuse.cli import main; sys.exit(main(sys.argv[1:]))"]
"""Starts ``vlfuse`` with torch imported before vlfuse can choose OpenMP's wait policy: a process that
waits as any torch program does (OpenMP's default), as the other trainings of a load do."""
VLFUSE = ["-m", "vlfuse.cli"]
"""Starts ``vlfuse`` as its command does."""
LOAD_WAITS = {"default": TORCH_FIRST, "vlfuse": VLFUSE}
"""``--load-waits``: how the other trainings of a load start (:data:`TORCH_FIRST` or :data:`VLFUSE`)."""

SETTINGS: dict[str, tuple[list[str], dict[str, str], list[str]]] = {
    "OpenMP's default waits, torch's threads": (TORCH_FIRST, {}, []),
    "passive waits, torch's threads": (VLFUSE, {"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "OpenMP's default waits, 1 thread": (TORCH_FIRST, {}, ["--threads", "1"]),
    "vlfuse's default": (VLFUSE, {}, []),
    "spin 1000 then sleep, torch's threads": (TORCH_FIRST, {"GOMP_SPINCOUNT": "1000"}, []),
    "spin 10000 then sleep, torch's threads": (TORCH_FIRST, {"GOMP_SPINCOUNT": "10000"}, []),
    "spin 100000 then sleep, torch's threads": (TORCH_FIRST, {"GOMP_SPINCOUNT": "100000"}, []),
}
"""``{name: (how Python starts vlfuse, environment, extra options)}``; ``OMP_WAIT_POLICY`` is unset
unless the environment gives it; ``spin N then sleep`` sets GNU OpenMP's ``GOMP_SPINCOUNT`` (how many
times a waiting thread polls before it sleeps; 300000 by default)."""


WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""The environment variables that set how OpenMP's threads wait: a trial has only those its setting gives."""


def fit_command(root: Path, images: int | None, epochs: int | None, extra: list[str]) -> list[str]:
    """The arguments of the README's main command on ``images`` images for ``epochs`` epochs (``None``: the config's,
    with its test), writing under ``root``."""
    shrink = [] if images is None else [f"--data.init_args.limit_images={images}", "--test_after_fit=false"]
    shrink += [] if epochs is None else [f"--trainer.max_epochs={epochs}"]
    return [
        "fit", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *shrink,
        f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}",
        "--trainer.enable_progress_bar=false", *extra,
    ]


def environment(changes: dict[str, str]) -> dict[str, str]:
    """This process's environment without ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT``, then with ``changes``."""
    env = {name: value for name, value in os.environ.items() if name not in WAIT_SETTINGS}
    return {**env, **changes}


def start_load(count: int, scratch: Path, entry: list[str]) -> list[subprocess.Popen]:
    """``count`` other trainings of the default config (torch's threads), started by ``entry``, running until stopped."""
    processes = []
    for index in range(count):
        command = [sys.executable, *entry, *fit_command(scratch / f"load_{index}", 2000, 1000, [])]
        processes.append(subprocess.Popen(command, env=environment({}), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
    return processes


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def trial(name: str, scratch: Path, images: int | None, epochs: int | None) -> float:
    """Seconds of one fit with setting ``name``."""
    entry, changes, extra = SETTINGS[name]
    start = time.perf_counter()
    subprocess.run([sys.executable, *entry, *fit_command(scratch / "trial", images, epochs, extra)], env=environment(changes), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, nargs="+", default=[0, 2], metavar="N", help="other trainings running (default 0 2)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="trials of every setting per load (default 3)")
    parser.add_argument("--images", type=int, default=200, help="training images (default 200)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default 2)")
    parser.add_argument("--full", action="store_true", help="the README's main command as it is: every image, "
                        "the config's 10 epochs and the test (instead of --images and --epochs)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), metavar="NAME",
                        help=f"settings to compare (default all: {'; '.join(SETTINGS)})")
    parser.add_argument("--load-waits", choices=list(LOAD_WAITS), default="default",
                        help="how the other trainings wait: as any torch program (default) or as vlfuse's runs (passive)")
    args = parser.parse_args(argv)
    if args.full:
        args.images = args.epochs = None
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        for load in args.loads:
            others = start_load(load, scratch, LOAD_WAITS[args.load_waits])
            try:
                time.sleep(15 if load else 0)  # the others past their start-up, training
                samples: dict[str, list[float]] = {name: [] for name in args.settings}
                for repetition in range(args.repeats):
                    shift = repetition % len(args.settings)
                    for name in args.settings[shift:] + args.settings[:shift]:
                        samples[name].append(trial(name, scratch, args.images, args.epochs))
            finally:
                stop(others)
            best = min(args.settings, key=lambda name: statistics.median(samples[name]))
            for name in args.settings:
                rows.append([str(load), name, f"{statistics.median(samples[name]):.1f}", f"{max(samples[name]):.1f}",
                             f"{paired_ratio(samples[name], samples[best]):.2f}"])
    work = "the README's main command" if args.full else f"vlfuse fit on {args.images} images x {args.epochs} epochs"
    print(f"{work}, {args.repeats} trials each, {os.cpu_count()} cores, other trainings' waits: {args.load_waits}")
    print(markdown_table(["other trainings", "setting", "median (s)", "worst (s)", "time : best at that load"], rows))


if __name__ == "__main__":
    main()

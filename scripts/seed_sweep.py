"""Train variants of a config over several seeds, several runs at a time, and tabulate them.

A sweep is a JSON file::

    {"config": "configs/easy_vqa.yaml",
     "common": ["--trainer.accelerator", "gpu"],          # added to every run (optional)
     "variants": {"pool_14": ["--model.architecture.head.type", "pooled", "--trainer.max_epochs", "14"],
                  "default": []},
     "seeds": [0, 1, 2, 3, 4]}

Each run is ``vlfuse fit --config CONFIG --seed_everything S COMMON VARIANT`` with the per-group
validation curves and gradient norms of :mod:`vlfuse.callbacks`, in ``OUT/<variant>_s<seed>/``.
The table (test accuracy of every run, median and worst per variant, validation accuracy by epoch,
the last epoch's accuracy by question kind) is printed and written to ``OUT/sweep.md``; every
number to ``OUT/sweep.json``.

    .venv/bin/python scripts/seed_sweep.py scripts/sweeps/easy_vqa_heads.json --out runs/sweep --parallel 2
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vlfuse.analysis.tables import markdown_table

DIAGNOSTICS = ["--trainer.callbacks+=vlfuse.callbacks.GroupAccuracy", "--trainer.callbacks+=vlfuse.callbacks.GradientNorms"]


def read_sweep(path: Path) -> dict:
    """The sweep file, checked; a problem is one line naming the file."""
    try:
        sweep = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"error: {path}: {err}") from None
    for key, kind in (("config", str), ("variants", dict), ("seeds", list)):
        if not isinstance(sweep.get(key), kind):
            raise SystemExit(f"error: {path}: '{key}' must be a {kind.__name__}")
    return sweep


def fit_command(sweep: dict, variant: str, seed: int, root: Path) -> list[str]:
    return [
        sys.executable, "-m", "vlfuse.cli", "fit", "--config", sweep["config"], "--seed_everything", str(seed),
        "--trainer.default_root_dir", str(root), "--trainer.logger.init_args.save_dir", str(root),
        "--trainer.enable_progress_bar", "false", *DIAGNOSTICS, *sweep.get("common", []), *sweep["variants"][variant],
    ]


def run_order(sweep: dict) -> list[tuple[str, int]]:
    """Every (variant, seed), seed by seed: the variants of one seed start together and share the
    machine's load, so that their times can be compared."""
    return [(variant, seed) for seed in sweep["seeds"] for variant in sweep["variants"]]


def run_sweep(sweep: dict, out: Path, parallel: int) -> list[dict]:
    """Run every (variant, seed) in :func:`run_order`, ``parallel`` at a time; one dict per run
    (name, seed, rc, seconds, root)."""
    pending = run_order(sweep)
    running, finished = [], []
    while pending or running:
        while pending and len(running) < parallel:
            variant, seed = pending.pop(0)
            root = out / f"{variant}_s{seed}"
            log = open(out / f"{variant}_s{seed}.log", "w")
            process = subprocess.Popen(fit_command(sweep, variant, seed, root), stdout=log, stderr=subprocess.STDOUT)
            running.append(dict(variant=variant, seed=seed, root=root, process=process, log=log, start=time.time()))
        time.sleep(1)
        for run in [r for r in running if r["process"].poll() is not None]:
            running.remove(run)
            run["log"].close()
            finished.append(dict(variant=run["variant"], seed=run["seed"], root=str(run["root"]),
                                 rc=run["process"].returncode, seconds=round(time.time() - run["start"])))
            print(f"{run['variant']} seed {run['seed']}: exit {run['process'].returncode}", flush=True)
    return finished


def read_curves(root: Path) -> dict:
    """Test accuracy and, per epoch, val accuracy and accuracy by question group, from ``metrics.csv``."""
    files = sorted(Path(root).rglob("metrics.csv"))
    epochs, test = {}, None
    if files:
        for row in csv.DictReader(files[-1].open()):
            for key, value in row.items():
                if not value:
                    continue
                if key == "val/acc" or key.startswith("val_group/"):
                    epochs.setdefault(int(row["epoch"]), {})[key] = float(value)
                elif key == "test/acc":
                    test = float(value)
    return {"test": test, "epochs": [epochs[e] for e in sorted(epochs)]}


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def tables(runs: list[dict]) -> str:
    by_variant: dict[str, list[dict]] = {}
    for run in runs:
        by_variant.setdefault(run["variant"], []).append(run)
    summary = []
    for variant, group in by_variant.items():
        tests = [r["test"] for r in group if r["test"] is not None]
        summary.append([variant, *(percent(r["test"]) for r in group),
                        percent(statistics.median(tests)) if tests else "-", percent(min(tests)) if tests else "-"])
    seeds = [f"seed {r['seed']}" for r in next(iter(by_variant.values()))]
    lines = [markdown_table(["variant", *seeds, "median", "worst"], summary), ""]
    curves = []
    for run in runs:
        last = run["epochs"][-1] if run["epochs"] else {}
        groups = ", ".join(f"{k.removeprefix('val_group/')} {100 * v:.1f}" for k, v in sorted(last.items()) if "group" in k)
        curve = " ".join(f"{100 * e.get('val/acc', float('nan')):.1f}" for e in run["epochs"])
        curves.append([f"{run['variant']} s{run['seed']}", percent(run["test"]), curve, groups, f"{run['seconds']} s"])
    lines.append(markdown_table(["run", "test", "val acc by epoch", "last epoch by question kind", "time"], curves))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="the sweep file (JSON)")
    parser.add_argument("--out", type=Path, default=Path("runs/sweep"), help="where the runs go (default runs/sweep)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    args = parser.parse_args()
    if args.parallel < 1:
        raise SystemExit(f"error: --parallel must be at least 1, got {args.parallel}")
    sweep = read_sweep(args.sweep)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [{**run, **read_curves(Path(run["root"]))} for run in run_sweep(sweep, args.out, args.parallel)]
    (args.out / "sweep.json").write_text(json.dumps(runs, indent=1))
    report = tables(runs)
    (args.out / "sweep.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()

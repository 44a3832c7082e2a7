"""Train one config with several head counts (or attention options) and seeds; tabulate and plot.

    .venv/bin/python scripts/head_count_study.py --config configs/easy_vqa.yaml --study heads
    .venv/bin/python scripts/head_count_study.py --config configs/shapes_pool.yaml --study normalizer --epochs 10
    .venv/bin/python scripts/head_count_study.py --config configs/easy_vqa.yaml --study heads -- --data.init_args.batch_size=64

Studies (``--study``), each an option of the config's ``fuser: {type: fusion_stack}``: ``heads``
(``heads`` in ``--heads``, default 1 2 4 8 16), ``dropout``
(``attn_dropout`` in ``--dropouts``, default 0 0.1 0.3 0.5), ``diversity`` (``diversity_weight`` 0 and
``--diversity-weight``), ``normalizer`` (softmax and leaky_relu). Each setting is trained once per
seed (``--seeds``, default 0 1 2) with ``vlfuse fit`` in a subprocess; arguments after ``--`` go to
every ``vlfuse fit`` command. Each run lives in ``OUT/<setting>/seed<S>/`` (CSV logs, checkpoints,
exported model, ``fit.log``) and ends with a ``result.json``: runs that have one are skipped, so an
interrupted study resumes where it stopped.

Per run: the best ``val/acc`` of the CSV log (the checkpointed epoch), ``test/acc`` when the config
tests after fitting (easy-VQA; SHAPES never touches its test split), the wall-clock time of the
whole ``vlfuse fit`` command (data loading, training, validation, testing), and with
``--dead-heads`` the number of dead cross-attention heads by :func:`vlfuse.analysis.head_roles.dead_heads`
on the first ``--dead-heads-batches`` validation batches. ``OUT/runs.csv`` lists every run,
``OUT/summary.md`` and ``OUT/summary.csv`` give mean and sample standard deviation per setting,
``OUT/summary.png`` plots them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from _common import REPO, load_datamodule, load_model

from vlfuse.analysis.tables import markdown_table

STUDIES = ("heads", "dropout", "diversity", "normalizer")


@dataclass(frozen=True)
class Setting:
    """One configuration of a study: a label and the ``vlfuse fit`` overrides that make it."""

    label: str
    overrides: tuple[str, ...]

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9.]+", "_", self.label).strip("_")


def study_settings(args: argparse.Namespace) -> list[Setting]:
    """The settings of ``args.study``, in table order."""
    arch = "--model.architecture.fuser"
    if args.study == "heads":
        return [Setting(f"heads={h}", (f"{arch}.heads={h}",)) for h in args.heads]
    if args.study == "dropout":
        return [Setting(f"attn_dropout={p:g}", (f"{arch}.attn_dropout={p}",)) for p in args.dropouts]
    if args.study == "diversity":
        return [
            Setting("diversity off", (f"{arch}.diversity_weight=0.0",)),
            Setting(f"diversity {args.diversity_weight:g}", (f"{arch}.diversity_weight={args.diversity_weight}",)),
        ]
    return [Setting(f"normalizer={n}", (f"{arch}.normalizer={n}",)) for n in ("softmax", "leaky_relu")]


def fit_command(
    config: Path, setting: Setting, seed: int, run_dir: Path, epochs: int | None, extra: Sequence[str]
) -> list[str]:
    """The ``vlfuse fit`` command of one run; the run's own paths come last so that they win."""
    logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(run_dir), "name": "", "version": ""},  # run_dir/metrics.csv
    }
    return [
        sys.executable, "-m", "vlfuse.cli", "fit", "--config", str(config),
        *extra,
        *setting.overrides,
        f"--seed_everything={seed}",
        *([f"--trainer.max_epochs={epochs}"] if epochs else []),
        f"--trainer.default_root_dir={run_dir}",
        f"--trainer.logger={json.dumps(logger)}",
        f"--checkpoint.dirpath={run_dir / 'checkpoints'}",
        f"--export.dirpath={run_dir / 'model'}",
    ]


def read_metrics(path: Path) -> dict[str, float | None]:
    """Best ``val/acc`` and last ``test/acc`` of a CSVLogger ``metrics.csv`` (``None`` where absent)."""
    val, test = [], []
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("val/acc"):
                val.append(float(row["val/acc"]))
            if row.get("test/acc"):
                test.append(float(row["test/acc"]))
    return {"val_acc_best": max(val) if val else None, "test_acc": test[-1] if test else None}


def count_dead_heads(model_dir: Path, config: Path, extra: Sequence[str], max_batches: int) -> int:
    """Dead cross-attention heads of a saved model, over the first validation batches of ``config``."""
    from vlfuse.analysis.collect import collect_head_stats
    from vlfuse.analysis.data import load_batches
    from vlfuse.analysis.head_roles import dead_heads

    model = load_model(model_dir)
    datamodule = load_datamodule(config, [a for a in extra if a.startswith("--data.")])
    batches = load_batches(datamodule, model, "val", max_batches)
    collection = collect_head_stats(model, batches)
    return sum(sum(dead_heads(stats)) for stats in collection.stats)


def run_one(args: argparse.Namespace, setting: Setting, seed: int, extra: Sequence[str]) -> dict | None:
    """Train one run (unless its ``result.json`` exists); returns its result, or ``None`` if it failed."""
    run_dir = args.out / setting.slug / f"seed{seed}"
    result_file = run_dir / "result.json"
    command = fit_command(args.config, setting, seed, run_dir, args.epochs, extra)
    if args.dry_run:
        print(shlex.join(command))
        return None
    if result_file.exists():
        print(f"skip   {setting.label} seed {seed}: {result_file} exists")
        return json.loads(result_file.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"train  {setting.label} seed {seed} -> {run_dir}", flush=True)
    start = time.perf_counter()
    with (run_dir / "fit.log").open("w") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    metrics_file = run_dir / "metrics.csv"
    if code != 0 or not metrics_file.exists():
        print(f"FAILED {setting.label} seed {seed} (exit {code}); see {run_dir / 'fit.log'}", file=sys.stderr)
        return None
    result = {"setting": setting.label, "seed": seed, "wall_s": round(wall, 1), **read_metrics(metrics_file)}
    if args.dead_heads:
        result["dead_heads"] = count_dead_heads(run_dir / "model", args.config, extra, args.dead_heads_batches)
    result["command"] = command
    result_file.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def summarise(settings: list[Setting], results: list[dict]) -> list[dict]:
    """Per setting: number of runs, then mean and sample standard deviation of every measured column."""
    rows = []
    for setting in settings:
        runs = [r for r in results if r["setting"] == setting.label]
        row: dict = {"setting": setting.label, "runs": len(runs)}
        for column in ("test_acc", "val_acc_best", "wall_s", "dead_heads"):
            values = [r[column] for r in runs if r.get(column) is not None]
            if values:
                row[f"{column}_mean"], row[f"{column}_std"] = _mean_std(values)
        rows.append(row)
    return rows


COLUMNS = {  # summary column -> (table header, scale)
    "test_acc": ("test acc (%)", 100.0),
    "val_acc_best": ("best val acc (%)", 100.0),
    "wall_s": ("wall-clock (s)", 1.0),
    "dead_heads": ("dead heads", 1.0),
}


def summary_table(rows: list[dict]) -> str:
    """``mean ± std`` per setting, for the columns that some setting has."""
    present = [c for c in COLUMNS if any(f"{c}_mean" in r for r in rows)]
    cells = [[row["setting"], row["runs"], *(_mean_std_cell(row, column) for column in present)] for row in rows]
    header = ["setting", "runs", *(COLUMNS[c][0] for c in present)]
    return markdown_table(header, cells, align="lr" + "r" * len(present)) + "\n"


def _mean_std_cell(row: dict, column: str) -> str | None:
    """``mean ± std`` of a summary column, scaled for the table; ``None`` where no run measured it."""
    scale = COLUMNS[column][1]
    mean, std = row.get(f"{column}_mean"), row.get(f"{column}_std", math.nan)
    if mean is None:
        return None
    return f"{mean * scale:.1f}" + ("" if math.isnan(std) else f" ± {std * scale:.1f}")


def plot(rows: list[dict], results: list[dict], path: Path, accuracy: str) -> None:
    """Accuracy (mean ± std, each seed as a dot) and wall-clock time per setting, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_time) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    labels = [r["setting"] for r in rows]
    x = range(len(rows))
    for ax, column, scale, title in (
        (ax_acc, accuracy, 100.0, COLUMNS[accuracy][0]),
        (ax_time, "wall_s", 1.0, COLUMNS["wall_s"][0]),
    ):
        means = [r.get(f"{column}_mean", math.nan) * scale for r in rows]
        stds = [0.0 if math.isnan(r.get(f"{column}_std", math.nan)) else r[f"{column}_std"] * scale for r in rows]
        ax.errorbar(list(x), means, yerr=stds, fmt="o-", capsize=4, label="mean ± std")
        for i, label in enumerate(labels):
            seeds = [r[column] * scale for r in results if r["setting"] == label and r.get(column) is not None]
            ax.scatter([i] * len(seeds), seeds, s=12, color="grey", zorder=3)
        ax.set_xticks(list(x), labels, rotation=20)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_acc.legend()
    fig.suptitle(path.parent.name)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: Path, settings: list[Setting], results: list[dict]) -> str:
    """``runs.csv``, ``summary.csv``, ``summary.md`` and ``summary.png`` in ``out``; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    run_columns = ["setting", "seed", "test_acc", "val_acc_best", "wall_s", "dead_heads"]
    with (out / "runs.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, run_columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    rows = summarise(settings, results)
    with (out / "summary.csv").open("w", newline="") as handle:
        columns = sorted({k for r in rows for k in r}, key=lambda k: (k != "setting", k != "runs", k))
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    table = summary_table(rows)
    (out / "summary.md").write_text(table)
    accuracy = "test_acc" if any("test_acc_mean" in r for r in rows) else "val_acc_best"
    plot(rows, results, out / "summary.png", accuracy)
    return table


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description="Train a config with several head counts or attention options and seeds; write mean ± std "
        "tables (markdown, CSV) and a plot. Arguments after -- go to every `vlfuse fit` command.",
    )
    parser.add_argument("--config", type=Path, required=True, help="a vlfuse fit config, e.g. configs/easy_vqa.yaml")
    parser.add_argument("--study", choices=STUDIES, default="heads", help="what varies (default: heads)")
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="head counts of --study heads")
    parser.add_argument(
        "--dropouts", type=float, nargs="+", default=[0.0, 0.1, 0.3, 0.5], help="attn_dropout values of --study dropout"
    )
    parser.add_argument(
        "--diversity-weight", type=float, default=0.1, help="the 'on' weight of --study diversity (default 0.1)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument("--epochs", type=int, default=None, help="override trainer.max_epochs (shorter runs)")
    parser.add_argument("--out", type=Path, default=None, help="study folder (default: runs/study/<config>_<study>)")
    parser.add_argument("--dead-heads", action="store_true", help="count dead heads of each run (vlfuse.analysis)")
    parser.add_argument("--dead-heads-batches", type=int, default=20, help="validation batches for --dead-heads")
    parser.add_argument("--dry-run", action="store_true", help="print the vlfuse fit commands and stop")
    args = parser.parse_args(own)
    if not args.config.is_file():
        parser.error(f"--config: no such file: {args.config}")
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if args.out is None:
        args.out = REPO / "runs" / "study" / f"{args.config.stem}_{args.study}"
    args.config, args.out = args.config.resolve(), args.out.resolve()
    return args, extra


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the study; returns 1 when some run failed."""
    args, extra = parse_args(argv)
    settings = study_settings(args)
    results, failed = [], 0
    for seed in args.seeds:  # seeds outermost: a stopped study already has every setting at the first seeds
        for setting in settings:
            result = run_one(args, setting, seed, extra)
            if result is not None:
                results.append(result)
            elif not args.dry_run:
                failed += 1
    if args.dry_run:
        return 0
    if results:
        print(write_outputs(args.out, settings, results), end="")
        print(f"wrote {args.out / 'summary.md'}, summary.csv, summary.png and runs.csv")
    if failed:
        print(f"{failed} run(s) failed; rerun the same command to retry them", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

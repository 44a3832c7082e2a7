"""LoRA against full fine-tuning of the pretrained text encoder: accuracy, reworded accuracy, wall-clock.

For each seed, ``vlfuse fit`` of the full fine-tuning config and then of the LoRA config, one after
the other (each alone on the machine: run the whole through the heavy lock), each into
``OUT/<variant>_s<seed>/`` with its log beside it; then ``scripts/reworded_accuracy.py`` on each
exported model. Printed and written to ``OUT/bench_lora.md``: templated test accuracy (the fit's
``test/acc``), reworded test accuracy, wall-clock of the fit and its ratio to full fine-tuning's of
the same seed, with the median and worst over the seeds.

    flock /tmp/vlfuse_heavy.lock .venv/bin/python scripts/bench_lora.py --seeds 0 --out runs/bench_lora

``--steps N`` instead times N training steps of each variant side by side (no fit; the first
batches of the training split, in rounds), with ``--layers 3,4,5`` adding the LoRA config adapting
only those layers of the encoder:

    flock /tmp/vlfuse_heavy.lock .venv/bin/python scripts/bench_lora.py --steps 6 --layers 3,4,5 --layers 5
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _common
from seed_sweep import read_curves

from vlfuse.analysis.tables import markdown_table

REPO = _common.REPO
FULL, LORA = REPO / "configs" / "easy_vqa_minilm.yaml", REPO / "configs" / "easy_vqa_minilm_lora.yaml"
ALL_ROW = re.compile(r"^\| all \| \d+ \| \*\*(?P<templated>[\d.]+)%\*\* \| \*\*(?P<reworded>[\d.]+)%\*\* \|$", re.M)


def fit(config: Path, seed: int, root: Path, extra: list[str]) -> float:
    """Run ``vlfuse fit`` of ``config`` into ``root`` (log: ``root.log``); its wall-clock in seconds."""
    command = [
        sys.executable, "-m", "vlfuse.cli", "fit", "--config", str(config), "--seed_everything", str(seed),
        "--trainer.default_root_dir", str(root), "--trainer.logger.init_args.save_dir", str(root),
        "--trainer.enable_progress_bar", "false", *extra,
    ]
    start = time.perf_counter()
    with open(root.with_suffix(".log"), "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"error: {shlex.join(command)} exited with {code}; see {root.with_suffix('.log')}")
    return time.perf_counter() - start


def reworded(model: Path, seed: int, limit_images: int | None) -> float:
    """The reworded test accuracy of ``model`` (scripts/reworded_accuracy.py's 'all' row), as a fraction."""
    command = [sys.executable, str(REPO / "scripts" / "reworded_accuracy.py"), "--model", str(model), "--seed", str(seed)]
    if limit_images is not None:
        command += ["--limit-images", str(limit_images)]
    out = subprocess.run(command, capture_output=True, text=True)
    match = ALL_ROW.search(out.stdout)
    if out.returncode or match is None:
        raise SystemExit(f"error: {shlex.join(command)} failed: {(out.stderr or out.stdout).strip()[-500:]}")
    return round(float(match["reworded"]) / 100, 6)


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {round(seconds % 60):02d} s"


def report(runs: list[dict]) -> str:
    """The table of every run, then the median and worst of each variant over the seeds."""
    full = {r["seed"]: r["seconds"] for r in runs if r["variant"] == "full"}
    rows = [[r["variant"], r["seed"], percent(r["test"]), percent(r["reworded"]), minutes(r["seconds"]),
             f"{r['seconds'] / full[r['seed']]:.2f}" if r["seed"] in full else "-"] for r in runs]
    summary = []
    for variant in ("full", "lora"):
        group = [r for r in runs if r["variant"] == variant]
        if not group:
            continue
        tests = [r["test"] for r in group if r["test"] is not None]
        words = [r["reworded"] for r in group]
        ratios = [r["seconds"] / full[r["seed"]] for r in group if r["seed"] in full]
        summary.append([variant, len(group), f"{percent(statistics.median(tests))} / {percent(min(tests))}" if tests else "-",
                        f"{percent(statistics.median(words))} / {percent(min(words))}",
                        f"{statistics.median(ratios):.2f} / {max(ratios):.2f}" if ratios else "-"])
    return "\n".join([
        markdown_table(["variant", "seed", "templated test", "reworded test", "wall-clock", "wall-clock / full"], rows), "",
        markdown_table(["variant", "seeds", "templated median / worst", "reworded median / worst", "wall-clock / full, median / worst"], summary),
    ]) + "\n"


def bench_fits(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.fit_args)
    limit = next((int(a.split("=", 1)[1]) for a in extra if a.startswith("--data.init_args.limit_images=")), None)
    runs = []
    for seed in args.seeds:
        variants = (("full", args.full, extra), ("lora", args.lora, extra + shlex.split(args.lora_args)))
        for variant, config, overrides in (v for v in variants if v[0] in args.variants):
            root = args.out / f"{variant}_s{seed}"
            seconds = fit(config, seed, root, overrides)
            run = dict(variant=variant, seed=seed, seconds=round(seconds, 1), test=read_curves(root)["test"],
                       reworded=reworded(root / "latest" / "model", args.rewording_seed, limit))
            print(json.dumps(run), flush=True)
            runs.append(run)
    (args.out / "bench_lora.json").write_text(json.dumps(runs, indent=1))
    table = report(runs)
    (args.out / "bench_lora.md").write_text(table)
    print(table)


def bench_steps(args: argparse.Namespace) -> None:
    """Time ``args.steps`` training steps (forward, backward, AdamW) of each variant, in rounds."""
    import torch

    from vlfuse.analysis.data import read_config
    from vlfuse.model import VLFuseConfig, VLFuseModel

    _common.set_threads(args.threads)
    datamodule = _common.load_datamodule(args.full, ["--data.init_args.limit_images=200"])
    architectures = {"full": read_config(args.full)["model"]["architecture"], "lora": read_config(args.lora)["model"]["architecture"]}
    for layers in args.layers:
        variant = copy.deepcopy(architectures["lora"])
        variant["text"]["adapter"]["layers"] = [int(n) for n in layers.split(",")]
        architectures[f"lora, layers {layers}"] = variant
    datamodule.image_size = VLFuseConfig.from_dict(architectures["full"]).image.image_size
    datamodule.setup("fit")
    batches = [batch for _, batch in zip(range(args.steps), datamodule.train_dataloader())]
    trainers = {}
    for name, architecture in architectures.items():
        torch.manual_seed(0)
        model = VLFuseModel.from_config(VLFuseConfig.from_dict(architecture), datamodule.answers, datamodule.train_questions).train()
        trainers[name] = (model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True))
    seconds: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.rounds):
        for name, (model, optimizer) in trainers.items():
            start = time.perf_counter()
            for batch in batches:
                logits = model(**model.processor.batch(batch, "cpu", cache=True)).logits
                loss = torch.nn.functional.cross_entropy(logits, batch["labels"].clamp(max=logits.shape[-1] - 1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            seconds[name].append(time.perf_counter() - start)
    best = {name: min(times) / len(batches) for name, times in seconds.items()}
    rows = [[name, sum(p.numel() for p in trainers[name][0].text_encoder.parameters() if p.requires_grad),
             f"{1000 * step:.0f}", f"{step / best['full']:.2f}"] for name, step in best.items()]
    print(markdown_table(["variant", "trainable text-encoder weights", "ms a step (best round)", "step / full"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", type=Path, default=FULL, help=f"the full fine-tuning config (default {FULL.relative_to(REPO)})")
    parser.add_argument("--lora", type=Path, default=LORA, help=f"the LoRA config (default {LORA.relative_to(REPO)})")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the fits (default 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_lora"), help="where the runs go (default runs/bench_lora)")
    parser.add_argument("--rewording-seed", type=int, default=0, help="seed of the reworded questions (default 0)")
    parser.add_argument("--fit-args", default="", help="overrides added to both fits, e.g. '--trainer.max_epochs=1 "
                        "--data.init_args.limit_images=16' for a smoke run")
    parser.add_argument("--lora-args", default="", help="overrides added to the LoRA fit only, e.g. "
                        "'--model.architecture.text.adapter.layers=[3,4,5]'")
    parser.add_argument("--variants", nargs="+", choices=("full", "lora"), default=["full", "lora"],
                        help="which fits to run (default both; without full, no wall-clock ratio)")
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="time N training steps of each variant instead of fitting")
    parser.add_argument("--layers", action="append", default=[], metavar="I,J,...",
                        help="with --steps: add the LoRA config adapting only these encoder layers (repeatable)")
    parser.add_argument("--rounds", type=int, default=3, help="with --steps: rounds of the variants, the best kept (default 3)")
    _common.add_threads_argument(parser)
    args = parser.parse_args()
    for path in (args.full, args.lora):
        if not path.is_file():
            raise SystemExit(f"error: --full/--lora: no such config {path}")
    if args.steps is not None:
        if args.steps < 1 or args.rounds < 1:
            raise SystemExit("error: --steps and --rounds must be at least 1")
        bench_steps(args)
    else:
        bench_fits(args)


if __name__ == "__main__":
    main()

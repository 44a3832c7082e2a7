"""``vlfuse prune``: score the attention heads, remove the lowest for real, optionally fine-tune, save.

    vlfuse prune --model runs/easy_vqa/model --config configs/easy_vqa.yaml --score gradient \\
        --fraction 0.5 --finetune-epochs 1 --out runs/easy_vqa/pruned

Prints, side by side from one run: heads per layer, accuracy before and after, parameter counts
and the CPU latency of the fuser and of the whole model before and after.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import lightning as L
import torch

from vlfuse import model_card
from vlfuse.analysis.data import (
    add_data_arguments,
    build_datamodule,
    load_batches,
    parse_with_data_overrides,
    read_config,
)
from vlfuse.analysis.head_scores import evaluate, score_heads
from vlfuse.analysis.pruning import (
    count_parameters,
    heads_per_layer,
    heads_to_prune,
    measure_latency,
    prune_model,
    speedup,
    take_questions,
)
from vlfuse.analysis.tables import markdown_table
from vlfuse.data import IGNORE_INDEX
from vlfuse.datamodules.base import SPLITS
from vlfuse.commands import SUBCOMMANDS
from vlfuse.lit import finetune, lit_module_for
from vlfuse.model import VLFuseModel
from vlfuse.runtime import add_device_argument, add_threads_argument, set_threads

SCORES = ("weight_norm", "gradient", "ablation")
"""The :data:`~vlfuse.analysis.head_scores.HEAD_SCORES` that ``--score`` offers (weight norms per layer)."""


# ------------------------------------------------------------------------------------ report
def format_report(rows: list[tuple[str, str, str, str]]) -> str:
    """A markdown table ``| | before | after | change |``."""
    return markdown_table(["", "before", "after", "change"], rows, align="lrrr")


def size_rows(model: VLFuseModel, pruned: VLFuseModel) -> list[tuple[str, str, str, str]]:
    """Heads per layer and parameter counts, before and after."""
    removed = sum(heads_per_layer(model)) - sum(heads_per_layer(pruned))
    rows = [("heads per layer", ", ".join(map(str, heads_per_layer(model))),
             ", ".join(map(str, heads_per_layer(pruned))), f"{removed} pruned")]
    for name, before, after in (
        ("whole model", count_parameters(model), count_parameters(pruned)),
        ("fuser", count_parameters(model.fuser), count_parameters(pruned.fuser)),
    ):
        rows.append((f"parameters, {name}", f"{before:,}", f"{after:,}", f"x{after / before:.3f}"))
    return rows


def accuracy_rows(split: str, questions: int, accuracies: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """``accuracies``: ``before``, then one entry per later stage (``pruned``, ``then fine-tuned ...``)."""
    before = accuracies["before"]
    return [
        (f"{split} accuracy, {stage} ({questions} questions)", f"{before:.2%}", f"{after:.2%}",
         f"{(after - before) * 100:+.2f} points")
        for stage, after in accuracies.items()
        if stage != "before"
    ]


def latency_rows(model: VLFuseModel, pruned: VLFuseModel, batch: dict, repeats: int) -> list[tuple[str, str, str, str]]:
    """CPU latency of the fuser and of the whole model, before and after, measured side by side."""
    latency = measure_latency({"before": model, "after": pruned}, batch, repeats=repeats)
    before, after = latency["before"], latency["after"]
    where = f"{len(batch['questions'])} questions, {len(batch['pixel_values'])} images"
    where += f", {torch.get_num_threads()} threads"
    fusion_speedup, model_speedup = speedup(before, after)
    return [
        (f"latency, fuser ({where})", f"{before.fusion * 1e3:.2f} ms", f"{after.fusion * 1e3:.2f} ms",
         f"{fusion_speedup:.2f}x faster"),
        (f"latency, whole model ({where})", f"{before.model * 1e3:.2f} ms", f"{after.model * 1e3:.2f} ms",
         f"{model_speedup:.2f}x faster"),
    ]


def print_scores(name: str, scores: torch.Tensor, heads: dict[int, list[int]]) -> None:
    """Each layer's scores by original head id (``-`` for heads already gone) and the heads pruned."""
    for layer, row in enumerate(scores.tolist()):
        values = " ".join("-" if value != value else f"{value:.3g}" for value in row)  # NaN: removed before
        print(f"  layer {layer} {name} scores by head: {values}")
        print(f"  layer {layer} pruned heads: {heads.get(layer, [])}")


def pruning_record(
    args: argparse.Namespace, argv: list[str], config: dict, datamodule, splits: list[str], accuracies: dict[str, float],
    questions: int, rule: str, model: VLFuseModel, pruned: VLFuseModel,
) -> model_card.RunRecord:
    """What the pruned model's card says of this run: the command, the data, the accuracy of the
    saved model (the last stage) and the model it was pruned from."""
    command = f"vlfuse prune {shlex.join(argv)}"
    stage, accuracy = list(accuracies.items())[-1]
    eval_split = args.eval_split or args.split
    parent = model.run_record.command if model.run_record is not None else None
    notes = [
        f"pruned {sum(heads_per_layer(model)) - sum(heads_per_layer(pruned))} of {sum(heads_per_layer(model))} "
        f"cross-attention heads: {rule} of the {args.score} scores on {args.split}",
        f"{eval_split} accuracy before pruning: {accuracies['before']:.4f} ({questions} questions)",
    ]
    if args.finetune_epochs:
        notes.append(f"fine-tuned {args.finetune_epochs} epoch(s) on train after pruning")
    data = config.get("data") or {}
    return model_card.RunRecord(
        command=command,
        seed=config.get("seed_everything", 0) if args.finetune_epochs else None,
        data=model_card.describe_data(datamodule, splits, data.get("init_args") if isinstance(data, dict) else None),
        metrics=[model_card.Metric(eval_split, "acc", accuracy, command, questions, "questions", stage)],
        config=config,
        derived_from=f"{args.model}" + (f" (trained by `{parent}`)" if parent else ""),
        notes=notes,
    )


# --------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse prune``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse prune",
        description=SUBCOMMANDS["prune"].description,
        epilog="example:\n  vlfuse prune --model runs/easy_vqa/model --config configs/easy_vqa.yaml "
        "--score gradient --fraction 0.5 --out runs/easy_vqa/pruned",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, required=True, help="saved model directory (save_pretrained)")
    parser.add_argument("--config", type=Path, required=True, help="YAML config whose data: section gives the data")
    parser.add_argument("--out", type=Path, required=True, help="directory to save the pruned model to (a new one, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace the model already saved in --out")
    parser.add_argument(
        "--score", choices=SCORES, required=True,
        help="how heads are ranked, the lowest going first: weight_norm (norm of the head's query rows), "
        "gradient (Michel et al. 2019, |dLoss/dgate|, L2-normalised per layer), ablation (accuracy drop alone)",
    )
    rule = parser.add_mutually_exclusive_group(required=True)
    rule.add_argument("--fraction", type=float, help="prune this share of the heads, ranked over all layers; 0 with --finetune-epochs "
                      "prunes nothing and fine-tunes the whole model: the control for a pruned run")
    rule.add_argument("--threshold", type=float, metavar="TAU", help="prune every head scoring at most TAU")
    data = add_data_arguments(parser, split_help="split to score the heads on (default val)")
    data.add_argument("--eval-split", choices=SPLITS, help="split to measure accuracy on (default: --split)")
    tune = parser.add_argument_group("fine-tuning")
    tune.add_argument("--finetune-epochs", type=int, default=0, metavar="N", help="epochs after pruning (default 0)")
    tune.add_argument("--finetune-lr", type=float, metavar="LR", help="peak learning rate (default: the config's model.lr / 10)")
    add_device_argument(parser, note="; fine-tuning runs there, scores and latency on the CPU")
    add_threads_argument(parser)
    timing = parser.add_argument_group("latency (CPU, before and after side by side)")
    timing.add_argument("--latency-questions", type=int, default=64, metavar="N", help="questions per forward pass (default 64)")
    timing.add_argument("--latency-repeats", type=int, default=20, metavar="N", help="timed repetitions (default 20)")
    return parser


def main(argv: list[str]) -> int:
    """``vlfuse prune``: see :func:`build_parser`."""
    args, overrides = parse_with_data_overrides(build_parser(), argv)
    set_threads(args.threads)
    if args.out.resolve() == args.model.resolve():
        raise ValueError(f"--out must differ from --model ({args.model}): the pruned model would overwrite it")
    if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
        raise ValueError(f"--out {args.out} is not empty: give a new folder, or --overwrite to replace the model saved there")
    if args.finetune_epochs < 0:
        raise ValueError(f"--finetune-epochs must be at least 0, got {args.finetune_epochs}")
    config = read_config(args.config)
    model = VLFuseModel.from_pretrained(args.model)
    model.require_fusion_heads("prune", name=str(args.model))
    datamodule = build_datamodule(args.config, overrides)
    # Fine-tuning trains on the datamodule's labels (scoring and evaluation use the model's answers).
    if args.finetune_epochs and datamodule.answers != model.answers:
        raise ValueError(f"{args.config}'s data has other answers than {args.model}: {datamodule.answers[:5]}...")
    score_batches = load_batches(datamodule, model, args.split, args.max_batches)
    eval_split = args.eval_split or args.split
    eval_batches = (
        score_batches if eval_split == args.split else load_batches(datamodule, model, eval_split, args.max_batches)
    )

    scores = score_heads(model, args.score, score_batches)
    heads = heads_to_prune(scores, fraction=args.fraction, threshold=args.threshold)
    control = args.fraction == 0 and args.finetune_epochs > 0  # fine-tune the unpruned model, to compare
    if not heads and not control:
        if args.threshold is not None:
            lowest = float(scores.nan_to_num(float("inf")).min())
            why = f"no {args.score} score is at most {args.threshold} (the lowest is {lowest:.4g})"
        else:
            why = f"--fraction {args.fraction} of {sum(heads_per_layer(model))} heads rounds to 0 heads"
        raise ValueError(f"nothing to prune: {why}")
    pruned = prune_model(model, heads)
    accuracies = {"before": evaluate(model, eval_batches), "pruned": evaluate(pruned, eval_batches)}
    if args.finetune_epochs:
        lit = lit_module_for(pruned, config, args.config, args.finetune_lr)
        L.seed_everything(config.get("seed_everything", 0), verbose=False)
        finetune(lit, datamodule, args.finetune_epochs, args.device, args.out)
        accuracies[f"then fine-tuned {args.finetune_epochs} epoch(s)"] = evaluate(pruned, eval_batches)
    questions = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in eval_batches)
    rows = [
        *size_rows(model, pruned),
        *accuracy_rows(eval_split, questions, accuracies),
        *latency_rows(model, pruned, take_questions(eval_batches, args.latency_questions), args.latency_repeats),
    ]
    rule = f"fraction {args.fraction}" if args.fraction is not None else f"threshold {args.threshold}"
    splits = [*(["train"] if args.finetune_epochs else []), *dict.fromkeys([args.split, eval_split])]
    pruned.save_pretrained(args.out, run=pruning_record(args, argv, config, datamodule, splits, accuracies, questions, rule, model, pruned))

    print(f"vlfuse prune: {args.score} scores on {args.split} ({len(score_batches)} batches), {rule}")
    print_scores(args.score, scores, heads)
    print()
    print(format_report(rows))
    print()
    print(f"vlfuse prune: saved the pruned model to {args.out}")
    print(f"  test it: {typed_command()} test --config {args.config} --model.pretrained {args.out}")
    return 0


def typed_command() -> str:
    """``vlfuse`` as this process was started, to print a command that can be pasted as it is: the
    console script's path (``.venv/bin/vlfuse``) when run through it, else ``vlfuse``."""
    script = Path(sys.argv[0])
    return str(script) if script.name == "vlfuse" else "vlfuse"

#!/usr/bin/env python
"""vlfuse's caption model beside transformers' VisionEncoderDecoderModel on SHAPES captions, in one run.

    .venv/bin/python scripts/compare_caption_peers.py --threads 1 --out runs/compare_caption_peers
    .venv/bin/python scripts/compare_caption_peers.py --models hf --lrs 5e-4 1e-3 2e-3 --seeds 0 1

Models (``--models``, default both, trained one after the other on the same cores): ``vlfuse``,
the caption model of ``--config`` trained as ``vlfuse fit`` trains it
(:class:`vlfuse.captioning.lit.CaptionLitModule`); ``hf``, ``VisionEncoderDecoderModel`` (a ViT and
a ``BertLMHeadModel`` with cross-attention, :class:`vlfuse.baselines.hf_caption.HFCaptionPeer`)
at the same size, with the same tokenizer, trained by the same module's loss, optimiser (AdamW,
warm-up + cosine) and settings. Both get the config's datamodule (the same generated scenes, image
size, batch size and epochs; ``--seeds`` seed the training order and the weights, as
``--seed_everything`` does for ``vlfuse fit``), are scored on validation after every epoch and, with
the weights of their best validation epoch (the config's ``checkpoint.monitor``), on test: greedy
captions (vlfuse: :func:`vlfuse.captioning.greedy`; hf: ``generate``, its key/value cache on)
scored by the same metrics (fact precision, object recall, BLEU-4, CIDEr-D).

With several ``--lrs``, each model and seed trains at each rate and the rate with the best
validation ``--pick`` score is marked in the table. ``OUT/caption_peers.md`` holds the table,
``OUT/caption_peers.csv`` every run. ``--quick`` trains on a few scenes for one epoch (a smoke test).
``--save-weights`` also keeps each run's best-epoch weights as
``OUT/weights/<model>_seed<seed>_lr<lr>.safetensors``, its word tokenizer in the file's metadata
(what ``scripts/bench_trained_generation.py`` reads).
"""

from __future__ import annotations

import argparse
import copy
import csv
import logging
import os
import time
from pathlib import Path

import lightning as L
import torch
from _common import REPO, add_threads_argument, load_datamodule, set_threads
from bench_generate import DEFAULT_CONFIG, caption_architecture
from lightning.pytorch.callbacks import Callback
from safetensors.torch import save as safetensors_bytes

from vlfuse.analysis.data import read_config
from vlfuse.analysis.tables import markdown_table
from vlfuse.atomic import replace_file
from vlfuse.baselines.hf_caption import HFCaptionPeer
from vlfuse.captioning import CaptionConfig
from vlfuse.captioning.lit import CaptionLitModule, training_captions
from vlfuse.lit import agree_image_transform

MODELS = ("vlfuse", "hf")
SCORES = ("fact_precision", "object_recall", "bleu4", "cider")
QUICK_DATA = ["--data.num_train_scenes=32", "--data.num_val_scenes=8", "--data.num_test_scenes=8", "--data.batch_size=8"]


class HFCaptionLitModule(CaptionLitModule):
    """:class:`CaptionLitModule` training :class:`HFCaptionPeer` instead: the same loss, optimiser and
    scores; captions come from the peer's greedy ``generate``."""

    def configure_model(self) -> None:
        if self.model is None:
            datamodule = self.trainer.datamodule
            agree_image_transform(datamodule, self.architecture.image)
            self.model = HFCaptionPeer.from_caption_config(self.architecture, training_captions(datamodule))

    def _evaluate(self, batch: dict, stage: str) -> None:
        size = len(batch["captions"])
        self.log(f"{stage}/loss", self._loss(batch), batch_size=size, on_epoch=True)
        generated = self.model.caption(batch["pixel_values"])
        self.caption_scores[stage].update(generated, batch["references"])
        if batch.get("scenes") is not None:
            self.scene_scores[stage].update(generated, batch["scenes"])


class Clock(Callback):
    """Training seconds (data loading included, validation not) and the best validation epoch's weights."""

    def __init__(self, monitor: str, mode: str) -> None:
        self.monitor, self.sign = monitor, 1.0 if mode == "max" else -1.0
        self.train_seconds, self.epoch_seconds = 0.0, []
        self.best: tuple[float, int, dict, dict] | None = None  # (signed score, epoch, state, val scores)

    def on_train_epoch_start(self, trainer, module) -> None:
        self._start = time.perf_counter()

    def on_validation_start(self, trainer, module) -> None:
        if not trainer.sanity_checking:  # the epoch's training ends where its validation starts
            self.epoch_seconds.append(time.perf_counter() - self._start)
            self.train_seconds += self.epoch_seconds[-1]

    def on_train_epoch_end(self, trainer, module) -> None:
        """After the epoch's validation (the module has logged its scores)."""
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        score = self.sign * metrics[self.monitor]
        if self.best is None or score > self.best[0]:
            self.best = (score, trainer.current_epoch, copy.deepcopy(module.model.state_dict()), metrics)
        logging.getLogger(__name__).info("epoch %d: %.1f s training; %s", trainer.current_epoch, self.epoch_seconds[-1],
                                         ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a SHAPES caption config (default configs/shapes_captions.yaml)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models to train, in order (default both)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="run seeds (default 0)")
    parser.add_argument("--lrs", nargs="+", type=float, help="peak learning rates to try (default: the config's)")
    parser.add_argument("--epochs", type=int, help="epochs (default: the config's trainer.max_epochs)")
    parser.add_argument("--pick", choices=SCORES, default="fact_precision", help="validation score that picks the rate (default fact_precision)")
    parser.add_argument("--quick", action="store_true", help="a few scenes, one epoch: a smoke test")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "compare_caption_peers", help="folder of the table and CSV")
    parser.add_argument("--save-weights", action="store_true", help="keep each run's best-epoch weights in OUT/weights/")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if args.lrs is not None and any(lr <= 0 for lr in args.lrs):
        parser.error(f"--lrs must be positive, got {args.lrs}")
    return args


def train_one(name: str, config: dict, args: argparse.Namespace, seed: int, lr: float, epochs: int) -> dict:
    """Train model ``name`` at ``lr`` with ``seed``; its times, sizes and best-epoch scores."""
    datamodule = load_datamodule(args.config, QUICK_DATA if args.quick else [])
    init = dict(config["model"].get("init_args", {}))
    architecture = CaptionConfig.from_dict(init.pop("caption_model"))  # main checked it with caption_architecture
    init["lr"] = lr
    L.seed_everything(seed, verbose=False)
    module = (CaptionLitModule if name == "vlfuse" else HFCaptionLitModule)(caption_model=architecture, **init)
    checkpoint = config.get("checkpoint", {})
    clock = Clock(checkpoint.get("monitor", "val/cider"), checkpoint.get("mode", "max"))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[clock],
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    fit_seconds = time.perf_counter() - start
    _, best_epoch, state, val = clock.best
    module.model.load_state_dict(state)
    if args.save_weights:
        save_weights(state, module.model.tokenizer, args.out / "weights" / weights_name(name, seed, lr))
    test = {k: float(v) for k, v in trainer.test(module, datamodule=datamodule, verbose=False)[0].items()}
    row = {"model": name, "seed": seed, "lr": lr, "epochs": epochs,
           "parameters": sum(p.numel() for p in module.model.parameters()),
           "train_s": round(clock.train_seconds, 1), "fit_s": round(fit_seconds, 1),
           "epoch_s_median": round(sorted(clock.epoch_seconds)[len(clock.epoch_seconds) // 2], 1), "best_epoch": best_epoch}
    row.update({f"val_{s}": round(val[f"val/{s}"], 5) for s in SCORES})
    row.update({f"test_{s}": round(test[f"test/{s}"], 5) for s in SCORES})
    return row


def weights_name(model: str, seed: int, lr: float) -> str:
    """The file name of a run's saved weights."""
    return f"{model}_seed{seed}_lr{lr:g}.safetensors"


def save_weights(state: dict[str, torch.Tensor], tokenizer, path: Path) -> None:
    """``state`` as a safetensors file at ``path``, written atomically (a tied weight under each of its
    names), with ``tokenizer`` (a word tokenizer) as JSON in the metadata's ``tokenizer``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
    data = safetensors_bytes(tensors, metadata={"tokenizer": tokenizer.backend_tokenizer.to_str()})
    replace_file(path, path.with_name(f".{path.name}.{os.getpid()}.tmp"), lambda file: file.write(data))


def mark_picked(rows: list[dict], pick: str) -> None:
    """``picked``: the rate with the best validation ``pick`` score of each model and seed (ties: the first)."""
    for row in rows:
        group = [r for r in rows if (r["model"], r["seed"]) == (row["model"], row["seed"])]
        row["picked"] = row is max(group, key=lambda r: r[f"val_{pick}"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    caption_architecture(args.config)  # a config without a caption model stops here, in one line, before any training
    config = read_config(args.config)
    epochs = 1 if args.quick else args.epochs or config.get("trainer", {}).get("max_epochs", 1)
    lrs = args.lrs or [config["model"].get("init_args", {}).get("lr", 1e-3)]
    rows = []
    for seed in args.seeds:
        for name in args.models:
            for lr in lrs:
                logging.info("training %s, seed %d, lr %g, %d epochs", name, seed, lr, epochs)
                rows.append(train_one(name, config, args, seed, lr, epochs))
                logging.info("done: %s", rows[-1])
    mark_picked(rows, args.pick)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "caption_peers.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    headers = ["model", "seed", "lr", "params", "train s", "fit s", "val fact prec.", "test fact prec.", "test obj. recall",
               "test BLEU-4", "test CIDEr-D", "picked"]
    table = [[r["model"], r["seed"], r["lr"], r["parameters"], r["train_s"], r["fit_s"], 100 * r["val_fact_precision"],
              100 * r["test_fact_precision"], 100 * r["test_object_recall"], r["test_bleu4"], r["test_cider"],
              "yes" if r["picked"] else ""] for r in rows]
    text = markdown_table(headers, table, formats=[None, None, "{:g}", None, "{:.0f}", "{:.0f}", "{:.2f}", "{:.2f}", "{:.2f}", "{:.3f}", "{:.2f}", None])
    (args.out / "caption_peers.md").write_text(text + "\n")
    print(f"threads {torch.get_num_threads()}, {epochs} epochs, config {args.config}\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

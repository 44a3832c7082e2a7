"""Peers side by side on easy-VQA: accuracy against training time for each model, in one run.

    .venv/bin/python scripts/compare_baselines.py --out runs/compare_baselines
    .venv/bin/python scripts/compare_baselines.py --models film --split val --epochs 3 --set film.lr=1e-3

Models (``--models``, default all five, trained one after the other on the same cores):
``bow_cnn``, the dataset author's CNN + bag-of-words model (:class:`vlfuse.baselines.BowCNN`);
``film``, FiLM (:class:`vlfuse.baselines.FiLMNet`); ``blip_vqa`` and ``vilt``, transformers'
``BlipForQuestionAnswering`` and ``ViltForQuestionAnswering`` from scratch at the vlfuse model's size
(:mod:`vlfuse.baselines.hf_vqa`; trained with vlfuse's AdamW and warm-up + cosine schedule; BLIP scored
by greedy generation); ``vlfuse``, the model of ``--config`` built and trained as ``vlfuse fit`` builds
it (:class:`vlfuse.lit.VLFuseLitModule`, its optimiser and schedule). All get the config's datamodule,
so the same training images in the same order and the same evaluation split; the peers tokenise words
with a vocabulary made from the training questions only (BLIP's adds the answers' words).

After each training epoch the model is scored on ``--split`` (``test`` by default; tune on ``val``);
the clock counts training only (data loading included), not the scoring. Each model's settings
(``--set MODEL.KEY=VALUE``; KEY one of lr, epochs, batch_size, width, weight_decay, schedule, image_size,
the last three for the peers only) start from the published ones (see ``PEER_DEFAULTS``) and the
config's. ``OUT/peers.md`` holds the table, ``OUT/peers.csv`` every point, ``OUT/peers.png`` the curves.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import inspect
import logging
import shlex
import sys
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from _common import DEFAULT_CONFIG, add_threads_argument, load_datamodule, set_threads
from lightning.pytorch.callbacks import Callback

from vlfuse.analysis.data import read_config
from vlfuse.analysis.figures import new_figure
from vlfuse.analysis.tables import markdown_table
from vlfuse.baselines import BowCNN, FiLMNet
from vlfuse.baselines.bow_cnn import mean_pixel
from vlfuse.baselines.hf_vqa import BlipVQA, ViltVQA, blip_vqa_config, vilt_config
from vlfuse.data import IGNORE_INDEX
from vlfuse.datamodules import VQADataModule
from vlfuse.encoders.tokenizer import build_word_tokenizer
from vlfuse.lit import VLFuseLitModule, adamw_warmup_cosine, warmup_cosine
from vlfuse.model import VLFuseConfig
from vlfuse.processor import VLFuseProcessor

MODELS = ("bow_cnn", "film", "blip_vqa", "vilt", "vlfuse")
HF_PEERS = ("blip_vqa", "vilt")
"""The transformers models, trained by :class:`HFPeerLitModule`."""
HF_PATCH = 4
"""The transformers peers' patch side: 8x8 patches from 32x32 images, the grid of vlfuse's stem."""
HEADS = 16
"""The transformers peers' attention heads, as vlfuse's fusion blocks."""
MEAN_PIXEL_IMAGES = 256
"""How many training images (the first, in order) give BowCNN's ``pixel_mean``."""
PEER_ONLY = ("width", "schedule", "image_size")
SCHEDULES = ("constant", "cosine")


@dataclass
class Settings:
    """How one model is trained. ``batch_size`` counts images, each with all its questions (about 9.6)."""

    lr: float
    epochs: int
    batch_size: int
    image_size: int
    width: int | None = None
    weight_decay: float = 0.0
    schedule: str = "constant"

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if getattr(self, f.name) is not None)


PEER_DEFAULTS = {
    # The author's: 64x64 images, Adam 5e-4, 8 epochs of 32 questions (about 3 images) per batch;
    # no setting of the sweep (docs/results.md#peers-side-by-side) did better.
    "bow_cnn": Settings(lr=5e-4, epochs=8, batch_size=3, image_size=64, width=32),
    # The paper's optimiser (Adam 3e-4, weight decay 1e-5, 64 questions, about 7 images, per batch),
    # the best of the sweep; 10 epochs (the paper stops early on CLEVR), a little less time than vlfuse's 14.
    "film": Settings(lr=3e-4, epochs=10, batch_size=7, image_size=32, width=64, weight_decay=1e-5),
    # transformers' VQA models at the vlfuse default's size, batch, weight decay, schedule and epochs;
    # 16 heads of 8 dimensions; the learning rates are the sweep's picks (docs/results.md#peers-side-by-side).
    "blip_vqa": Settings(lr=1e-3, epochs=10, batch_size=32, image_size=32, width=128, weight_decay=0.05, schedule="cosine"),
    "vilt": Settings(lr=2e-3, epochs=10, batch_size=32, image_size=32, width=128, weight_decay=0.05, schedule="cosine"),
}


def signature_default(function, name: str):
    """The default of ``function``'s argument ``name`` (what ``vlfuse fit`` uses when a config leaves it out)."""
    return inspect.signature(function).parameters[name].default


def config_settings(config: dict) -> Settings:
    """The vlfuse model's settings as ``vlfuse fit`` would train it from ``config``."""
    model = config["model"]
    return Settings(
        lr=model.get("lr", signature_default(VLFuseLitModule, "lr")),
        epochs=config.get("trainer", {}).get("max_epochs", 1),
        batch_size=config["data"].get("init_args", {}).get("batch_size", signature_default(VQADataModule, "batch_size")),
        image_size=VLFuseConfig.from_dict(model.get("architecture", {})).image.image_size,
        weight_decay=model.get("weight_decay", signature_default(VLFuseLitModule, "weight_decay")),
        schedule="cosine",
    )


def apply_settings(settings: dict[str, Settings], assignments: list[str]) -> None:
    """Apply ``MODEL.KEY=VALUE`` assignments (``--set``) to ``settings``, in order."""
    for assignment in assignments:
        target, _, value = assignment.partition("=")
        name, _, key = target.partition(".")
        if name not in settings:
            raise SystemExit(f"error: --set {assignment}: no model {name!r} in this run ({', '.join(settings)})")
        current = settings[name]
        if key not in {f.name for f in dataclasses.fields(Settings)} or (name == "vlfuse" and key in PEER_ONLY):
            raise SystemExit(f"error: --set {assignment}: {name} has no setting {key!r}")
        kind = float if key in ("lr", "weight_decay") else str if key == "schedule" else int
        try:
            parsed = kind(value)
        except ValueError:
            raise SystemExit(f"error: --set {assignment}: {key} takes a {kind.__name__}, got {value!r}") from None
        if key == "schedule" and parsed not in SCHEDULES:
            raise SystemExit(f"error: --set {assignment}: schedule is one of {', '.join(SCHEDULES)}")
        setattr(current, key, parsed)


class PeerLitModule(L.LightningModule):
    """Trains a peer with Adam on the cross-entropy, at a constant or warm-up + cosine learning rate."""

    def __init__(self, model: torch.nn.Module, processor: VLFuseProcessor, settings: Settings) -> None:
        super().__init__()
        self.model, self.processor, self.settings = model, processor, settings

    def forward(self, batch: dict) -> torch.Tensor:
        inputs = self.processor.batch(batch, self.device)
        return self.model(inputs.pixel_values, inputs.input_ids, inputs.attention_mask, inputs.image_index)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch), batch["labels"], ignore_index=IGNORE_INDEX)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.settings.lr, weight_decay=self.settings.weight_decay)
        if self.settings.schedule == "constant":
            return optimizer
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = max(1, total // 20)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup_steps=warmup, total_steps=total, min_ratio=0.01)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class HFPeerLitModule(L.LightningModule):
    """Trains a transformers peer (:mod:`vlfuse.baselines.hf_vqa`) on its ``loss`` with vlfuse's optimiser:
    AdamW, no decay on biases and norms, warm-up + cosine (or a constant rate)."""

    def __init__(self, model: BlipVQA | ViltVQA, processor: VLFuseProcessor, settings: Settings, config: dict) -> None:
        super().__init__()
        self.model, self.processor = model, processor
        cosine = settings.schedule == "cosine"
        defaults = {name: signature_default(VLFuseLitModule, name) for name in ("warmup_ratio", "min_lr_ratio")}
        options = {**defaults, **{k: v for k, v in config["model"].items() if k in defaults}}
        self.save_hyperparameters(
            dict(lr=settings.lr, weight_decay=settings.weight_decay, warmup_ratio=options["warmup_ratio"] if cosine else 0.0,
                 min_lr_ratio=options["min_lr_ratio"] if cosine else 1.0)
        )

    def inputs(self, batch: dict) -> tuple[torch.Tensor, ...]:
        inputs = self.processor.batch(batch, self.device, cache=self.training)
        return inputs.pixel_values, inputs.input_ids, inputs.attention_mask, inputs.image_index

    def answer(self, batch: dict) -> torch.Tensor:
        """(Bq,) each question's answer index (-1: none of the answers)."""
        return self.model.answer(*self.inputs(batch))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model.loss(*self.inputs(batch), batch["labels"].to(self.device))

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.model)


def build_hf_peer(name: str, settings: Settings, datamodule: VQADataModule, config: dict) -> HFPeerLitModule:
    """BLIP-VQA (3 layers: ViT, question encoder, answer decoder) or ViLT (3 layers), each 128 wide with
    16 heads, at about the vlfuse default's 675k parameters."""
    if settings.image_size % HF_PATCH:
        raise SystemExit(f"error: --set {name}.image_size={settings.image_size}: must be a multiple of {HF_PATCH}")
    if settings.width % HEADS:
        raise SystemExit(f"error: --set {name}.width={settings.width}: must be a multiple of the {HEADS} heads")
    shape = dict(image_size=settings.image_size, patch_size=HF_PATCH, width=settings.width, heads=HEADS, max_length=32)
    if name == "vilt":
        tokenizer = build_word_tokenizer(datamodule.train_questions, max_length=32)
        model = ViltVQA(vilt_config(len(tokenizer), len(datamodule.answers), **shape, layers=3, pad_id=tokenizer.pad_token_id))
    else:
        tokenizer = build_word_tokenizer([*datamodule.train_questions, *datamodule.answers], max_length=32)
        answers = tokenizer(list(datamodule.answers), padding=True, return_tensors="pt")
        blip = blip_vqa_config(len(tokenizer), **shape, mlp_ratio=3, pad_id=tokenizer.pad_token_id,
                               bos_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id)
        model = BlipVQA(blip, answers["input_ids"], answers["attention_mask"])
    processor = VLFuseProcessor(tokenizer, image_size=settings.image_size, max_length=32)
    return HFPeerLitModule(model, processor, settings, config)


def build_module(name: str, settings: Settings, datamodule: VQADataModule, config: dict) -> L.LightningModule:
    """The Lightning module that trains model ``name``, built with the current torch seed."""
    if name == "vlfuse":
        options = {k: v for k, v in config["model"].items() if k != "architecture"}
        options.update(lr=settings.lr, weight_decay=settings.weight_decay)
        return VLFuseLitModule(VLFuseConfig.from_dict(config["model"]["architecture"]), **options)
    if name in HF_PEERS:
        return build_hf_peer(name, settings, datamodule, config)
    tokenizer = build_word_tokenizer(datamodule.train_questions, max_length=32)
    processor = VLFuseProcessor(tokenizer, image_size=settings.image_size, max_length=32)
    size = dict(vocab_size=len(tokenizer), num_answers=len(datamodule.answers))
    if name == "bow_cnn":
        train = datamodule.dataset("train")
        pixel_mean = mean_pixel([train.pixels(i) for i in range(min(MEAN_PIXEL_IMAGES, len(train)))])
        model = BowCNN(**size, image_size=settings.image_size, width=settings.width, pixel_mean=pixel_mean.tolist())
        return PeerLitModule(model, processor, settings)
    stem_layers = (settings.image_size // 8).bit_length() - 1  # strided layers down to an 8x8 grid
    if settings.image_size != 8 * 2**stem_layers:
        raise SystemExit(f"error: --set film.image_size={settings.image_size}: FiLM needs 8 times a power of two (16, 32, 64)")
    return PeerLitModule(FiLMNet(**size, width=settings.width, stem_layers=stem_layers), processor, settings)


@torch.no_grad()
def accuracy(module: L.LightningModule, batches) -> float:
    """Share of the questions of ``batches`` whose answer is the labelled one (unlabelled ones left out):
    the module's ``answer`` where it has one (a generated answer), else its top logit."""
    correct = total = 0
    for batch in batches:
        labels = batch["labels"]
        known = labels != IGNORE_INDEX
        answers = module.answer(batch) if isinstance(module, HFPeerLitModule) else module(batch).argmax(dim=-1)
        correct += int((answers.cpu() == labels)[known].sum())
        total += int(known.sum())
    return correct / max(total, 1)


class AccuracyOverTime(Callback):
    """After each training epoch: the training seconds so far (scoring excluded) and the accuracy on a split.

    Args:
        name: the model's name, for the printed progress.
        loader: the evaluation batches, a fresh iterator per epoch (e.g. ``datamodule.test_dataloader``).
        max_batches: score only the first batches of the split (``None``: all).
    """

    def __init__(self, name: str, loader, max_batches: int | None) -> None:
        self.name, self.loader, self.max_batches = name, loader, max_batches
        self.points: list[tuple[int, float, float]] = []  # (epoch, training seconds, accuracy)
        self.seconds = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seconds += time.perf_counter() - self._started
        pl_module.eval()
        score = accuracy(pl_module, islice(self.loader(), self.max_batches))
        pl_module.train()
        self.points.append((trainer.current_epoch + 1, self.seconds, score))
        print(f"{self.name:8s} epoch {trainer.current_epoch + 1:3d}  {self.seconds:8.1f} s  acc {score:.4f}", flush=True)


@dataclass
class Result:
    """One trained model: its settings, its size and its (epoch, training seconds, accuracy) points."""

    name: str
    settings: Settings
    parameters: int
    points: list[tuple[int, float, float]]

    def best(self) -> tuple[int, float, float]:
        """The first epoch at the highest accuracy: (epoch, seconds, accuracy)."""
        return max(self.points, key=lambda p: (p[2], -p[0]))

    def reaches(self, target: float) -> tuple[int, float] | None:
        """The first (epoch, seconds) at which the accuracy is at least ``target``."""
        return next(((e, s) for e, s, a in self.points if a >= target), None)


def train(name: str, settings: Settings, args: argparse.Namespace, config: dict) -> Result:
    """Train model ``name`` from seed ``args.seed``, scoring it after every epoch."""
    datamodule = load_datamodule(args.config, [f"--data.init_args.batch_size={settings.batch_size}"])
    datamodule.image_size = settings.image_size
    L.seed_everything(args.seed, verbose=False)
    module = build_module(name, settings, datamodule, config)
    loader = datamodule.val_dataloader if args.split == "val" else datamodule.test_dataloader
    timeline = AccuracyOverTime(name, loader, args.max_batches)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=settings.epochs, limit_train_batches=args.max_batches or 1.0,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timeline], default_root_dir=args.out,
    )
    trainer.fit(module, datamodule=datamodule)
    return Result(name, settings, sum(p.numel() for p in module.parameters()), timeline.points)


def comparison(results: list[Result]) -> str:
    """Whether the vlfuse model matches the best peer's accuracy, and when."""
    peers = [r for r in results if r.name != "vlfuse"]
    ours = next((r for r in results if r.name == "vlfuse"), None)
    if not peers or ours is None:
        return ""
    best = max(peers, key=lambda r: r.best()[2])
    epoch, seconds, target = best.best()
    reached = ours.reaches(target)
    where = f"at epoch {reached[0]}, {reached[1]:.0f} s" if reached else "never"
    return f"Best peer: {best.name}, {target:.2%} at epoch {epoch} ({seconds:.0f} s). vlfuse reaches it: {where}."


def at_time(result: Result, seconds: float) -> float | None:
    """The accuracy of ``result``'s last epoch done within ``seconds`` of training (``None``: no epoch was)."""
    done = [a for _, s, a in result.points if s <= seconds]
    return done[-1] if done else None


def equal_time(results: list[Result]) -> str:
    """Each peer against vlfuse at the same training time: when the sooner of the two ends, the other's
    accuracy after its last epoch done by then."""
    ours = next((r for r in results if r.name == "vlfuse"), None)
    if ours is None:
        return ""
    lines = []
    for peer in (r for r in results if r.name != "vlfuse"):
        seconds = min(ours.points[-1][1], peer.points[-1][1])
        mine, theirs = at_time(ours, seconds), at_time(peer, seconds)
        show = (lambda a: "no epoch done" if a is None else f"{a:.2%}")
        lines.append(f"At {seconds:.0f} s: vlfuse {show(mine)}, {peer.name} {show(theirs)}.")
    return " ".join(lines)


def write_outputs(results: list[Result], args: argparse.Namespace, command: str) -> str:
    """Write ``peers.md``, ``peers.csv`` and ``peers.png`` in ``args.out``; return the markdown."""
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "peers.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "epoch", "train_seconds", f"{args.split}_acc"])
        writer.writerows([r.name, e, round(s, 2), round(a, 5)] for r in results for e, s, a in r.points)
    rows = [
        [r.name, r.parameters, r.settings.describe(), r.points[-1][0], r.points[-1][1], r.points[-1][2], r.best()[2], r.best()[1]]
        for r in results
    ]
    header = ["model", "parameters", "settings", "epochs", "training s", f"{args.split} acc (last)",
              f"best {args.split} acc", "best at (s)"]
    table = markdown_table(header, rows, formats=[None, "{:,}", None, None, "{:.0f}", "{:.2%}", "{:.2%}", "{:.0f}"])
    text = (f"`{command}`\n\ntorch {torch.__version__}, {torch.get_num_threads()} threads, seed {args.seed}, "
            f"{args.split} split{f', {args.max_batches} batches' if args.max_batches else ''}\n\n{table}\n")
    if note := comparison(results):
        text += f"\n{note}\n"
    if note := equal_time(results):
        text += f"\n{note}\n"
    (args.out / "peers.md").write_text(text)
    figure = new_figure(6.0, 4.0)
    ax = figure.add_subplot(1, 1, 1)
    for r in results:
        ax.plot([s for _, s, _ in r.points], [a for *_, a in r.points], marker="o", label=r.name)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel(f"{args.split} accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    figure.tight_layout()
    figure.savefig(args.out / "peers.png", dpi=120)
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the vlfuse model and the data (default %(default)s)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models to train, in order")
    parser.add_argument("--set", dest="assignments", nargs="+", default=[], metavar="MODEL.KEY=VALUE",
                        help="change a model's setting, e.g. film.lr=1e-3 bow_cnn.batch_size=8")
    parser.add_argument("--epochs", type=int, help="epochs of every model (before --set)")
    parser.add_argument("--split", choices=("val", "test"), default="test", help="the split scored after each epoch")
    parser.add_argument("--max-batches", type=int, metavar="N", help="train and score on the first N batches only (quick runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/compare_baselines"), help="output folder (default %(default)s)")
    add_threads_argument(parser, default=2)
    args = parser.parse_args(argv)
    for option, value in (("--epochs", args.epochs), ("--max-batches", args.max_batches)):
        if value is not None and value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banner per model
    try:
        config = read_config(args.config)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: --config {args.config}: {err}") from None
    defaults = {**PEER_DEFAULTS, "vlfuse": config_settings(config)}
    settings = {name: dataclasses.replace(defaults[name]) for name in args.models}
    if args.epochs:
        for s in settings.values():
            s.epochs = args.epochs
    apply_settings(settings, args.assignments)
    results = [train(name, settings[name], args, config) for name in args.models]
    command = shlex.join(["scripts/compare_baselines.py", *(sys.argv[1:] if argv is None else argv)])
    print("\n" + write_outputs(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())

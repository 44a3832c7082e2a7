"""Epoch time of training with frozen encoders, with and without the feature cache, side by side.

Builds a config's model twice with both encoders frozen, once with ``cache_features`` and once
without (same seed, same weights), and trains them on the same easy-VQA batches, alternating
epoch by epoch so that machine noise hits both alike. Each epoch runs what ``vlfuse fit`` runs:
the real DataLoader (which stops decoding images once the cache holds them all, as after each
training epoch of ``vlfuse fit``), tokenization, forward, backward and AdamW. Prints each epoch's seconds, the ratio
no-cache / cache for the epochs after the first (the first fills the cache), and where the time
of those epochs goes: loading the batches, tokenizing, the frozen encoders (or the cache
lookups), the rest of the forward pass (projections, fuser, head, loss), the backward
pass and the optimizer.

    .venv/bin/python scripts/bench_feature_cache.py --config configs/easy_vqa_minilm.yaml --limit-images 200
    # a pretrained-size image encoder (timm's own sizes) instead of the config's small one:
    .venv/bin/python scripts/bench_feature_cache.py --config configs/easy_vqa_minilm.yaml --image-encoder vit_small_patch16_224
    # ... at the resolution it was pretrained at:
    .venv/bin/python scripts/bench_feature_cache.py --config configs/easy_vqa_minilm.yaml --image-encoder vit_small_patch16_224 --image-size 224
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from vlfuse.analysis.tables import markdown_table
from vlfuse.data import IGNORE_INDEX
from vlfuse.data.resumable import ResumableDataLoader
from vlfuse.datamodules import EasyVQADataModule
from vlfuse.model import VLFuseConfig, VLFuseModel

STAGES = ("load", "tokenize", "encoders", "rest of forward", "backward", "optimizer")
"""Where an epoch's time goes; "encoders" is the frozen encoders' forward, or the cache lookups."""


def frozen(architecture: VLFuseConfig, cache: bool, image_encoder: str | None, image_size: int | None) -> VLFuseConfig:
    image = architecture.image
    if image_encoder:
        image = dataclasses.replace(image, name=image_encoder, patch_size=None, width=None, depth=None, num_heads=None)
    if image_size:
        image = dataclasses.replace(image, image_size=image_size)
    return dataclasses.replace(
        architecture,
        image=dataclasses.replace(image, freeze=True, cache_features=cache),
        text=dataclasses.replace(architecture.text, freeze=True, cache_features=cache),
    )


class StageClock:
    """Adds up the seconds spent in each of :data:`STAGES`, the encoders' through forward hooks."""

    def __init__(self, model: VLFuseModel) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._encoder_start = 0.0
        for encoder in (model.image_encoder, model.text_encoder):
            encoder.register_forward_pre_hook(self._start_encoder)
            encoder.register_forward_hook(self._stop_encoder)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - start

    def _start_encoder(self, module, args) -> None:
        self._encoder_start = time.perf_counter()

    def _stop_encoder(self, module, args, output) -> None:
        elapsed = time.perf_counter() - self._encoder_start
        self.seconds["encoders"] += elapsed
        self.seconds["rest of forward"] -= elapsed  # the encoders run inside the forward stage


def train_epoch(
    model: VLFuseModel, optimizer: torch.optim.Optimizer, loader: ResumableDataLoader, epoch: int, clock: StageClock
) -> dict[str, float]:
    """Seconds of each stage of training epoch ``epoch`` over ``loader``."""
    model.train()
    clock.reset()
    loader.sampler.set_epoch(epoch)
    batches = iter(loader)
    while True:
        with clock.stage("load"):
            batch = next(batches, None)
        if batch is None:
            if model.image_encoder.cache is not None:  # as VLFuseLitModule.on_train_epoch_end
                loader.dataset.decode_only_uncached(model.image_encoder.cache)
            return clock.seconds
        with clock.stage("tokenize"):
            inputs = model.processor.batch(batch, cache=True)
        with clock.stage("rest of forward"):  # as VLFuseLitModule's training step
            logits = model(**inputs).logits
            loss = F.cross_entropy(logits, batch["labels"], ignore_index=IGNORE_INDEX)
        with clock.stage("backward"):
            loss.backward()
        with clock.stage("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/easy_vqa.yaml"))
    parser.add_argument("--epochs", type=int, default=3, help="epochs per model (the first fills the cache)")
    parser.add_argument("--limit-images", type=int, default=400, help="training images (each with its questions)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-encoder", help="a timm ViT at its own sizes instead of the config's image encoder")
    parser.add_argument("--image-size", type=int, help="resize the images to this side instead of the config's "
                        "(224: the resolution timm's pretrained ViTs were trained at)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the cache pays off from the second epoch")

    architecture = VLFuseConfig.from_dict(yaml.safe_load(args.config.read_text())["model"]["architecture"])
    image_size = args.image_size or architecture.image.image_size
    data = EasyVQADataModule(batch_size=args.batch_size, limit_images=args.limit_images, image_size=image_size)
    models, optimizers, loaders, clocks = {}, {}, {}, {}
    for name, cache in (("no cache", False), ("cache", True)):
        torch.manual_seed(0)
        models[name] = VLFuseModel.from_config(frozen(architecture, cache, args.image_encoder, args.image_size), data.answers, data.train_questions)
        trainable = [p for p in models[name].parameters() if p.requires_grad]
        optimizers[name] = torch.optim.AdamW(trainable, lr=1e-4)
        loaders[name] = data.train_dataloader()  # the same shuffled order for both: one seed
        clocks[name] = StageClock(models[name])
    stages: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    for epoch in range(args.epochs):
        order = list(models) if epoch % 2 == 0 else list(reversed(models))
        for name in order:
            seconds = train_epoch(models[name], optimizers[name], loaders[name], epoch, clocks[name])
            stages[name].append(dict(seconds))
        seconds = ", ".join(f"{name} {sum(stages[name][-1].values()):.2f} s" for name in models)
        print(f"epoch {epoch}: {seconds}", flush=True)
    later = {name: statistics.median(sum(s.values()) for s in epochs[1:]) for name, epochs in stages.items()}
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; {args.config} with both encoders frozen"
        f"{f' (image encoder {args.image_encoder})' if args.image_encoder else ''}, images at {image_size} px; "
        f"{len(data.records('train'))} images, {data.dataset('train').num_questions} questions per epoch"
    )
    print(f"epochs after the first (median): no cache {later['no cache']:.2f} s, cache {later['cache']:.2f} s; "
          f"ratio {later['no cache'] / later['cache']:.2f}x\n")
    rows = [
        [stage] + [f"{statistics.median(s[stage] for s in stages[name][1:]):.2f}" for name in models]
        for stage in STAGES
    ]
    print(markdown_table(["seconds per epoch after the first (median)", *models], rows))


if __name__ == "__main__":
    main()

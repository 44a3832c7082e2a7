#!/usr/bin/env python
"""An epoch's data loading, without the model, with 0, 2 and 4 DataLoader workers, side by side.

The data is an imagefolder of JPEG photographs as users have them (default 256 images of 640x480,
written once into ``--data``; smooth gradients with noise, so that they compress as photographs
do), read by ``ImageFolderDataModule`` at the model's 224 px, 4 questions an image, batches of 32
images. Each case is one whole epoch of the training loader from a new datamodule: the first epoch
decodes every image; ``--epochs 2`` times the second epoch of the same loader too, which, without
workers, reads the images the dataset kept decoded (up to 512 MiB; workers keep none). Each
repetition runs every worker count, in an order rotated by one each time; a speed-up is the median
of the per-repetition ratios (:mod:`vlfuse.analysis.timing`).

Example:
    .venv/bin/python scripts/bench_workers.py --workers 0 2 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import warnings
from pathlib import Path
from time import perf_counter

import numpy as np
import torch
from _common import REPO, set_threads
from PIL import Image

from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import paired_ratio
from vlfuse.datamodules import ImageFolderDataModule

SPLITS = ("train", "validation", "test")


def write_photos(folder: Path, images: int, size: tuple[int, int], seed: int = 0) -> Path:
    """``folder`` as an imagefolder dataset: ``images`` JPEGs in ``train/`` (and 2 in each other split),
    4 questions each; written once (a ``metadata.jsonl`` per split marks a finished split)."""
    rng = np.random.default_rng(seed)
    width, height = size
    for split in SPLITS:
        split_dir = folder / split
        count = images if split == "train" else 2
        if (split_dir / "metadata.jsonl").is_file():
            continue
        split_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        y, x = np.mgrid[0:height, 0:width]
        for i in range(count):
            base = rng.uniform(0, 255, size=3)
            slope = rng.uniform(-0.3, 0.3, size=(2, 3))
            pixels = base + x[..., None] * slope[0] + y[..., None] * slope[1] + rng.normal(0, 12, size=(height, width, 3))
            name = f"{i:05d}.jpg"
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(split_dir / name, quality=90)
            rows += [{"file_name": name, "question": f"what is in corner {k}?", "answer": f"thing {k}"} for k in range(4)]
        (split_dir / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def epoch_loader(data_dir: Path, workers: int, batch_size: int, image_size: int):
    datamodule = ImageFolderDataModule(data_dir=str(data_dir), image_size=image_size, batch_size=batch_size, num_workers=workers)
    datamodule.setup("fit")
    return datamodule.train_dataloader()


def timed_epochs(loader, epochs: int, images: int) -> list[float]:
    """Seconds of each of the first ``epochs`` passes of ``loader``."""
    seconds = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        start = perf_counter()
        assert sum(batch["pixel_values"].shape[0] for batch in loader) == images
        seconds.append(perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "bench_workers_photos", metavar="DIR",
                        help="where the photographs are written (once) and read from")
    parser.add_argument("--images", type=int, default=256, help="training images (default 256)")
    parser.add_argument("--photo-size", type=int, nargs=2, default=(640, 480), metavar=("W", "H"))
    parser.add_argument("--image-size", type=int, default=224, help="the side the model reads (default 224)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--epochs", type=int, choices=(1, 2), default=2, help="time the first epoch, or the first two")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions, each over every worker count in a rotated order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the main process (default 1)")
    args = parser.parse_args(argv)
    if any(w < 0 for w in args.workers) or args.images < 1 or args.repeats < 1:
        raise SystemExit("error: --workers must be >= 0, --images and --repeats >= 1")
    set_threads(args.threads)
    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)  # more workers than cores, on purpose
    data = write_photos(args.data, args.images, tuple(args.photo_size))
    samples: dict[tuple[int, int], list[float]] = {(e, w): [] for e in range(args.epochs) for w in args.workers}
    for repetition in range(args.repeats):
        shift = repetition % len(args.workers)
        for w in args.workers[shift:] + args.workers[:shift]:
            loader = epoch_loader(data, w, args.batch_size, args.image_size)  # a new dataset: nothing decoded yet
            for epoch, seconds in enumerate(timed_epochs(loader, args.epochs, args.images)):
                samples[(epoch, w)].append(seconds)
    reference = args.workers[0]
    rows = [
        [("first", "second")[e], str(w), f"{statistics.median(samples[(e, w)]):.2f}", f"{max(samples[(e, w)]):.2f}",
         f"{args.images / statistics.median(samples[(e, w)]):.0f}", f"{paired_ratio(samples[(e, reference)], samples[(e, w)]):.2f}x"]
        for e in range(args.epochs) for w in args.workers
    ]
    print(f"{args.images} JPEGs of {args.photo_size[0]}x{args.photo_size[1]} -> {args.image_size} px, batches of {args.batch_size}; "
          f"{os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}; {args.repeats} repetitions")
    print(markdown_table(["epoch", "workers", "seconds (median)", "worst", "images/s", f"speed-up over {reference} workers"], rows))


if __name__ == "__main__":
    main()

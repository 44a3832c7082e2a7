#!/usr/bin/env python
"""A large imagefolder dataset, read as `vlfuse fit` reads it: metadata checked up front, memory, an epoch.

Writes (once) ``--rows`` questions over ``--images`` small PNG images into ``DIR/train/`` (a
``metadata.jsonl``), then, in a fresh process for each measurement:

- **check**: ``ImageFolderDataModule.records("train")``, what ``vlfuse fit`` does before training
  (every row parsed, every distinct image's header read and decoded at the model's size): seconds,
  and the process's peak resident memory after importing vlfuse and after the check;
- **epoch**: one pass of the training loader without a model (decode, resize, batch): seconds and
  images/s;
- **bad row**: the same check with one bad row appended (an image that does not exist): the line
  ``vlfuse fit`` stops with, naming the file and the line, before training.

With ``--shards``, the same from streaming shards (issue 34, item 2), each in a fresh process too:

- **convert**: ``vlfuse convert --data-dir DIR --out DIR_shards`` (once: ``litdata.optimize``, one
  worker): seconds and peak memory (of the command and of litdata's worker);
- **shards epoch**: one pass of ``StreamingDataModule``'s training loader over the shards, as the
  folder's epoch: seconds, images/s, peak memory; and whether both epochs read the same items:
  a digest of every image's key, the sum of its decoded pixels, its questions and their labels,
  in any order (the folder's epoch in its order, the shards' in litdata's).

Example:
    .venv/bin/python scripts/stress_imagefolder.py --rows 200000 --images 20000
    .venv/bin/python scripts/stress_imagefolder.py --rows 200000 --images 20000 --shards
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _common import REPO
from PIL import Image

MEASURE = """
import json, resource, sys, time
start = time.perf_counter()
from vlfuse.datamodules import ImageFolderDataModule
imported_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
data = ImageFolderDataModule(data_dir=sys.argv[1], image_size=int(sys.argv[2]), batch_size=int(sys.argv[3]))
checked = time.perf_counter()
try:
    records = data.records("train")
except ValueError as err:
    print(json.dumps({"error": str(err)}))
    raise SystemExit(0)
result = {"import_s": checked - start, "check_s": time.perf_counter() - checked, "images": len(records),
          "rows": sum(len(r.questions) for r in records), "imported_mb": imported_mb,
          "checked_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
if sys.argv[4] == "epoch":
    timed_epoch(data.train_dataloader(), result)
print(json.dumps(result))
"""
EPOCH = """
import hashlib, resource, time
def epoch(loader):  # one pass over loader: per image, its key, pixel sum, questions and labels (no pixels kept)
    rows = []
    for batch in loader:
        sums = batch["pixel_values"].double().sum(dim=(1, 2, 3)).tolist()
        ends = batch["image_index"].bincount(minlength=len(sums)).cumsum(0).tolist()  # each image's questions follow
        labels = batch["labels"].tolist()
        for i, key in enumerate(batch["image_keys"]):
            begin = ends[i - 1] if i else 0
            rows.append((key, sums[i], tuple(batch["questions"][begin : ends[i]]), tuple(labels[begin : ends[i]])))
    return rows
def digest(rows):  # the images read and a digest of what they hold, in any order
    return len(rows), hashlib.sha256(repr(sorted(rows)).encode()).hexdigest()
def timed_epoch(loader, result):  # one epoch's seconds, peak memory after it, images and digest, into result
    started = time.perf_counter()
    rows = epoch(loader)
    result["epoch_s"] = time.perf_counter() - started
    result["epoch_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["epoch_images"], result["epoch_digest"] = digest(rows)
"""
SHARDS = """
import json, resource, sys, time
start = time.perf_counter()
from vlfuse.datamodules import StreamingDataModule
imported_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
data = StreamingDataModule(data_dir=sys.argv[1], image_size=int(sys.argv[2]), batch_size=int(sys.argv[3]))
loader = data.train_dataloader()
result = {"import_s": time.perf_counter() - start, "imported_mb": imported_mb}
timed_epoch(loader, result)
print(json.dumps(result))
"""
CONVERT = """
import json, resource, sys, time
start = time.perf_counter()
from vlfuse.cli import main
code = main(["convert", "--data-dir", sys.argv[1], "--out", sys.argv[4]])
result = {"convert_s": time.perf_counter() - start, "code": code,
          "convert_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          "worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
print(json.dumps(result))
"""


def write_dataset(folder: Path, rows: int, images: int, side: int = 16, seed: int = 0) -> Path:
    """``folder/train``: ``images`` PNGs of ``side`` px and a ``metadata.jsonl`` of ``rows`` questions,
    row i about image ``i mod images``; written once (the metadata file, written last, marks it done)."""
    split = folder / "train"
    metadata = split / "metadata.jsonl"
    if metadata.is_file() and sum(1 for _ in metadata.open()) == rows:
        return folder
    split.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(images):
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(split / f"{i:06d}.png")
    with metadata.open("w") as out:
        for r in range(rows):
            row = {"file_name": f"{r % images:06d}.png", "question": f"what is shown in part {r % 97}?", "answer": f"thing {r % 50}"}
            out.write(json.dumps(row) + "\n")
    return folder


def measure(folder: Path, image_size: int, batch_size: int, what: str, script: str | None = None) -> dict:
    """One measurement in a fresh Python process (its memory is the process's own): ``script``
    (default: the folder's, ``MEASURE``) with the arguments ``folder``, ``image_size``, ``batch_size``, ``what``."""
    command = [sys.executable, "-c", EPOCH + (script or MEASURE), str(folder), str(image_size), str(batch_size), what]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"error: the measurement failed: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def with_bad_row(folder: Path, bad: Path) -> Path:
    """A copy of ``folder``'s metadata (its images hard-linked: a symbolic link leads outside the split
    folder, itself a bad row) with a row about a missing image at the end."""
    split = bad / "train"
    split.mkdir(parents=True, exist_ok=True)
    for image in (folder / "train").glob("*.png"):
        target = split / image.name
        if not target.exists():
            os.link(image, target)
    lines = (folder / "train" / "metadata.jsonl").read_text()
    missing = {"file_name": "missing.png", "question": "what is here?", "answer": "thing 0"}
    (split / "metadata.jsonl").write_text(lines + json.dumps(missing) + "\n")
    return bad


def shards_side(folder: Path, shards: Path, args: argparse.Namespace, folder_epoch: dict) -> None:
    """Convert ``folder`` into ``shards`` (once) and read an epoch from them, beside the folder's epoch."""
    if not shards.exists():
        converted = measure(folder, 0, 0, str(shards), CONVERT)
        size = sum(f.stat().st_size for f in shards.rglob("*")) / 1e6
        print(f"convert: {converted['convert_s']:.1f} s (imports included); peak memory {converted['convert_mb']:.0f} MB, "
              f"litdata's worker {converted['worker_mb']:.0f} MB; {size:.1f} MB of shards")
    else:
        print(f"convert: {shards} exists (converted by an earlier run)")
    result = measure(shards, args.image_size, args.batch_size, "epoch", SHARDS)
    ratio = (result["epoch_images"] / result["epoch_s"]) / (folder_epoch["epoch_images"] / folder_epoch["epoch_s"])
    print(f"shards epoch: {result['epoch_images']:,} images in {result['epoch_s']:.1f} s "
          f"({result['epoch_images'] / result['epoch_s']:.0f} images/s, {ratio:.2f}x the folder's), "
          f"peak memory {result['epoch_mb']:.0f} MB ({result['imported_mb']:.0f} MB after the imports)")
    same = result["epoch_digest"] == folder_epoch["epoch_digest"] and result["epoch_images"] == folder_epoch["epoch_images"]
    print(f"same items as the folder's epoch: {'yes' if same else 'NO'} (digest {result['epoch_digest'][:12]})")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "stress_imagefolder", metavar="DIR",
                        help="where the dataset is written (once) and read from")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--image-size", type=int, default=32, help="the side the model reads (default 32)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--no-epoch", action="store_true", help="measure the check only")
    parser.add_argument("--shards", action="store_true",
                        help="also convert the dataset to streaming shards (once, into DIR_shards) and read an epoch from them")
    args = parser.parse_args(argv)
    if args.images < 1 or args.rows < args.images:
        raise SystemExit("error: --images must be at least 1 and --rows at least --images")
    started = time.perf_counter()
    folder = write_dataset(args.data, args.rows, args.images)
    print(f"dataset: {args.rows:,} rows over {args.images:,} images of 16 px in {folder} ({time.perf_counter() - started:.0f} s)")
    result = measure(folder, args.image_size, args.batch_size, "check" if args.no_epoch else "epoch")
    print(f"check: {result['rows']:,} rows, {result['images']:,} images in {result['check_s']:.1f} s "
          f"(imports {result['import_s']:.1f} s); peak memory {result['imported_mb']:.0f} MB after the imports, "
          f"{result['checked_mb']:.0f} MB after the check")
    if not args.no_epoch:
        print(f"epoch: {result['epoch_images']:,} images in {result['epoch_s']:.1f} s "
              f"({result['epoch_images'] / result['epoch_s']:.0f} images/s), peak memory {result['epoch_mb']:.0f} MB")
    if args.shards and not args.no_epoch:
        shards_side(folder, args.data.with_name(args.data.name + "_shards"), args, result)
    bad = measure(with_bad_row(folder, args.data.with_name(args.data.name + "_bad_row")), args.image_size, args.batch_size, "check")
    print(f"bad row: {bad.get('error', 'NOT FOUND')}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Frozen image features read from a store on disk against recomputed, and the reader's memory.

(a) An epoch's image features, side by side: a frozen ViT-B/16 at 224 px (``vit_base_patch16_224``,
from-scratch weights: the cost is the same as pretrained) run over ``--images`` decoded images in
batches of ``--batch-size``, against the same features read from a store (float32 and float16)
written once by :class:`~vlfuse.encoders.feature_store.FeatureStoreWriter` (what ``vlfuse
cache-features`` writes), each epoch in a new shuffled order, read back in float32. Each repetition
runs every case in an order rotated by one (:mod:`vlfuse.analysis.timing`); a speed-up is the median
(and the worst) of the per-repetition ratios.

(b) Resident memory while reading every feature of a large store: ``--store-gb`` GB of random ViT-B
features (197 x 768 float32 an image, 1 GiB shards) written once into ``--dir``, then read in
shuffled batches of ``--batch-size`` by each reader: ``pread`` (:class:`DiskFeatureStore`, what
training uses), a numpy memory map of each shard and safetensors' ``safe_open`` slices. The peak
resident set (VmRSS, sampled after every batch; its file-backed part RssFile apart) and the
throughput of each pass.

Example:
    .venv/bin/python scripts/bench_feature_store.py --images 128 --repeats 3 --store-gb 20 --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from _common import add_threads_argument, set_threads
from safetensors import safe_open

from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import time_interleaved
from vlfuse.encoders import ImageEncoder, ImageEncoderConfig
from vlfuse.encoders.feature_store import DiskFeatureStore, FeatureStoreWriter, TENSOR, rows_per_shard

VIT_B = ImageEncoderConfig(name="vit_base_patch16_224", image_size=224, patch_size=None, width=None, depth=None, num_heads=None, freeze=True)
"""timm's ViT-B/16 at 224 px as it is built (no size overrides), frozen."""
VIT_B_SHAPE = (197, 768)
"""Tokens and width of one image's ViT-B/16 features (the class token and 14 x 14 patches)."""


def memory_kib() -> dict[str, int]:
    """This process's VmRSS, RssAnon and RssFile (KiB), from /proc/self/status."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            values[name] = int(rest.split()[0])
    return values


def batches(keys: list[str], batch_size: int, seed: int) -> list[list[str]]:
    """``keys`` shuffled with ``seed``, in batches."""
    order = list(keys)
    random.Random(seed).shuffle(order)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


# ------------------------------------------------------------------------------ (a) epoch time
def epoch_cases(args: argparse.Namespace) -> tuple[dict[str, Callable[[], object]], int]:
    """The cases of (a): the encoder over the decoded images, and the store read in each dtype."""
    torch.manual_seed(0)
    encoder = ImageEncoder(VIT_B).eval()
    pixels = torch.rand(args.images, 3, 224, 224)
    keys = [f"image_{i:06d}.jpg" for i in range(args.images)]
    with torch.inference_mode():
        features = torch.cat([encoder(pixels[i : i + args.batch_size]) for i in range(0, args.images, args.batch_size)])
    stores = {}
    for dtype in (torch.float32, torch.float16):
        folder = args.dir / f"epoch_{args.images}_{str(dtype).split('.')[1]}"
        with FeatureStoreWriter(folder, encoder.feature_identity(), dtype, VIT_B_SHAPE) as writer:
            if len(writer) < args.images:
                writer.add_shard(keys, features.to(dtype))
        stores[dtype] = DiskFeatureStore(folder)
    epochs = iter(range(1 << 30))

    def recompute() -> None:
        with torch.inference_mode():
            for i in range(0, args.images, args.batch_size):
                encoder(pixels[i : i + args.batch_size])

    def read(store: DiskFeatureStore) -> Callable[[], None]:
        def run() -> None:
            for batch in batches(keys, args.batch_size, next(epochs)):
                store.get(batch).to(torch.float32)
        return run

    cases = {"ViT-B/16 recomputed": recompute, "store float32": read(stores[torch.float32]), "store float16": read(stores[torch.float16])}
    return cases, args.images


def part_a(args: argparse.Namespace) -> None:
    cases, images = epoch_cases(args)
    timings = time_interleaved(cases, args.repeats, args.warmup)
    reference = "ViT-B/16 recomputed"
    rows = []
    for name in cases:
        ratios = [r / c for r, c in zip(timings.samples[reference], timings.samples[name])]
        rows.append([name, f"{timings.median(name):.3f}", f"{max(timings.samples[name]):.3f}", f"{images / timings.median(name):,.0f}",
                     f"{statistics.median(ratios):.1f}x", f"{min(ratios):.1f}x"])
    print(f"(a) an epoch of {images} images' features, batches of {args.batch_size}, {args.repeats} repetitions")
    print(markdown_table(["case", "seconds (median)", "worst", "images/s", "speed-up over recomputing (median)", "worst"], rows))


# ------------------------------------------------------------------------------ (b) memory
def simulated_store(folder: Path, gigabytes: float) -> DiskFeatureStore:
    """A store of random ViT-B/16 features, ``gigabytes`` GB of float32 in 1 GiB shards (written once)."""
    per_shard = rows_per_shard(VIT_B_SHAPE, torch.float32)
    total = int(gigabytes * 1e9) // (VIT_B_SHAPE[0] * VIT_B_SHAPE[1] * 4)
    identity = {"name": "random", "weights_sha256": "0" * 64, "image_size": 224, "mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bicubic"}
    with FeatureStoreWriter(folder, identity, torch.float32, VIT_B_SHAPE) as writer:
        if len(writer) < total:
            generator = torch.Generator().manual_seed(0)
            noise = torch.randn((per_shard, *VIT_B_SHAPE), generator=generator)  # one shard's worth, shifted per shard
            for start in range(len(writer), total, per_shard):
                rows = min(per_shard, total - start)
                noise += 1.0  # in place: one shard's worth of memory (and its copy while safetensors writes it)
                writer.add_shard([f"image_{i:08d}.jpg" for i in range(start, start + rows)], noise[:rows])
                print(f"  wrote {start + rows:,} of {total:,} images", flush=True)
            del noise
    return DiskFeatureStore(folder)


def memmap_reader(store: DiskFeatureStore) -> Callable[[list[str]], torch.Tensor]:
    """Rows gathered from numpy memory maps of the shards' feature bytes."""
    maps = [np.memmap(s.path, dtype=np.float32, mode="r", offset=s.offset, shape=(s.rows, *store.shape)) for s in store.shards]

    def read(keys: list[str]) -> torch.Tensor:
        return torch.from_numpy(np.stack([maps[shard][row] for shard, row in map(store.place, keys)]))

    return read


def safe_open_reader(store: DiskFeatureStore) -> Callable[[list[str]], torch.Tensor]:
    """Rows read with safetensors' ``safe_open(..., framework="pt")``, one slice each."""
    slices = [safe_open(str(s.path), framework="pt").get_slice(TENSOR) for s in store.shards]

    def read(keys: list[str]) -> torch.Tensor:
        return torch.cat([slices[shard][row : row + 1] for shard, row in map(store.place, keys)])

    return read


def read_everything(read: Callable[[list[str]], torch.Tensor], keys: list[str], batch_size: int) -> dict[str, float]:
    """Read every key once in shuffled batches; the peak VmRSS (and its parts then) and the throughput."""
    peak = memory_kib()
    start = time.perf_counter()
    read_bytes = 0
    for batch in batches(keys, batch_size, 0):
        read_bytes += read(batch).nbytes
        now = memory_kib()
        if now["VmRSS"] > peak["VmRSS"]:
            peak = now
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "GB/s": read_bytes / seconds / 1e9, **{k: v / 2**20 for k, v in peak.items()}}


def part_b(args: argparse.Namespace) -> None:
    store = simulated_store(args.dir / f"random_{args.store_gb:g}GB", args.store_gb)
    size = sum(s.path.stat().st_size for s in store.shards) / 1e9
    keys = list(store)
    readers = {"pread (DiskFeatureStore)": lambda: store.get, "numpy memmap": lambda: memmap_reader(store), "safetensors safe_open": lambda: safe_open_reader(store)}
    rows = []
    before = memory_kib()["VmRSS"] / 2**20
    for name in args.readers:
        result = read_everything(readers[name](), keys, args.batch_size)
        rows.append([name, f"{result['VmRSS']:.2f}", f"{result['RssAnon']:.2f}", f"{result['RssFile']:.2f}", f"{result['seconds']:.0f}",
                     f"{result['GB/s']:.2f}", f"{len(keys) / result['seconds']:,.0f}"])
    print(f"(b) every feature of a {size:.1f} GB store ({len(keys):,} images, {len(store.shards)} shards) read once in shuffled "
          f"batches of {args.batch_size}; resident {before:.2f} GiB before reading")
    print(markdown_table(["reader", "peak VmRSS GiB", "RssAnon then", "RssFile then", "seconds", "GB/s", "images/s"], rows))


READERS = ("pread (DiskFeatureStore)", "numpy memmap", "safetensors safe_open")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("runs") / "bench_feature_store", metavar="DIR",
                        help="where the stores are written (once) and read from")
    parser.add_argument("--parts", nargs="+", choices=("a", "b"), default=["a", "b"], help="(a) epoch time, (b) memory")
    parser.add_argument("--images", type=int, default=128, help="(a) images of an epoch (default 128)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="(a) timed repetitions of every case, side by side")
    parser.add_argument("--warmup", type=int, default=0, help="(a) untimed repetitions first")
    parser.add_argument("--store-gb", type=float, default=20.0, help="(b) the simulated store's size in GB (default 20)")
    parser.add_argument("--readers", nargs="+", choices=READERS, default=list(READERS), metavar="R",
                        help=f"(b) the readers to measure, in order (default all: {', '.join(READERS)})")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    if args.images < 1 or args.repeats < 1 or args.store_gb <= 0:
        raise SystemExit("error: --images and --repeats must be at least 1, --store-gb positive")
    set_threads(args.threads)
    print(f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}, Python {platform.python_version()}")
    if "a" in args.parts:
        part_a(args)
    if "b" in args.parts:
        part_b(args)


if __name__ == "__main__":
    main()

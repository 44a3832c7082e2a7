"""What each explanation method costs: seconds to explain one question about one image.

Builds a ``vlfuse fit`` config's model from scratch (default: the real-size preset,
configs/base_224.yaml: ViT-B/16 at 224 px, 6 fusion blocks of 768) and times
:func:`vlfuse.analysis.explain.explain` with every method the model takes, one after the other in
each round, on a random image; reports the median of the rounds and the ratio to raw attention.
``occlusion`` runs one forward pass per patch (196 at 224 px), the others one or two passes.

    .venv/bin/python scripts/bench_explain.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from _common import REPO, add_threads_argument, set_threads

from vlfuse.analysis.data import read_config
from vlfuse.analysis.explain import METHODS, MethodRefused, explain
from vlfuse.model import VLFuseConfig, VLFuseModel

QUESTION = "what color is the shape?"


def time_methods(model: VLFuseModel, image: np.ndarray, rounds: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``{method: seconds of each round}`` for every method ``model`` takes, and ``{method: why not}``
    for those it refuses."""
    seconds: dict[str, list[float]] = {}
    refused: dict[str, str] = {}
    explain(model, image, QUESTION, "attention")  # untimed: the first pass allocates for good
    for _ in range(rounds):
        for method in METHODS:
            if method in refused:
                continue
            start = time.perf_counter()
            try:
                explain(model, image, QUESTION, method)
            except MethodRefused as why:
                refused[method] = str(why)
                continue
            seconds.setdefault(method, []).append(time.perf_counter() - start)
    return seconds, refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "base_224.yaml"), help="a vlfuse fit config (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every method; the median is reported (default %(default)s)")
    add_threads_argument(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"error: --rounds must be at least 1, got {args.rounds}")
    set_threads(args.threads)
    config = VLFuseConfig.from_dict(read_config(args.config)["model"]["architecture"])
    torch.manual_seed(0)
    model = VLFuseModel.from_config(config, ["no", "yes", "red"], [QUESTION]).eval()
    size = config.image.image_size
    image = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    seconds, refused = time_methods(model, image, args.rounds)
    rows, cols = model.image_encoder.grid_size
    print(f"{args.config}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, {rows} x {cols} patches, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds\n")
    print("| method | seconds a question | / attention |")
    print("|:---|---:|---:|")
    reference = statistics.median(seconds["attention"])
    for method, times in seconds.items():
        median = statistics.median(times)
        print(f"| {method} | {median:.2f} | {median / reference:.1f}x |")
    for method, why in refused.items():
        print(f"\n{method}: not timed, this model refuses it: {why}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Greedy caption decoding with the key/value cache against without it, side by side in one run.

With the cache, each step feeds the decoder only the newest token (the self-attention keys/values of
the earlier ones are kept); without it, each step runs the decoder over the whole prefix again. The
image keys/values are projected once per image in both. Both cases decode the same images to the
same length (``--length`` tokens after the begin token; a caption that ends earlier is padded while
the others go on), alternately, and the script prints the median of the paired time ratios and
checks that both wrote identical captions (exit status 1 if not).

Without ``--model`` the caption model of configs/shapes_captions.yaml is built untrained (speed does
not depend on the weights), with the grammar's words as its vocabulary.

Example:
    .venv/bin/python scripts/bench_generate.py
    .venv/bin/python scripts/bench_generate.py --model runs/shapes_captions/latest/model --images 64 --threads 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from _common import REPO, add_threads_argument, add_timing_arguments, set_threads

from vlfuse.analysis.data import read_config
from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import time_interleaved
from vlfuse.captioning import CaptionConfig, CaptionModel, greedy
from vlfuse.data.shapes import COLOURS, SHAPES, render_scenes, sample_scenes

DEFAULT_CONFIG = REPO / "configs" / "shapes_captions.yaml"
GRAMMAR_WORDS = f"a is left of above there . {' '.join(COLOURS)} {' '.join(SHAPES)}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("Example:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, metavar="DIR", help="saved caption model (default: the config's, untrained)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="config whose model.init_args.caption_model to build when --model is not given")
    parser.add_argument("--images", type=int, default=64, help="SHAPES scenes captioned in one batch (default 64)")
    parser.add_argument("--length", type=int, default=30, help="tokens decoded per caption (default 30)")
    add_threads_argument(parser)
    add_timing_arguments(parser, repeats=5, warmup=1)
    return parser.parse_args(argv)


def caption_model(model_dir: Path | None, config: Path) -> CaptionModel:
    """The saved model, or the config's architecture built untrained with seed 0."""
    if model_dir is not None:
        try:
            return CaptionModel.from_pretrained(model_dir)
        except (FileNotFoundError, ValueError) as err:
            raise SystemExit(f"error: --model {model_dir}: {err}") from None
    architecture = caption_architecture(config)
    torch.manual_seed(0)
    return CaptionModel.from_config(architecture, [GRAMMAR_WORDS]).eval()


def caption_architecture(config: Path) -> CaptionConfig:
    """``config``'s ``model.init_args.caption_model``; a one-line ``SystemExit`` naming ``--config`` where it has none."""
    try:
        return CaptionConfig.from_dict(read_config(config)["model"]["init_args"]["caption_model"])
    except (FileNotFoundError, KeyError, TypeError, ValueError) as err:
        raise SystemExit(f"error: --config {config}: no usable model.init_args.caption_model ({err!r})") from None


def scene_pixels(scenes: list, rng: np.random.Generator, size: int) -> torch.Tensor:
    """SHAPES ``scenes`` drawn with ``rng``, as a caption model of image size ``size`` reads them: ``(N, 3, size, size)`` in [0, 1]."""
    images = render_scenes(scenes, rng)  # (N, 30, 30, 3) uint8
    return torch.nn.functional.interpolate(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255, size=(size, size))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    model = caption_model(args.model, args.config)
    rng = np.random.default_rng(0)
    pixels = scene_pixels(sample_scenes(args.images, rng), rng, model.config.image.image_size)
    captions = {}

    def decode(use_cache: bool):
        def run():
            captions[use_cache] = greedy(model, model.encode_images(pixels), max_length=args.length, use_cache=use_cache)
        return run

    timings = time_interleaved({"with cache": decode(True), "without cache": decode(False)}, args.repeats, args.warmup)
    same = [c.ids for c in captions[True]] == [c.ids for c in captions[False]]
    steps = max(len(c.ids) for c in captions[True])
    rows = [(case, timings.median(case), args.images * steps / timings.median(case)) for case in timings.samples]
    print(markdown_table(["decoding", "seconds per batch (median)", "tokens/s"], rows, formats=[None, "{:.3f}", "{:.0f}"]))
    print(f"\n{args.images} captions of {steps} tokens (threads {args.threads}, {args.repeats} repeats): "
          f"the cache is {timings.ratio('without cache', 'with cache'):.2f}x faster (median of paired ratios); "
          f"identical captions: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

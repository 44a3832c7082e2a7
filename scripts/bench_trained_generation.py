#!/usr/bin/env python
"""Greedy captions from trained caption models, each caption to its own end token: vlfuse's
:func:`~vlfuse.captioning.greedy` against transformers' ``generate``, side by side in one run.

    .venv/bin/python scripts/compare_caption_peers.py --threads 1 --lrs 2e-3 --save-weights --out runs/caption_peers
    .venv/bin/python scripts/bench_trained_generation.py --threads 1 --weights runs/caption_peers/weights --seed 0 --lr 2e-3

``scripts/bench_peers_speed.py`` times untrained models forced to write the same number of tokens;
here both models are trained (the best-epoch weights that ``compare_caption_peers.py
--save-weights`` keeps) and stop as a user's captioning does: vlfuse's greedy drops the rows of
ended captions from the batch (once they are :data:`vlfuse.captioning.generate.LEAVE_AT` of it),
``generate`` runs every row until the last caption ends. Each repetition captions the same
``--images`` SHAPES scenes (drawn with ``--scene-seed``, not the training scenes' seed) in one
batch with each model, in a rotating order
(:func:`vlfuse.analysis.timing.time_interleaved`), from pixels to caption texts. A ratio is
``generate``'s time / vlfuse's time in the same repetition (above 1: vlfuse is faster), reported
as the median and the worst (lowest). Beside the times: each model's mean tokens per caption (the
end token included), its fact precision on these scenes (both must be real captions), and the share
of scenes on which both models wrote the same caption.

``--leave-at F ...`` adds a case of vlfuse's greedy per share ``F`` of ended captions at which their
rows leave the batch (:data:`vlfuse.captioning.generate.LEAVE_AT`; a tiny share: as soon as one
ends; above 1: never, as ``generate`` does); the script stops if one writes other captions.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch
from _common import add_threads_argument, add_timing_arguments, set_threads
from bench_generate import DEFAULT_CONFIG, caption_architecture, scene_pixels
from compare_caption_peers import weights_name
from safetensors import safe_open
from safetensors.torch import load_file

from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import time_interleaved
from vlfuse.baselines.hf_caption import HFCaptionPeer
from vlfuse.captioning import CaptionConfig, CaptionModel, generate, greedy
from vlfuse.captioning.grammar import fact_precision
from vlfuse.captioning.model import caption_processor
from vlfuse.data.shapes import sample_scenes
from vlfuse.encoders import word_tokenizer_from_json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the caption config both models trained on")
    parser.add_argument("--weights", type=Path, required=True, help="the weights folder of compare_caption_peers.py --save-weights")
    parser.add_argument("--seed", type=int, default=0, help="the run seed of the weights (default 0)")
    parser.add_argument("--lr", type=float, default=2e-3, help="the learning rate of the weights (default 2e-3)")
    parser.add_argument("--images", type=int, default=64, help="SHAPES scenes captioned in one batch (default 64)")
    parser.add_argument("--scene-seed", type=int, default=1, help="seed of the scenes drawn (default 1)")
    parser.add_argument("--leave-at", type=float, nargs="+", default=[], metavar="F",
                        help="also time vlfuse's greedy with ended captions leaving at each share F of the batch")
    add_threads_argument(parser)
    add_timing_arguments(parser, repeats=11, warmup=2)
    args = parser.parse_args(argv)
    if args.images < 1 or args.repeats < 1:
        parser.error(f"--images and --repeats must be at least 1, got {args.images} and {args.repeats}")
    return args


def load_trained(name: str, architecture: CaptionConfig, args: argparse.Namespace) -> CaptionModel | HFCaptionPeer:
    """Model ``name`` (``vlfuse`` or ``hf``) at ``architecture``'s size, with the tokenizer and weights of its saved run."""
    path = args.weights / weights_name(name, args.seed, args.lr)
    if not path.is_file():
        raise SystemExit(f"error: --weights {args.weights}: {path.name} not found (compare_caption_peers.py --save-weights writes it)")
    with safe_open(path, "pt") as file:
        tokenizer = word_tokenizer_from_json(file.metadata()["tokenizer"], architecture.max_length)
    processor = caption_processor(architecture, tokenizer)
    model = CaptionModel(architecture, processor) if name == "vlfuse" else HFCaptionPeer.from_processor(architecture, processor)
    model.load_state_dict(load_file(path))
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    architecture = caption_architecture(args.config)
    vlfuse, peer = (load_trained(name, architecture, args) for name in ("vlfuse", "hf"))
    rng = np.random.default_rng(args.scene_seed)
    scenes = sample_scenes(args.images, rng)
    pixels = scene_pixels(scenes, rng, architecture.image.image_size)
    written: dict[str, tuple[list[str], list[int]]] = {}

    def vlfuse_greedy(name: str, share: float):
        def run():
            default, generate.LEAVE_AT = generate.LEAVE_AT, share
            try:
                captions = greedy(vlfuse, vlfuse.encode_images(pixels))
            finally:
                generate.LEAVE_AT = default
            written[name] = [c.text for c in captions], [len(c.ids) for c in captions]
        return run

    def run_peer():
        ids = peer.generate_ids(pixels)  # (B, 1 + T), rows that ended early padded
        rows = [row[1:] for row in ids.tolist()]
        lengths = [row.index(peer.eos_id) + 1 if peer.eos_id in row else len(row) for row in rows]
        written["transformers generate"] = [peer.detokenize(row) for row in rows], lengths

    cases = {"vlfuse greedy": vlfuse_greedy("vlfuse greedy", generate.LEAVE_AT), "transformers generate": run_peer}
    cases.update({(name := f"vlfuse greedy, leave at {share:g}"): vlfuse_greedy(name, share) for share in args.leave_at})
    timings = time_interleaved(cases, args.repeats, args.warmup)
    if any(written[name][0] != written["vlfuse greedy"][0] for name in cases if name.startswith("vlfuse")):
        raise SystemExit("error: a --leave-at case wrote other captions than vlfuse's greedy")
    rows = []
    for name in cases:
        texts, lengths = written[name]
        right, said = map(sum, zip(*(fact_precision(text, scene) for text, scene in zip(texts, scenes))))
        ratios = [t / r for t, r in zip(timings.samples[name], timings.samples["vlfuse greedy"])]
        rows.append([name, timings.median(name) * 1e3, args.images / timings.median(name), statistics.mean(lengths), max(lengths),
                     100 * right / max(said, 1), statistics.median(ratios), min(ratios)])
    same = sum(a == b for a, b in zip(written["vlfuse greedy"][0], written["transformers generate"][0]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repetitions side by side "
          f"({args.warmup} untimed first); {args.images} scenes in one batch (scene seed {args.scene_seed}); "
          f"weights: seed {args.seed}, lr {args.lr:g}; the same caption from both models: {same} of {args.images}")
    print(markdown_table(["case", "ms (median)", "captions/s", "tokens per caption (mean)", "longest", "fact precision %",
                          "time / vlfuse's (median)", "worst"], rows,
                         formats=[None, "{:.1f}", "{:.1f}", "{:.1f}", None, "{:.2f}", "{:.2f}", "{:.2f}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

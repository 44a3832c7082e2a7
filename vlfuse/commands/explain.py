"""``vlfuse explain``: maps of where a saved model looked to answer one question about one image."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from vlfuse import model_io
from vlfuse.analysis.explain import METHODS, draw_explanation, explain_pixels
from vlfuse.commands import SUBCOMMANDS
from vlfuse.model import VLFuseModel
from vlfuse.runtime import add_device_argument, add_threads_argument, set_threads


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse explain``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse explain",
        description=SUBCOMMANDS["explain"].description,
        epilog="examples:\n"
        "  vlfuse explain --model runs/easy_vqa/latest/model --image shape.png --question 'what shape is it?'\n"
        "  vlfuse explain --model runs/easy_vqa/latest/model --image shape.png --question 'what color is it?' "
        "--method gradcam rollout --answer red --output maps/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="model directory (written by save_pretrained or the fit export)")
    parser.add_argument("--image", required=True, help="image file")
    parser.add_argument("--question", required=True, help="question about the image")
    parser.add_argument("--method", nargs="+", choices=list(METHODS), default=list(METHODS), metavar="M",
                        help=f"explanation methods, of {', '.join(METHODS)} (default all)")
    parser.add_argument("--answer", help="the answer to explain, one of the model's (default: the predicted one)")
    parser.add_argument("--layer", type=int, metavar="L",
                        help="fusion layer of 'attention' and 'gradcam' (default the last; -1 counts from the end)")
    parser.add_argument("--output", type=Path, default=Path("explanations"), metavar="DIR",
                        help="where to write the figures, maps (.npz) and sidecar (.json) (default explanations/)")
    add_device_argument(parser)
    add_threads_argument(parser)
    return parser


def main(argv: list[str]) -> int:
    """``vlfuse explain``: draw each method's maps of the whole question and of each word."""
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    model = VLFuseModel.from_pretrained(args.model, map_location=args.device)
    model.require_fusion_heads("explain", args.model)
    pixels = model.processor.image(args.image)  # (3, S, S); a bad image is an error naming it
    stem = Path(args.image).stem or "image"
    explanations = [
        explain_pixels(model, pixels[None], args.question, method, answer=args.answer, layer=args.layer)
        for method in args.method
    ]
    written = []
    for e in explanations:
        written += draw_explanation(e, pixels, args.output, f"{stem}_{e.method}")
    arrays = {f"{e.method}_question": e.question_map for e in explanations}
    arrays.update({f"{e.method}_tokens": e.token_maps for e in explanations if e.token_maps is not None})
    np.savez(args.output / f"{stem}.npz", **arrays)
    first = explanations[0]
    sidecar = {
        "image": os.fspath(args.image),
        "question": args.question,
        "answer": first.answer,
        "probability": first.probability,
        "tokens": first.tokens,
        "grid": list(first.grid),
        "num_prefix_tokens": first.num_prefix_tokens,
        "maps": f"{stem}.npz: METHOD_question (prefix + patch tokens,) sums to 1; "
                "METHOD_tokens (heads, tokens, prefix + patch tokens)",
        "methods": {e.method: {"layer": e.layer, "heads": e.heads} for e in explanations},
    }
    model_io.write_json(args.output / f"{stem}.json", sidecar, indent=1)
    written += [args.output / f"{stem}.npz", args.output / f"{stem}.json"]
    print(f"answer: {first.answer} (probability {first.probability:.4f})")
    print(f"vlfuse explain: wrote {len(written)} files to {args.output}:", file=sys.stderr)
    for path in written:
        print(f"  {path}", file=sys.stderr)
    return 0

"""``vlfuse explain``: maps of where a saved model looked to answer one question about one image."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from vlfuse import model_io
from vlfuse.analysis.explain import METHODS, MethodRefused, draw_explanation, draw_maps, explain_pixels
from vlfuse.commands import SUBCOMMANDS
from vlfuse.runtime import add_device_argument, add_threads_argument, set_threads


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse explain``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse explain",
        description=SUBCOMMANDS["explain"].description,
        epilog="examples:\n"
        "  vlfuse explain --model runs/easy_vqa/latest/model --image shape.png --question 'what shape is it?'\n"
        "  vlfuse explain --model runs/easy_vqa/latest/model --image shape.png --question 'what color is it?' "
        "--method gradcam rollout --answer red --output maps/\n"
        "  vlfuse explain --model runs/shapes_captions/latest/model --image scene.png --method gradcam",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="model directory (written by save_pretrained or the fit export)")
    parser.add_argument("--image", required=True, help="image file")
    parser.add_argument("--question", help="question about the image (an answering model); a caption model "
                        "explains each word of the caption it writes")
    parser.add_argument("--method", nargs="+", choices=list(METHODS), metavar="M",
                        help=f"explanation methods, of {', '.join(METHODS)} (default every method that explains the model; "
                        "a caption model: all but rollout)")
    parser.add_argument("--answer", help="the answer to explain, one of the model's (default: the predicted one)")
    parser.add_argument("--layer", type=int, metavar="L",
                        help="fusion layer of 'attention' and 'gradcam' (default the last; -1 counts from the end)")
    parser.add_argument("--output", type=Path, default=Path("explanations"), metavar="DIR",
                        help="where to write the figures, maps (.npz) and sidecar (.json) (default explanations/)")
    add_device_argument(parser)
    add_threads_argument(parser)
    return parser


def main(argv: list[str]) -> int:
    """``vlfuse explain``: draw each method's maps of the whole question (or caption) and of each word."""
    parser = build_parser()
    args = parser.parse_args(argv)
    set_threads(args.threads)
    from vlfuse.captioning.model import CaptionModel, is_caption_model  # after the arguments: torch loads here

    if is_caption_model(args.model):
        if args.question is not None or args.answer is not None:
            parser.error(f"--model {args.model} is a caption model: it explains its own caption (no --question, --answer)")
        return _explain_caption(CaptionModel.from_pretrained(args.model, map_location=args.device), args)
    if args.question is None:
        parser.error(f"--question is needed: --model {args.model} answers questions")
    from vlfuse.model import VLFuseModel

    model = VLFuseModel.from_pretrained(args.model, map_location=args.device)
    model.require_fusion_heads("explain", args.model)
    pixels = model.processor.image(args.image)  # (3, S, S); a bad image is an error naming it
    stem = _stem(args.image)
    explanations = []
    for method in args.method or list(METHODS):
        try:
            explanations.append(explain_pixels(model, pixels[None], args.question, method, answer=args.answer, layer=args.layer))
        except MethodRefused as refused:
            if args.method:  # asked for by name: an error
                raise
            print(f"vlfuse explain: skipped {method}: {refused}", file=sys.stderr)
    written = []
    for e in explanations:
        written += draw_explanation(e, pixels, args.output, f"{stem}_{e.method}")
    first = explanations[0]
    sidecar = {
        "question": args.question,
        "answer": first.answer,
        "probability": first.probability,
        "tokens": first.tokens,
        "maps": f"{stem}.npz: METHOD_question (prefix + patch tokens,) sums to 1; "
                "METHOD_tokens (heads, tokens, prefix + patch tokens)",
    }
    written += _write_maps(args, stem, explanations, "question", {e.method: e.question_map for e in explanations}, sidecar)
    print(f"answer: {first.answer} (probability {first.probability:.4f})")
    return _print_written(args.output, written)


def _explain_caption(model, args: argparse.Namespace) -> int:
    from vlfuse.analysis.explain_caption import CAPTION_METHODS, explain_caption

    methods = args.method or list(CAPTION_METHODS)
    refused = [m for m in methods if m not in CAPTION_METHODS]
    if refused:
        raise ValueError(f"--method {' '.join(refused)}: a caption model is explained by {', '.join(CAPTION_METHODS)}")
    pixels = model.processor.image(args.image)  # (3, S, S)
    stem = _stem(args.image)
    explanations = [explain_caption(model, pixels[None], method, layer=args.layer) for method in methods]
    written = []
    for e in explanations:
        where = f"layer {e.layer}" if e.layer is not None else "all layers"
        written += draw_maps(pixels, e.caption_map, e.token_maps, e.words, e.heads, e.grid, e.num_prefix_tokens,
                             method=e.method, title=f"{e.method}, {where}: {e.caption!r}", whole="caption",
                             directory=args.output, stem=f"{stem}_{e.method}")
    first = explanations[0]
    sidecar = {
        "caption": first.caption,
        "tokens": first.words,
        "maps": f"{stem}.npz: METHOD_caption (prefix + patch tokens,) sums to 1; "
                "METHOD_tokens (heads, words, prefix + patch tokens)",
    }
    written += _write_maps(args, stem, explanations, "caption", {e.method: e.caption_map for e in explanations}, sidecar)
    print(f"caption: {first.caption}")
    return _print_written(args.output, written)


def _stem(image: str) -> str:
    return Path(image).stem or "image"


def _write_maps(args: argparse.Namespace, stem: str, explanations: list, whole: str, whole_maps: dict, sidecar: dict) -> list[Path]:
    """Write ``STEM.npz`` (each method's whole map and token maps) and the ``STEM.json`` sidecar."""
    arrays = {f"{method}_{whole}": whole_map for method, whole_map in whole_maps.items()}
    arrays.update({f"{e.method}_tokens": e.token_maps for e in explanations if e.token_maps is not None})
    np.savez(args.output / f"{stem}.npz", **arrays)
    first = explanations[0]
    sidecar = {
        "image": os.fspath(args.image),
        **sidecar,
        "grid": list(first.grid),
        "num_prefix_tokens": first.num_prefix_tokens,
        "methods": {e.method: {"layer": e.layer, "heads": e.heads} for e in explanations},
    }
    model_io.write_json(args.output / f"{stem}.json", sidecar, indent=1)
    return [args.output / f"{stem}.npz", args.output / f"{stem}.json"]


def _print_written(output: Path, written: list[Path]) -> int:
    print(f"vlfuse explain: wrote {len(written)} files to {output}:", file=sys.stderr)
    for path in written:
        print(f"  {path}", file=sys.stderr)
    return 0

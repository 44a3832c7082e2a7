"""``vlfuse caption``: describe images with a saved caption model, one (``--image``) or a JSONL file (``--input``)."""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

from vlfuse.commands import SUBCOMMANDS
from vlfuse.inference.captioner import Captioner
from vlfuse.inference.jsonl import JsonlOutput, read_rows, write_rows
from vlfuse.runtime import add_device_argument, add_threads_argument


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse caption``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse caption",
        description=SUBCOMMANDS["caption"].description,
        epilog="examples:\n"
        "  vlfuse caption --model runs/shapes_captions/model --image scene.png\n"
        "  vlfuse caption --model runs/shapes_captions/model --input images.jsonl --output captions.jsonl --beam-size 3\n"
        "  vlfuse caption --model runs/shapes_captions/model --image scene.png --attention-maps maps/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="caption model directory (written by save_pretrained or the fit export)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--image", help="image file")
    source.add_argument("--input", type=Path, help="JSONL file, one {\"image\": PATH} per line; "
                        "relative paths are relative to this file")
    parser.add_argument("--output", type=Path,
                        help="with --input: JSONL file to write, one line per input line, in order (default: standard "
                        "output); written batch by batch to .NAME.partial beside it, renamed onto it at the end")
    parser.add_argument("--beam-size", type=int, default=1, metavar="K", help="beam search with K beams (default 1: greedy)")
    parser.add_argument("--length-penalty", type=float, default=1.0, metavar="P",
                        help="beam search ranks log-probability / length ** P (default 1.0)")
    parser.add_argument("--max-length", type=int, metavar="N", help="at most N tokens per caption (default: the model's limit)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default 64)")
    add_device_argument(parser)
    add_threads_argument(parser)
    maps = parser.add_argument_group("attention maps")
    maps.add_argument("--attention-maps", type=Path, metavar="OUT_DIR",
                      help="for each image, draw each head's attention over the image for every generated word")
    maps.add_argument("--attention-layers", type=int, nargs="+", metavar="L", help="decoder layers to draw (default all)")
    return parser


def main(argv: list[str]) -> int:
    """``vlfuse caption``: one image (``--image``) or a JSONL file (``--input``, ``--output``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output is not None and args.input is None:
        parser.error("--output goes with --input")
    # The output is checked and locked first: a second run writing the same file stops before loading the model.
    with nullcontext() if args.image is not None else JsonlOutput(args.output, args.input) as out:
        captioner = Captioner.from_pretrained(
            args.model, device=args.device, batch_size=args.batch_size, threads=args.threads
        )
        options = {
            "beam_size": args.beam_size,
            "length_penalty": args.length_penalty,
            "max_length": args.max_length,
            "attention_maps": args.attention_maps,
            "attention_layers": args.attention_layers,
        }
        if args.image is not None:
            return _caption_one(captioner, args.image, options)
        return _caption_file(captioner, args.input, out, options)


def _caption_one(captioner: Captioner, image: str, options: dict) -> int:
    """Print the caption of ``image``; a bad image or a non-finite score is a one-line error (``ValueError``)."""
    [result] = captioner.caption([image], errors="report", **options)
    if "error" in result:
        raise ValueError(result["error"])
    print(result["caption"])
    if "attention_maps" in result:
        print(f"vlfuse caption: wrote {len(result['attention_maps']['png'])} attention maps to {options['attention_maps']}",
              file=sys.stderr)
    return 0


def _caption_file(captioner: Captioner, source: Path, out: JsonlOutput, options: dict) -> int:
    """Caption every line of ``source``; write the JSONL to ``out`` batch by batch."""
    rows = read_rows(source, keys=("image",))
    readable = [row for row in rows if row.error is None]
    batches = captioner.caption_batches(
        [row.image for row in readable], names=[f"line {row.line}" for row in readable], errors="report", **options
    )
    return write_rows(rows, batches, out, "vlfuse caption", "captioned", options["attention_maps"])

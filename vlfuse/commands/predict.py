"""``vlfuse predict``: answer questions about images with a saved model, one pair or a JSONL file."""

from __future__ import annotations

import argparse
import warnings
import sys
from contextlib import nullcontext
from pathlib import Path

from vlfuse.commands import SUBCOMMANDS
from vlfuse.inference.jsonl import JsonlOutput, read_rows, write_rows
from vlfuse.inference.predictor import PROGRESS_MIN_PAIRS, PredictWarning, Predictor
from vlfuse.runtime import add_device_argument, add_threads_argument


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse predict``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse predict",
        description=SUBCOMMANDS["predict"].description,
        epilog="examples:\n"
        "  vlfuse predict --model runs/easy_vqa/model --image shape.png --question 'what shape is it?'\n"
        "  vlfuse predict --model runs/easy_vqa/model --input pairs.jsonl --output answers.jsonl --top-k 3\n"
        "  vlfuse predict --model runs/easy_vqa/model --input pairs.jsonl > answers.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="model directory (written by save_pretrained or the fit export)")
    one = parser.add_argument_group("one pair")
    one.add_argument("--image", help="image file")
    one.add_argument("--question", help="question about the image")
    many = parser.add_argument_group("many pairs")
    many.add_argument("--input", type=Path, help="JSONL file, one {\"image\": PATH, \"question\": TEXT} per line; "
                      "relative paths are relative to this file")
    many.add_argument("--output", type=Path,
                      help="JSONL file to write, one line per input line, in order (default: standard output); "
                      "written batch by batch to .NAME.partial beside it, renamed onto it at the end")
    parser.add_argument("--top-k", type=int, default=1, metavar="K", help="also give the K best answers")
    parser.add_argument("--batch-size", type=int, default=64, help="pairs per forward pass (default 64)")
    add_device_argument(parser)
    add_threads_argument(parser)
    maps = parser.add_argument_group("attention maps")
    maps.add_argument("--attention-maps", type=Path, metavar="OUT_DIR", help="write attention maps of every pair here")
    maps.add_argument(
        "--attention-layers", type=int, nargs="+", metavar="L", help="fusion layers to draw (default all)"
    )
    maps.add_argument("--attention-token", type=int, metavar="T",
                      help="draw the question token at position T (default: the pooled question)")
    return parser


def main(argv: list[str]) -> int:
    """``vlfuse predict``: one pair (``--image``, ``--question``) or a JSONL file (``--input``, ``--output``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    one_pair = _mode(parser, args) == "one pair"
    # The output is checked and locked first: a second run writing the same file stops before loading the model.
    with nullcontext() if one_pair else JsonlOutput(args.output, args.input) as out:
        predictor = Predictor.from_pretrained(
            args.model, device=args.device, batch_size=args.batch_size, threads=args.threads
        )
        options = {
            "top_k": args.top_k,
            "errors": "report",
            "attention_maps": args.attention_maps,
            "attention_layers": args.attention_layers,
            "attention_token": args.attention_token,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PredictWarning)  # printed below, with the line they belong to
            if one_pair:
                return _predict_one(predictor, args.image, args.question, options)
            return _predict_file(predictor, args.input, out, options)


def _mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``"one pair"`` or ``"file"``; a usage error (exit 2) when the arguments mix or miss parts of both."""
    one, many = [args.image, args.question], [args.input, args.output]
    if all(v is not None for v in one) and all(v is None for v in many):
        return "one pair"
    if args.input is not None and all(v is None for v in one):
        return "file"
    parser.error("give either --image and --question, or --input (and optionally --output)")


def _predict_one(predictor: Predictor, image: str, question: str, options: dict) -> int:
    [result] = predictor.predict([image], [question], **options)
    for message in result.get("warnings", []):
        print(f"vlfuse: warning: {message}", file=sys.stderr)
    if "error" in result:
        raise ValueError(result["error"])
    print(f"answer: {result['answer']} (probability {result['score']:.4f})")
    if "top_k" in result:
        width = max(len(entry["answer"]) for entry in result["top_k"])
        print(f"top {len(result['top_k'])}:")
        for entry in result["top_k"]:
            print(f"  {entry['answer']:<{width}}  {entry['score']:.4f}")
    if "attention_maps" in result:
        print(f"attention maps: {' '.join(result['attention_maps']['png'])}")
    return 0


def _predict_file(predictor: Predictor, source: Path, out: JsonlOutput, options: dict) -> int:
    """Answer every line of ``source``; write the JSONL to ``out`` batch by batch."""
    rows = read_rows(source)
    readable = [row for row in rows if row.error is None]
    batches = predictor.predict_batches(
        [row.image for row in readable],
        [row.fields["question"] for row in readable],
        names=[f"line {row.line}" for row in readable],
        progress=len(readable) > PROGRESS_MIN_PAIRS and sys.stderr.isatty(),
        **options,
    )
    return write_rows(rows, batches, out, "vlfuse predict", "answered", options["attention_maps"])

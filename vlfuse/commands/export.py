"""``vlfuse export``: write a saved answering model as an ONNX folder that onnxruntime runs, optionally int8."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlfuse.commands import SUBCOMMANDS

FORMATS = ("onnx",)


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse export``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse export",
        description=SUBCOMMANDS["export"].description,
        epilog="examples:\n"
        "  vlfuse export --model runs/easy_vqa/latest/model --format onnx --output exports/easy_vqa\n"
        "  vlfuse export --model runs/easy_vqa/latest/model --format onnx --output exports/easy_vqa_int8 --quantize int8\n"
        "  vlfuse predict --model exports/easy_vqa_int8 --image shape.png --question 'what shape is it?'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, required=True, metavar="DIR",
                        help="model directory (written by save_pretrained or the fit export)")
    parser.add_argument("--format", choices=FORMATS, default="onnx", help="what to export to (default onnx)")
    parser.add_argument("--output", type=Path, required=True, metavar="OUT",
                        help="the folder to write (model.onnx, tokenizer/, answers.json, config.json): a new path, "
                        "never replaced")
    parser.add_argument("--quantize", choices=["int8"],
                        help="int8: onnxruntime's dynamic quantization (int8 weights) for CPU inference")
    return parser


def main(argv: list[str]) -> int:
    """``vlfuse export``: see :func:`build_parser`."""
    args = build_parser().parse_args(argv)
    from vlfuse.captioning.model import is_caption_model
    from vlfuse.inference.onnx_export import check_new, export_onnx
    from vlfuse.model import VLFuseModel

    check_new(args.output)  # before the model loads: a taken output stops at once
    if is_caption_model(args.model):
        raise ValueError(f"{args.model} is a caption model: only question-answering models are exported (docs/deployment.md)")
    model = VLFuseModel.from_pretrained(args.model)
    done = export_onnx(model, args.output, quantize=args.quantize, source=str(args.model))
    kind = "int8" if done.quantization else "float32"
    print(f"vlfuse: wrote the {kind} ONNX export of {args.model} to {done.directory}")
    print(f"onnxruntime on {done.parity.pairs} check pairs: {done.parity.line()}")
    return 0

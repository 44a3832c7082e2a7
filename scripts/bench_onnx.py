#!/usr/bin/env python
"""ONNX exports against PyTorch on the easy-VQA test set: answers, accuracy and pairs/s, side by side.

The model (default: the README main command's, runs/easy_vqa/latest/model) is exported twice with
:func:`vlfuse.inference.export_onnx` into a temporary folder: float32, and int8 (onnxruntime's
dynamic quantization). Every test pair is then answered by each engine: PyTorch (the model's
forward, as the Predictor runs it), onnxruntime float32 and onnxruntime int8, in batches of
``--batch-size`` pairs formed as the Predictor forms them (image after image, each distinct image of
a batch encoded once): answer agreement with PyTorch and accuracy.

Speed is the engine call on those batches, prepared once (pixels, tokenized questions, the image
of each question: the same inputs for every engine, outside the timing): PyTorch with
``--threads`` torch threads, onnxruntime with as many intra-op threads. Each repetition runs every
engine once over the same batches, in a rotating order (:func:`vlfuse.analysis.timing.time_interleaved`);
pairs/s are given at the median and at the worst repetition, and each engine's speed-up over
PyTorch as the median and the worst of the per-repetition ratios.

Example:
    .venv/bin/python scripts/bench_onnx.py
    .venv/bin/python scripts/bench_onnx.py --model runs/easy_vqa/latest/model --threads 2 --repeats 10
    .venv/bin/python scripts/bench_onnx.py --limit-images 100 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

from vlfuse.runtime import prefer_passive_waits

prefer_passive_waits()  # as vlfuse predict runs: OpenMP reads it when torch is imported, below

import onnxruntime  # noqa: E402
import torch  # noqa: E402
from _common import (  # noqa: E402
    DEFAULT_CONFIG, REPO, add_model_argument, add_timing_arguments, load_datamodule, load_model, set_threads,
)

from vlfuse.analysis.data import load_batches  # noqa: E402
from vlfuse.analysis.tables import markdown_table  # noqa: E402
from vlfuse.analysis.timing import time_interleaved  # noqa: E402
from vlfuse.data import IGNORE_INDEX  # noqa: E402
from vlfuse.inference import OnnxAnswerModel, export_onnx  # noqa: E402
from vlfuse.model import VLFuseModel  # noqa: E402
from vlfuse.processor import ModelInputs  # noqa: E402

DEFAULT_MODEL = REPO / "runs" / "easy_vqa" / "latest" / "model"
PYTORCH, FP32, INT8 = "PyTorch", "ONNX float32", "ONNX int8"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("Example:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser, required=False, help=f"saved model directory (default {DEFAULT_MODEL.relative_to(REPO)})")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="config whose test split to answer")
    parser.add_argument("--limit-images", type=int, metavar="N", help="only the first N test images (default: all)")
    parser.add_argument("--batch-size", type=int, default=64, help="pairs per engine call (default 64)")
    parser.add_argument("--threads", type=int, default=2, metavar="N",
                        help="torch threads and onnxruntime intra-op threads (default 2)")
    parser.add_argument("--dir", type=Path, help="where to write the exports (default: a temporary folder)")
    add_timing_arguments(parser, repeats=7, warmup=1)
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.threads < 1:
        parser.error(f"--batch-size and --threads must be at least 1, got {args.batch_size} and {args.threads}")
    args.model = args.model or DEFAULT_MODEL
    return args


def pair_batches(model: VLFuseModel, grouped: list[dict], size: int) -> tuple[list[ModelInputs], list[torch.Tensor]]:
    """The pairs of ``grouped`` (:func:`~vlfuse.data.collate_grouped` batches), image after image, cut into
    batches of ``size`` pairs: each with its distinct images once and the image of each question;
    and the answer id of each pair (:data:`~vlfuse.data.IGNORE_INDEX` for an answer the model lacks)."""
    pairs = [
        (batch["pixel_values"][i], batch["image_keys"][i], batch["questions"][q], batch["labels"][q])
        for batch in grouped
        for q, i in enumerate(batch["image_index"].tolist())
    ]
    inputs, labels = [], []
    for start in range(0, len(pairs), size):
        chunk = pairs[start:start + size]
        slots: dict = {}
        for pixels, key, _, _ in chunk:
            slots.setdefault(key, pixels)
        index = list(slots)
        tokens = model.processor.tokenize([question for _, _, question, _ in chunk])
        image_index = torch.tensor([index.index(key) for _, key, _, _ in chunk])  # (Bq,)
        inputs.append(ModelInputs(torch.stack(list(slots.values())), **tokens, image_index=image_index))
        labels.append(torch.stack([label for *_, label in chunk]))
    return inputs, labels


def engines(model: VLFuseModel, exports: dict[str, OnnxAnswerModel]) -> dict:
    """``{name: call}``: each maps a batch of :class:`ModelInputs` to logits ``(Bq, answers)``."""
    def pytorch(batch: ModelInputs) -> torch.Tensor:
        with torch.inference_mode():
            return model(batch.pixel_values, batch.input_ids, batch.attention_mask, image_index=batch.image_index).logits

    def onnx(exported: OnnxAnswerModel):
        return lambda batch: exported.logits(batch.pixel_values, batch.input_ids, batch.attention_mask, batch.image_index)

    return {PYTORCH: pytorch, **{name: onnx(exported) for name, exported in exports.items()}}


def answer_all(call, batches: list[ModelInputs]) -> torch.Tensor:
    """The best answer id of every pair of ``batches``, in order."""
    return torch.cat([call(batch).argmax(-1) for batch in batches])


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark and print its tables; return ``{engine: [seconds per pass]}``."""
    args = parse_args(argv)
    set_threads(args.threads)
    model = load_model(args.model)
    overrides = [] if args.limit_images is None else [f"--data.init_args.limit_images={args.limit_images}"]
    grouped = load_batches(load_datamodule(args.config, overrides), model, "test")
    batches, labels = pair_batches(model, grouped, args.batch_size)
    labels = torch.cat(labels)
    known = labels != IGNORE_INDEX
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        written = {
            FP32: export_onnx(model, Path(scratch) / "float32", source=str(args.model)),
            INT8: export_onnx(model, Path(scratch) / "int8", quantize="int8", source=str(args.model)),
        }
        exports = {name: OnnxAnswerModel.from_pretrained(done.directory, threads=args.threads) for name, done in written.items()}
        calls = engines(model, exports)
        answers = {name: answer_all(call, batches) for name, call in calls.items()}
        timings = time_interleaved({name: lambda call=call: [call(b) for b in batches] for name, call in calls.items()},
                                   args.repeats, args.warmup)
    n_pairs = len(labels)
    print(
        f"easy-VQA test: {n_pairs} pairs ({int(known.sum())} with an answer the model knows) in {len(batches)} batches of up to "
        f"{args.batch_size} pairs; model {args.model} (image {model.config.image.image_size}px, fuser "
        f"{model.config.fuser.type} {model.num_fusion_layers}x{model.num_heads_built} heads, dim {model.config.fusion_dim}); "
        f"{args.threads} threads; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end; torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; "
        f"{args.repeats} round-robin repetitions after {args.warmup} warm-up\n"
    )
    rows = []
    for name in calls:
        seconds = timings.samples[name]
        ratios = [p / s for p, s in zip(timings.samples[PYTORCH], seconds)]
        parity = written[name].parity.line() if name in written else "-"
        rows.append([
            name,
            100 * float((answers[name] == labels)[known].float().mean()),
            100 * float((answers[name] == answers[PYTORCH]).float().mean()),
            n_pairs / timings.median(name), n_pairs / max(seconds),
            timings.ratio(PYTORCH, name), min(ratios), parity,
        ])
    header = ["engine", "test accuracy %", "answers as PyTorch's %", "pairs/s (median)", "pairs/s (worst)",
              "speed-up vs PyTorch (median)", "(worst)", "export check (random pairs)"]
    print(markdown_table(header, rows, formats=[None, "{:.2f}", "{:.2f}", "{:.0f}", "{:.0f}", "{:.2f}x", "{:.2f}x", None]))
    return timings.samples


if __name__ == "__main__":
    main()

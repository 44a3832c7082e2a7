"""Export a saved answering model to ONNX: :func:`export_onnx`, optionally quantized to int8.

The graph is :class:`AnswerGraph`, the model's forward from pixels and token ids to answer logits,
exported by ``torch.onnx.export`` (its ``torch.export`` path) with dynamic images, questions and
question length; under export the fusion stack takes its padded layout, whose sizes do not depend
on the data (:func:`vlfuse.layers.fusion.layout_of`). ``quantize="int8"`` then applies
onnxruntime's dynamic quantization (``quantize_dynamic``: int8 weights, activations quantized per
call) to the exported graph: it runs where the graph runs, with onnxruntime's integer kernels;
torch's dynamic quantization would give a PyTorch model, not a file to deploy.

Before the folder is written, onnxruntime answers a set of pairs (:func:`check_pairs`: images and
questions of several batch sizes and lengths, several questions per image) and its logits are
compared with PyTorch's (:class:`Parity`); a float32 export that differs by more than
:data:`TOLERANCE` is not written. The folder (:mod:`vlfuse.inference.onnx_model`) is written
atomically and never replaces anything: the target must not exist (or be an empty folder).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from vlfuse import atomic, model_io
from vlfuse.errors import first_line
from vlfuse.inference.onnx_model import (
    INPUTS, ONNX_FILE, ONNX_FORMAT_VERSION, ONNX_MODEL_TYPE, OUTPUT, QUANTIZATIONS, OnnxAnswerModel,
)
from vlfuse.model import VLFuseModel
from vlfuse.processor import ModelInputs

TOLERANCE = 1e-4
"""The largest difference of a float32 export's logits from PyTorch's on :func:`check_pairs` (absolute)."""
CHECK_SIZES = ((3, 2), (17, 6), (64, 16))
"""``(questions, images)`` of each batch :func:`check_pairs` makes: sizes other than the traced one."""
FP32_NAME = ".float32.onnx"
"""Where the float32 graph waits to be quantized, inside the folder being written (removed before it is done)."""


class AnswerGraph(nn.Module):
    """What the ONNX export computes: ``model``'s answer logits ``(Bq, answers)`` from pixels
    ``(Bi, 3, S, S)`` in [0, 1], token ids and mask ``(Bq, Lt)`` and the image of each question ``(Bq,)``."""

    def __init__(self, model: VLFuseModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_index: torch.Tensor
    ) -> torch.Tensor:
        return self.model(pixel_values, input_ids, attention_mask, image_index=image_index).logits


@dataclass
class Parity:
    """How an export's answers compare with PyTorch's on the same pairs.

    Attributes:
        pairs: image-question pairs compared.
        same_answers: pairs whose best answer is the same.
        max_logit_difference: the largest absolute difference of any logit.
    """

    pairs: int
    same_answers: int
    max_logit_difference: float

    def line(self) -> str:
        return (f"{self.same_answers}/{self.pairs} answers the same as PyTorch's, "
                f"logits within {self.max_logit_difference:.2g}")


@dataclass
class OnnxExport:
    """What :func:`export_onnx` wrote: the folder, its quantization and its parity with PyTorch."""

    directory: Path
    quantization: str | None
    parity: Parity


def export_onnx(
    model: VLFuseModel,
    target: str | Path,
    *,
    quantize: str | None = None,
    check: Sequence[ModelInputs] | None = None,
    source: str | None = None,
) -> OnnxExport:
    """Write ``model`` as an ONNX folder at ``target`` (a new path, or an empty folder).

    Args:
        model: an answering model with a fusion stack (put in eval mode).
        target: the folder to write: ``model.onnx``, ``tokenizer/``, ``answers.json``, ``config.json``.
        quantize: ``"int8"`` for onnxruntime's dynamic int8 quantization; ``None`` keeps float32.
        check: batches on which onnxruntime's answers are compared with PyTorch's (default
            :func:`check_pairs`).
        source: where the model was read from, recorded in ``config.json``.

    Raises:
        ValueError: ``target`` exists (and is not an empty folder), the model cannot be exported,
            or a float32 export's logits differ from PyTorch's by more than :data:`TOLERANCE`.
    """
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize must be None or one of {QUANTIZATIONS}, got {quantize!r}")
    target = Path(target)
    check_new(target)
    model = model.eval()
    batches = list(check) if check is not None else check_pairs(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_abandoned(target.parent, f".{target.name}{model_io.STAGING}")
    staging = model_io.make_staging(target)
    try:
        write_graph(model, staging / ONNX_FILE, quantize)
        model_io.write_json(staging / model_io.ANSWERS_FILE, model.answers, indent=1)
        model.tokenizer.save_pretrained(staging / model_io.TOKENIZER_DIR)
        meta = export_meta(model, quantize, source)
        model_io.write_json(staging / model_io.CONFIG_FILE, {**meta, "files": model_io.file_digests(staging)})
        parity = compare(model, OnnxAnswerModel.from_pretrained(staging, threads=None), batches)
        if quantize is None and (parity.same_answers < parity.pairs or parity.max_logit_difference > TOLERANCE):
            raise ValueError(f"the ONNX graph does not answer as the model does ({parity.line()}): not written")
        meta["parity"] = asdict(parity)
        model_io.write_json(staging / model_io.CONFIG_FILE, {**meta, "files": model_io.file_digests(staging)})
        model_io.sync_tree(staging)
        move_new(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return OnnxExport(target, quantize, parity)


def check_new(target: Path) -> None:
    """Refuse a ``target`` that exists, unless it is an empty folder: an export replaces nothing."""
    if os.path.lexists(target) and not (target.is_dir() and not target.is_symlink() and not any(target.iterdir())):
        raise ValueError(f"{target} exists: an export never replaces it (give a new --output, or remove it)")


def move_new(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target`` in one step; a ``ValueError`` when something took ``target``
    meanwhile (a rename onto a folder that is not empty fails: nothing is replaced)."""
    try:
        os.rename(staging, target)
    except OSError as err:
        raise ValueError(f"{target} appeared while the export was written: not replaced ({first_line(err)})") from None
    atomic.fsync(target.parent)


def write_graph(model: VLFuseModel, path: Path, quantize: str | None) -> None:
    """Export :class:`AnswerGraph` of ``model`` to ``path`` (quantized when asked)."""
    exported = path.with_name(FP32_NAME) if quantize else path
    example = example_inputs(model)
    questions, images = torch.export.Dim("questions"), torch.export.Dim("images")
    tokens = torch.export.Dim("tokens", max=model.processor.max_length)
    dynamic = {
        "pixel_values": {0: images},
        "input_ids": {0: questions, 1: tokens},
        "attention_mask": {0: questions, 1: tokens},
        "image_index": {0: questions},
    }
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # that "questions" and "tokens" name one axis of two inputs each is what is meant
            warnings.filterwarnings("ignore", message=".*axis name", category=UserWarning)
            torch.onnx.export(
                AnswerGraph(model).eval(), tuple(example[name] for name in INPUTS), str(exported), dynamo=True,
                input_names=list(INPUTS), output_names=[OUTPUT], dynamic_shapes=dynamic, external_data=False,
                verbose=False,
            )
    except ImportError as err:
        raise ValueError(f"ONNX export needs the export extra (pip install 'vlfuse[export]'): {first_line(err)}") from None
    except Exception as err:  # torch.export's and the ONNX translator's errors
        raise ValueError(f"fuser {model.config.fuser.type!r} could not be exported to ONNX: {first_line(err)}") from None
    check_dynamic(exported, dynamic, model.config.fuser.type)
    if quantize:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with root_logger_silenced():
            quantize_dynamic(exported, path, weight_type=QuantType.QInt8)
        exported.unlink()


def check_dynamic(path: Path, dynamic: dict[str, dict[int, object]], fuser: str) -> None:
    """A ``ValueError`` when the exported graph in ``path`` fixed an axis meant to be dynamic: the
    model computes something from that size (e.g. a reader that loops over the question's words)."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        for axis in dynamic.get(value.name, {}):
            if dims[axis].HasField("dim_value"):
                raise ValueError(
                    f"fuser {fuser!r} cannot be exported to ONNX with dynamic sizes: the trace fixed axis {axis} of "
                    f"{value.name} to {dims[axis].dim_value} (the model computes something from that size)"
                )


@contextmanager
def root_logger_silenced() -> Iterator[None]:
    """Drop what is logged through the root logger meanwhile, without giving it a handler for good.

    onnxruntime's quantizer advises pre-processing (``quant_pre_process``) with ``logging.warning``,
    which would also attach a stderr handler to the root logger for the rest of the process. That
    pre-processing is left out: its symbolic shape inference fails on these graphs.
    """
    root, quiet = logging.getLogger(), logging.NullHandler()
    root.addHandler(quiet)
    try:
        yield
    finally:
        root.removeHandler(quiet)


def example_inputs(model: VLFuseModel) -> ModelInputs:
    """Inputs to trace with: 3 questions of 5 tokens about 2 images (no size is 1, which export would fix)."""
    g = torch.Generator().manual_seed(0)
    size, length = model.config.image.image_size, min(5, model.processor.max_length)
    ids = torch.randint(0, len(model.tokenizer), (3, length), generator=g)
    return ModelInputs(
        torch.rand(2, 3, size, size, generator=g), ids, torch.ones_like(ids), image_index=torch.tensor([0, 1, 1])
    )


def check_pairs(model: VLFuseModel, sizes: Sequence[tuple[int, int]] = CHECK_SIZES, seed: int = 0) -> list[ModelInputs]:
    """Batches to compare an export with ``model`` on: for each ``(questions, images)`` of ``sizes``,
    random images and questions of random words of the tokenizer (of many lengths, so with padding),
    through the model's processor, the questions spread over the images."""
    rng = np.random.default_rng(seed)
    words = [w for w in model.tokenizer.get_vocab() if w not in model.tokenizer.all_special_tokens]
    batches = []
    for questions, images in sizes:
        arrays = [rng.integers(0, 256, (40, 40, 3), dtype=np.uint8) for _ in range(images)]
        lengths = rng.integers(1, model.processor.max_length + 4, questions)  # some truncated
        texts = [" ".join(rng.choice(words, n)) for n in lengths]
        batches.append(model.processor([arrays[q % images] for q in range(questions)], texts))
    return batches


def compare(model: VLFuseModel, exported: OnnxAnswerModel, batches: Sequence[ModelInputs]) -> Parity:
    """:class:`Parity` of ``exported`` with ``model`` on ``batches``."""
    pairs = same = 0
    worst = 0.0
    for batch in batches:
        index = batch.image_index if batch.image_index is not None else torch.arange(len(batch.input_ids))
        with torch.no_grad():
            expected = model(batch.pixel_values, batch.input_ids, batch.attention_mask, image_index=index).logits
        actual = exported.logits(batch.pixel_values, batch.input_ids, batch.attention_mask, index)
        pairs += len(expected)
        same += int((expected.argmax(-1) == actual.argmax(-1)).sum())
        worst = max(worst, float((expected - actual).abs().max()))
    return Parity(pairs, same, worst)


def export_meta(model: VLFuseModel, quantize: str | None, source: str | None) -> dict:
    """``config.json`` of an export (its digests and parity are added by :func:`export_onnx`)."""
    import onnx
    import onnxruntime

    return {
        "format_version": ONNX_FORMAT_VERSION,
        "model_type": ONNX_MODEL_TYPE,
        "image_size": model.config.image.image_size,
        "interpolation": model.processor.interpolation,
        "max_length": model.processor.max_length,
        "vocab_size": model.text_encoder.model.config.vocab_size,
        "quantization": quantize,
        "inputs": list(INPUTS),
        "output": OUTPUT,
        "exported_from": source,
        "config": model.config.to_dict(),
        "versions": {
            "torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "python": platform.python_version(),
        },
    }

"""An exported answering model run by onnxruntime: :class:`OnnxAnswerModel`, read from an ONNX folder.

``vlfuse export --format onnx`` (:mod:`vlfuse.inference.onnx_export`) writes a folder that answers
questions without vlfuse's model code or PyTorch weights:

- ``model.onnx``: pixels ``(Bi, 3, S, S)`` in [0, 1], token ids and mask ``(Bq, Lt)`` and the image of
  each question ``(Bq,)`` -> answer logits ``(Bq, answers)``; images, questions and length are dynamic;
- ``tokenizer/`` and ``answers.json``: as in a model folder;
- ``config.json``: ``model_type: vlfuse-onnx``, what the processor needs (image size, text length),
  the quantization, the parity measured at export, and the size and SHA-256 of every other file.

The folder is untrusted data, read as :mod:`vlfuse.model_io` reads a model folder: regular files
only, digests checked (an export without them is refused), the graph checked by ``onnx`` (no
external data files, the inputs and output vlfuse writes, one score per answer) before onnxruntime
builds a session from the bytes that were checked. Every error is one line naming the file.

:class:`OnnxAnswerModel` stands in for a :class:`~vlfuse.model.VLFuseModel` in
:class:`~vlfuse.inference.Predictor` (``Predictor.from_pretrained`` picks it for such a folder), so
that an ONNX model answers with the predictor's checks, warnings and bad-row handling.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from vlfuse import model_io
from vlfuse.data.transforms import check_interpolation
from vlfuse.encoders import load_saved_tokenizer
from vlfuse.errors import first_line
from vlfuse.model import ImageContext, VLFuseOutput, answer_list
from vlfuse.parts import MAX_IMAGE_SIDE, MAX_TOKENS, MAX_VOCAB
from vlfuse.processor import VLFuseProcessor
from vlfuse.runtime import DEFAULT_THREADS, check_threads

ONNX_MODEL_TYPE = "vlfuse-onnx"
ONNX_FORMAT_VERSION = 1
ONNX_FILE = "model.onnx"
INPUTS = ("pixel_values", "input_ids", "attention_mask", "image_index")
"""The graph's inputs, in order: ``(Bi, 3, S, S)`` float32, ``(Bq, Lt)`` int64 twice, ``(Bq,)`` int64."""
OUTPUT = "logits"
QUANTIZATIONS = ("int8",)
"""What ``--quantize`` offers (``None`` in ``config.json``: float32)."""
FOLDER_FILES = (model_io.CONFIG_FILE, ONNX_FILE, model_io.ANSWERS_FILE, model_io.TOKENIZER_DIR)
WHAT = "an ONNX export of a vlfuse model"
ALLOWED_DOMAINS = ("", "ai.onnx", "com.microsoft")
"""Operator sets an export may use: ONNX's and onnxruntime's own (its quantized and fused kernels)."""


def is_onnx_export(directory: str | Path) -> bool:
    """Whether ``directory``'s ``config.json`` says it is an ONNX export (``model_type: vlfuse-onnx``)."""
    return model_io.model_type_of(directory) == ONNX_MODEL_TYPE


class OnnxAnswerModel:
    """A :class:`~vlfuse.model.VLFuseModel`'s answers from an ONNX export, computed by onnxruntime on the CPU.

    It offers what :class:`~vlfuse.inference.Predictor` uses of a model: :attr:`answers`,
    :attr:`processor`, :meth:`encode_images` (here the pixels themselves: the graph encodes each
    image once per call, shared through ``image_index``) and the call returning logits; there are
    no attention weights to draw.

    Args:
        session: an ``onnxruntime.InferenceSession`` of the graph.
        answers: the answer vocabulary, one logit each.
        processor: the tokenizer and image transform the model was trained with.
        meta: the folder's ``config.json``.

    Example:
        >>> model = OnnxAnswerModel.from_pretrained("exports/easy_vqa_int8", threads=2)
        >>> Predictor(model, threads=2).predict(["a.png"], ["what shape is in the image?"])
    """

    num_fusion_layers = 0

    def __init__(self, session: Any, answers: list[str], processor: VLFuseProcessor, meta: dict) -> None:
        self.session = session
        self.answers = list(answers)
        self.processor = processor
        self.meta = meta

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, device: str | torch.device = "cpu", threads: int | None = DEFAULT_THREADS
    ) -> "OnnxAnswerModel":
        """Read and check an export of ``vlfuse export --format onnx``; ``threads`` are onnxruntime's
        intra-op threads (``None``: its default, every core)."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"an ONNX export runs on the CPU (onnxruntime), not on {device}: use --device cpu")
        check_threads(threads, "threads")
        directory = Path(directory)
        meta = read_export_meta(directory)
        config_file = directory / model_io.CONFIG_FILE
        answers_file = directory / model_io.ANSWERS_FILE
        answers = model_io.parse_config(answers_file, lambda: answer_list(model_io.read_json(answers_file)))
        image_size, max_length, vocab_size, interpolation = model_io.parse_config(config_file, lambda: processor_fields(meta))
        tokenizer = load_saved_tokenizer(directory / model_io.TOKENIZER_DIR, vocab_size)
        processor = VLFuseProcessor(tokenizer, image_size=image_size, max_length=max_length, interpolation=interpolation)
        session = open_session(directory / ONNX_FILE, meta, len(answers), threads)
        return cls(session, answers, processor, meta)

    @property
    def tokenizer(self):
        """The processor's tokenizer."""
        return self.processor.tokenizer

    @property
    def quantization(self) -> str | None:
        """``"int8"`` for a quantized export, ``None`` for float32."""
        return self.meta.get("quantization")

    def to(self, device: str | torch.device) -> "OnnxAnswerModel":
        """Itself on the CPU; another device is an error."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"an ONNX export runs on the CPU (onnxruntime), not on {device}")
        return self

    def eval(self) -> "OnnxAnswerModel":
        """Itself: an exported graph has no training mode."""
        return self

    def require_fusion_heads(self, purpose: str, name: str = "this model") -> None:
        """Always a ``ValueError``: the exported graph gives answer scores only."""
        raise ValueError(
            f"{name} is an ONNX export: it gives answer scores only, no attention heads to {purpose} "
            "(use the PyTorch model folder it was exported from)"
        )

    def encode_images(self, pixel_values: torch.Tensor) -> ImageContext:
        """Images ``(Bi, 3, S, S)`` in [0, 1] -> an :class:`~vlfuse.model.ImageContext` holding them:
        the graph encodes them when asked (:meth:`__call__`)."""
        return ImageContext(pixel_values)

    def logits(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_index: torch.Tensor
    ) -> torch.Tensor:
        """Answer logits ``(Bq, answers)`` of questions ``(Bq, Lt)`` about images ``(Bi, 3, S, S)``, question
        ``q`` about image ``image_index[q]``."""
        feed = {
            "pixel_values": pixel_values.detach().cpu().float().numpy(),
            "input_ids": input_ids.cpu().long().numpy(),
            "attention_mask": attention_mask.cpu().long().numpy(),
            "image_index": image_index.cpu().long().numpy(),
        }
        [logits] = self.session.run([OUTPUT], feed)
        return torch.from_numpy(logits)

    def __call__(
        self,
        pixel_values: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        image_index: torch.Tensor | None = None,
        image_context: ImageContext | None = None,
        weights_from: Iterable[int] = (),
    ) -> VLFuseOutput:
        """:meth:`VLFuseModel.forward <vlfuse.model.VLFuseModel.forward>`'s answer: pixels (or the
        context of :meth:`encode_images`) and tokenized questions -> :class:`~vlfuse.model.VLFuseOutput`."""
        if list(weights_from):
            self.require_fusion_heads("draw")
        if input_ids is None or attention_mask is None:
            raise ValueError("the model needs input_ids and attention_mask (model.processor tokenizes questions)")
        pixels = image_context.features if image_context is not None else pixel_values
        if pixels is None:
            raise ValueError("the model needs pixel_values or an image_context")
        if image_index is None:
            image_index = torch.arange(input_ids.shape[0])
        logits = self.logits(pixels, input_ids, attention_mask, image_index)
        return VLFuseOutput(logits, {}, attention_mask.bool())


# --------------------------------------------------------------------------------- checking a folder
def read_export_meta(directory: Path) -> dict:
    """``config.json`` of an ONNX export, with every file it lists matching its size and SHA-256."""
    model_io.require_files(directory, FOLDER_FILES, WHAT)
    meta = model_io.read_meta(directory, ONNX_MODEL_TYPE, (ONNX_FORMAT_VERSION,))
    config_file = directory / model_io.CONFIG_FILE
    listed = meta.get("files")
    if not isinstance(listed, dict) or ONNX_FILE not in listed or model_io.ANSWERS_FILE not in listed:
        raise ValueError(f"{config_file} does not list the size and sha256 of {ONNX_FILE} and {model_io.ANSWERS_FILE}: export again")
    model_io.verify_files(directory, meta)
    return meta


def processor_fields(meta: dict) -> tuple[int, int, int, str]:
    """``(image_size, max_length, vocab_size, interpolation)`` of an export's ``config.json``, checked
    (an export written before it recorded its interpolation resized bilinearly)."""
    limits = {"image_size": MAX_IMAGE_SIDE, "max_length": MAX_TOKENS, "vocab_size": MAX_VOCAB}
    values = tuple(meta[key] for key in limits)
    for (key, limit), value in zip(limits.items(), values):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise ValueError(f"{key} must be an integer from 1 to {limit}, got {value!r}")
    quantization = meta.get("quantization")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be null or one of {QUANTIZATIONS}, got {quantization!r}")
    return (*values, check_interpolation(meta.get("interpolation", "bilinear")))


def open_session(path: Path, meta: dict, num_answers: int, threads: int | None):
    """An onnxruntime session of the graph in ``path``, once ``onnx`` has checked it (see :func:`check_graph`).

    The bytes are read once: the ones whose SHA-256 is compared with ``config.json``, checked and run.
    """
    import onnxruntime

    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["files"][ONNX_FILE].get("sha256"):
        raise ValueError(f"{path} changed while it was read: copy the export again")
    check_graph(data, path, num_answers)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads or 0
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # vlfuse's passive waits
    try:
        return onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime's own exception types (Fail, InvalidGraph, ...)
        raise ValueError(f"{path}: onnxruntime cannot run it: {first_line(err)}") from None


def check_graph(data: bytes, path: Path, num_answers: int) -> None:
    """A one-line ``ValueError`` naming ``path`` unless ``data`` is a valid ONNX graph with vlfuse's
    inputs and output, no external data files and operators of :data:`ALLOWED_DOMAINS` only."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        proto = onnx.load_model_from_string(data)
        onnx.checker.check_model(proto)
    except (DecodeError, onnx.checker.ValidationError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path} is not a valid ONNX model: {first_line(err)}") from None
    graph = proto.graph
    external = [t.name for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ValueError(f"{path} keeps weights in external files ({external[0]}, ...): an export holds them in one file")
    domains = sorted({node.domain for node in graph.node} - set(ALLOWED_DOMAINS))
    if domains:
        raise ValueError(f"{path} uses operators of {domains}: only ONNX's and onnxruntime's are run")
    initializers = {t.name for t in graph.initializer}
    inputs = tuple(i.name for i in graph.input if i.name not in initializers)
    outputs = [o.name for o in graph.output]
    if inputs != INPUTS or outputs != [OUTPUT]:
        raise ValueError(f"{path} takes {list(inputs)} and gives {outputs}: an export takes {list(INPUTS)} and gives [{OUTPUT!r}]")
    width = graph.output[0].type.tensor_type.shape.dim[-1:]
    if width and width[0].HasField("dim_value") and width[0].dim_value != num_answers:
        raise ValueError(f"{path} gives {width[0].dim_value} scores per question, but answers.json lists {num_answers} answers")

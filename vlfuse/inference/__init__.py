"""Inference with saved models: :class:`Predictor` answers questions about images, :class:`Captioner`
describes them; :func:`export_onnx` writes an answering model as an ONNX folder, which
:class:`OnnxAnswerModel` runs with onnxruntime (``Predictor.from_pretrained`` picks it). JSONL in
and out (:mod:`vlfuse.inference.jsonl`) and attention-map files (:mod:`vlfuse.inference.attention_maps`)
serve both. The command lines are :mod:`vlfuse.commands`."""

from vlfuse.inference.captioner import CaptionOptions, Captioner
from vlfuse.inference.onnx_export import export_onnx
from vlfuse.inference.onnx_model import OnnxAnswerModel
from vlfuse.inference.predictor import PredictWarning, Predictor

__all__ = ["CaptionOptions", "Captioner", "OnnxAnswerModel", "PredictWarning", "Predictor", "export_onnx"]

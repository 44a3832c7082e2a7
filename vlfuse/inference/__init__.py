"""Inference with saved models: :class:`Predictor` answers questions about images, :class:`Captioner`
describes them; JSONL in and out (:mod:`vlfuse.inference.jsonl`) and attention-map files
(:mod:`vlfuse.inference.attention_maps`) serve both. The command lines are :mod:`vlfuse.commands`."""

from vlfuse.inference.captioner import CaptionOptions, Captioner
from vlfuse.inference.predictor import PredictWarning, Predictor

__all__ = ["CaptionOptions", "Captioner", "PredictWarning", "Predictor"]

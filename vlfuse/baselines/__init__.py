"""Peers of the fusion model on easy-VQA, written from their publications for ``scripts/compare_baselines.py``.

- :class:`BowCNN`: the dataset author's model (a small CNN, a bag of words, their product, an MLP).
- :class:`FiLMNet`: FiLM (Perez et al. 2018), a CNN whose residual blocks the question modulates.

Both are plain ``nn.Module``s with vlfuse's calling convention: ``forward(pixel_values, input_ids,
attention_mask, image_index)`` takes a :func:`vlfuse.data.collate_grouped` batch (each image once,
``image_index`` the image of each question) and word ids from
:func:`vlfuse.encoders.tokenizer.build_word_tokenizer`, and returns answer logits (Bq, num_answers).
"""

from vlfuse.baselines.bow_cnn import BowCNN
from vlfuse.baselines.film import FiLM, FiLMedResBlock, FiLMNet, coordinate_maps

__all__ = ["BowCNN", "FiLM", "FiLMNet", "FiLMedResBlock", "coordinate_maps"]

"""Peers of the fusion model for ``scripts/compare_baselines.py``: two written from their publications, three transformers models.

- :class:`BowCNN`: the dataset author's model (a small CNN, a bag of words, their product, an MLP).
- :class:`FiLMNet`: FiLM (Perez et al. 2018), a CNN whose residual blocks the question modulates.
- :class:`BlipVQA`, :class:`ViltVQA` (:mod:`vlfuse.baselines.hf_vqa`): transformers' BLIP-VQA and ViLT
  built from their configs, from scratch, with ``loss(..., labels)`` and ``answer(...)`` on vlfuse's batches.
- ``HFCaptionPeer``, imported from :mod:`vlfuse.baselines.hf_caption` (not from here: it is built from a
  caption config, so it sits in the captioning layer above this package): transformers'
  ``VisionEncoderDecoderModel`` (a ViT and a ``BertLMHeadModel`` with cross-attention), for
  ``scripts/compare_caption_peers.py``.

BowCNN and FiLMNet are plain ``nn.Module``s with vlfuse's calling convention: ``forward(pixel_values, input_ids,
attention_mask, image_index)`` takes a :func:`vlfuse.data.collate_grouped` batch (each image once,
``image_index`` the image of each question) and word ids from
:func:`vlfuse.encoders.tokenizer.build_word_tokenizer`, and returns answer logits (Bq, num_answers).
"""

from vlfuse.baselines.bow_cnn import BowCNN
from vlfuse.baselines.film import FiLM, FiLMedResBlock, FiLMNet, coordinate_maps
from vlfuse.baselines.hf_vqa import BlipVQA, ViltVQA

__all__ = ["BlipVQA", "BowCNN", "FiLM", "FiLMNet", "FiLMedResBlock", "ViltVQA", "coordinate_maps"]

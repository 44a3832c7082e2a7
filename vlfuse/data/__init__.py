"""Datasets, preprocessing and batching. Imports no model code."""

from vlfuse.data.answers import AnswerVocab
from vlfuse.data.dataset import IGNORE_INDEX, GroupedVQADataset, collate_grouped
from vlfuse.data.records import ImageQuestions, ImageSource
from vlfuse.data.transforms import ImageLoadError, load_image, preprocess_image

__all__ = [
    "AnswerVocab",
    "GroupedVQADataset",
    "IGNORE_INDEX",
    "ImageLoadError",
    "ImageQuestions",
    "ImageSource",
    "collate_grouped",
    "load_image",
    "preprocess_image",
]

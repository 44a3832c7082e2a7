"""LightningDataModules: one per dataset, all batching images with their questions."""

from vlfuse.datamodules.base import VQADataModule
from vlfuse.datamodules.easy_vqa import EasyVQADataModule

__all__ = ["EasyVQADataModule", "VQADataModule"]

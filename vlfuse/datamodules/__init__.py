"""LightningDataModules: one per dataset, all batching images with their questions."""

from vlfuse.datamodules.base import VQADataModule
from vlfuse.datamodules.easy_vqa import EasyVQADataModule
from vlfuse.datamodules.imagefolder import ImageFolderDataModule
from vlfuse.datamodules.shapes import ShapesDataModule
from vlfuse.datamodules.streaming import StreamingDataModule
from vlfuse.datamodules.vqa_v2 import VQAv2DataModule

__all__ = ["EasyVQADataModule", "ImageFolderDataModule", "ShapesDataModule", "StreamingDataModule", "VQADataModule", "VQAv2DataModule"]

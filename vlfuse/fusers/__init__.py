"""Fusers: interchangeable parts that read the question together with the image, one file each.

Select one by type in the model config (``fuser: {type: cell_steps, ...}``); add one by
registering its config class with ``@FUSERS.register``.
"""

from vlfuse.fusers.base import FUSERS, Fused, Fuser, FuserConfig, encode_distinct
from vlfuse.fusers.cell_moves import CellMovesConfig, CellMovesFuser
from vlfuse.fusers.cell_steps import CellStepsConfig, CellStepsFuser
from vlfuse.fusers.fusion_stack import FusionStackConfig, FusionStackFuser
from vlfuse.fusers.map_program import OPERATIONS, MapProgramConfig, MapProgramFuser, MapProgramReader, PatchKeys, relative_offsets
from vlfuse.parts import EVIDENCE, TOKENS

__all__ = [
    "EVIDENCE",
    "FUSERS",
    "OPERATIONS",
    "TOKENS",
    "CellMovesConfig",
    "CellMovesFuser",
    "CellStepsConfig",
    "CellStepsFuser",
    "Fused",
    "Fuser",
    "FuserConfig",
    "FusionStackConfig",
    "FusionStackFuser",
    "MapProgramConfig",
    "MapProgramFuser",
    "MapProgramReader",
    "PatchKeys",
    "encode_distinct",
    "relative_offsets",
]

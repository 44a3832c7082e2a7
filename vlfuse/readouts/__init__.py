"""Readouts: interchangeable parts that turn the question tokens into answer scores, one file each.

Select one by name in the model config (``readout: pool``); add one with :func:`register_readout`.
"""

from vlfuse.readouts.base import READOUTS, Readout, encode_distinct, get_readout, register_readout
from vlfuse.readouts.bilinear import BilinearReadout
from vlfuse.readouts.cell_steps import CellStepsReadout
from vlfuse.readouts.map_program import (
    OPERATIONS,
    ExistenceClassifier,
    MapProgramReader,
    MapProgramReadout,
    PatchKeys,
    relative_offsets,
)
from vlfuse.readouts.pool import PoolReadout, masked_mean

__all__ = [
    "OPERATIONS",
    "READOUTS",
    "BilinearReadout",
    "CellStepsReadout",
    "ExistenceClassifier",
    "MapProgramReader",
    "MapProgramReadout",
    "PatchKeys",
    "PoolReadout",
    "Readout",
    "encode_distinct",
    "get_readout",
    "masked_mean",
    "register_readout",
    "relative_offsets",
]

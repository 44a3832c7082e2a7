"""Moved to :mod:`vlfuse.readouts.map_program`; re-exported here for ``from vlfuse.layers import MapProgramReader``."""

from vlfuse.readouts.map_program import OPERATIONS, ExistenceClassifier, MapProgramReader, relative_offsets

__all__ = ["OPERATIONS", "ExistenceClassifier", "MapProgramReader", "relative_offsets"]

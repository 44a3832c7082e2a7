"""Analysis of the fusion heads: attention maps (head scores and pruning build on them)."""

from vlfuse.analysis.attention_maps import draw_attention_map, select_query, split_prefix

__all__ = ["draw_attention_map", "select_query", "split_prefix"]

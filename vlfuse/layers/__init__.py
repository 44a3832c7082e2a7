"""Attention and fusion layers: plain torch, no data, no encoders, no Lightning."""

from vlfuse.layers.attention import (
    CrossAttention,
    MultiHeadAttention,
    OutputGate,
    ProjectedContext,
    SelfAttention,
    attention_core,
    leaky_relu_normalize,
    softmax_normalize,
)
from vlfuse.layers.causal import CausalSelfAttention, KVCache
from vlfuse.layers.diversity import head_diversity
from vlfuse.layers.fusion import MLP_LAYERS, FusionBlock, FusionStack, Mlp, SwiGLU
from vlfuse.layers.local_attention import (
    LocalLayout,
    LocalSelfAttention,
    block_sparse,
    block_sparse_mask,
    grid_neighbourhood,
    grid_neighbourhood_mask,
    local_self_attention,
    sliding_window,
    sliding_window_mask,
)
from vlfuse.layers.packing import PackedTokens

__all__ = [
    "MLP_LAYERS",
    "CausalSelfAttention",
    "CrossAttention",
    "FusionBlock",
    "FusionStack",
    "KVCache",
    "LocalLayout",
    "LocalSelfAttention",
    "Mlp",
    "MultiHeadAttention",
    "OutputGate",
    "PackedTokens",
    "ProjectedContext",
    "SelfAttention",
    "SwiGLU",
    "attention_core",
    "block_sparse",
    "block_sparse_mask",
    "grid_neighbourhood",
    "grid_neighbourhood_mask",
    "head_diversity",
    "leaky_relu_normalize",
    "local_self_attention",
    "sliding_window",
    "sliding_window_mask",
    "softmax_normalize",
]

"""Multi-head attention: the whole attention story of vlfuse in one file.

Text tokens are the queries, image tokens the keys and values. All heads are computed at once by
reshaping ``(B, L, H * hd) -> (B, H, L, hd)``; no Python loop ever runs over heads.

In reading order:

- :class:`ProjectedContext`: keys and values projected once, reusable for many query batches
  (:class:`ContextTokens`: a context each layer projects itself, inside its activation checkpoint);
- the normalisers, scores -> weights: :func:`softmax_normalize` (the one SDPA computes) and
  :func:`leaky_relu_normalize`, by name in :data:`NORMALIZERS`;
- :func:`attention_core`: ``normalize(Q K^T / sqrt(hd)) V``, through SDPA when it can;
- :class:`KeyMask`: the one rule for a query that may attend no key;
- :class:`OutputGate`: the query-dependent output gate;
- :class:`MultiHeadAttention`: the core every layer shares (projections, heads, pruning);
- :class:`CrossAttention`: queries from one sequence, keys and values from another;
  :meth:`CrossAttention.attend_packed` for packed query tokens grouped by the context row they
  read (:mod:`vlfuse.layers.packing`), e.g. the real tokens of all the questions about each image;
- :class:`SelfAttention`: a sequence over itself, under a padding mask.

The two other self-attentions are built on the same core, each in its own module: causal
attention with a key/value cache (:mod:`vlfuse.layers.causal`) and local attention for long inputs
(sliding window, 2-D neighbourhood, block-sparse, FlexAttention: :mod:`vlfuse.layers.local_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from vlfuse.layers.packing import ContextGroups, PackedTokens

Normalizer = Literal["softmax", "leaky_relu"]
NormalizeFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
LEAKY_SLOPE = 0.01
"""Negative slope of the ``leaky_relu`` normaliser (``nn.LeakyReLU``'s default)."""


@dataclass
class ProjectedContext:
    """Keys and values of a context, projected once and reusable for many query batches.

    Attributes:
        key: ``(B, H, Lk, hd)`` projected keys.
        value: ``(B, H, Lk, hd)`` projected values.
        mask: optional ``(B, Lk)`` boolean mask, True where a key may be attended.
    """

    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.key.shape[0]

    def rows(self, index: torch.Tensor) -> "ProjectedContext":
        """The context rows ``index`` ``(B',)``, copied: keys and values ``(B', H, Lk, hd)``, mask ``(B', Lk)``."""
        return ProjectedContext(self.key[index], self.value[index], None if self.mask is None else self.mask[index])


@dataclass
class ContextTokens:
    """A context not yet projected: each layer projects its own keys and values from it when it runs
    (:meth:`CrossAttention.keys_values`), e.g. inside that layer's activation checkpoint, so that
    backward keeps the tokens once instead of every layer's keys and values.

    Attributes:
        tokens: ``(B, Lk, kv_dim)`` the context tokens.
        mask: optional ``(B, Lk)`` boolean mask, True where a key may be attended.
    """

    tokens: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: torch.Tensor) -> "ContextTokens":
        """The context rows ``index`` ``(B',)``, copied: tokens ``(B', Lk, kv_dim)``, mask ``(B', Lk)``."""
        return ContextTokens(self.tokens[index], None if self.mask is None else self.mask[index])


# ------------------------------------------------------------------------------------ normalisers
def softmax_normalize(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the keys; masked keys get exactly 0 (every query must keep a key: see :class:`KeyMask`).

    Args:
        scores: ``(..., Lq, Lk)`` attention scores.
        mask: bool, broadcastable to ``scores``, True where a key may be attended.
    """
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


def leaky_relu_normalize(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention weights from scores through a LeakyReLU instead of an exponential.

    Over the keys a query may attend, with ``a = leaky_relu(s, LEAKY_SLOPE)``::

        w_j = (1 + a_j - min_k a_k) / sum_i (1 + a_i - min_k a_k)

    The row's lowest score maps to 1 before normalisation and each unit of score above it adds
    1 (``LEAKY_SLOPE`` below 0), so the weights are non-negative, sum to 1 and are uniform when
    all scores are equal (a new layer starts near uniform, as with softmax); they grow linearly
    with the scores, where softmax grows exponentially. Negative scores are nearly switched off
    but, unlike with a ReLU, keep a gradient. The denominator is at least 1, so rows whose scores
    are all negative or all equal are well defined; a row with no allowed key gets all-zero
    weights, and every gradient stays finite.

    Args:
        scores: ``(..., Lq, Lk)`` attention scores.
        mask: bool, broadcastable to ``scores``, True where a key may be attended.

    Returns:
        Weights of the shape of ``scores``; masked keys get exactly 0.
    """
    a = F.leaky_relu(scores, LEAKY_SLOPE)
    if mask is None:
        lifted = 1.0 + a - a.amin(dim=-1, keepdim=True)
    else:
        floor = a.masked_fill(~mask, float("inf")).amin(dim=-1, keepdim=True)  # +inf for a row with no key
        lifted = torch.where(mask, 1.0 + a - floor, 0.0)
    return lifted / lifted.sum(dim=-1, keepdim=True).clamp_min(1.0)


NORMALIZERS: dict[str, NormalizeFn] = {"softmax": softmax_normalize, "leaky_relu": leaky_relu_normalize}
"""The normalisers a layer can be built with, by name (the ``normalizer=`` of :class:`CrossAttention`)."""


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    use_sdpa: bool = True,
    need_weights: bool = False,
    normalize: NormalizeFn = softmax_normalize,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``normalize(Q K^T / sqrt(hd)) V`` for all heads at once.

    Args:
        q: ``(B, H, Lq, hd)``; k, v: ``(B, H, Lk, hd)``.
        mask: boolean, broadcastable to ``(B, H, Lq, Lk)``, True where a key may be attended.
            Every query must keep at least one key (:class:`KeyMask` makes sure of it).
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        use_sdpa: use ``F.scaled_dot_product_attention`` when it computes the same thing: with
            :func:`softmax_normalize` and without ``need_weights`` (SDPA does not return weights).
            Otherwise the explicit matmul-normalise-matmul path runs.
        need_weights: also return the ``(B, H, Lq, Lk)`` weights (before dropout).
        normalize: scores -> weights, e.g. :func:`softmax_normalize` or :func:`leaky_relu_normalize`.

    Returns:
        ``(output (B, H, Lq, hd), weights or None)``.
    """
    if use_sdpa and not need_weights and normalize is softmax_normalize:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p), None
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Lq, Lk)
    weights = normalize(scores, mask)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return dropped @ v, (weights if need_weights else None)


class KeyMask:
    """Which keys each query may attend, with the one rule for a query that may attend none.

    A softmax over no key is 0/0: NaN in the forward and in the backward pass. A query with no
    allowed key therefore attends every key (:attr:`attend`, finite everywhere), and
    :meth:`zero_empty` then sets its output and weights to 0: it gets a zero output and zero,
    finite gradients, never NaN. Every attention layer of vlfuse goes through this class.

    Args:
        allowed: ``(B, Lq or 1, Lk)`` bool, True where a query may attend a key.

    Attributes:
        attend: ``(B, 1, Lq or 1, Lk)`` the mask to attend with (broadcast over the heads).
        has_key: ``(B, Lq or 1)`` False for the queries with no allowed key.
    """

    def __init__(self, allowed: torch.Tensor) -> None:
        self.has_key = allowed.any(dim=-1)  # (B, Lq or 1)
        self.attend = (allowed | ~self.has_key[..., None])[:, None]  # (B, 1, Lq or 1, Lk)

    def zero_empty(
        self, out: torch.Tensor, weights: torch.Tensor | None = None, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Zero the output and weights of the queries with no key.

        Either rows of queries, output ``(B', Lq, dim)`` and weights ``(B', H, Lq, Lk)``, or packed
        query tokens, output ``(N, dim)`` and weights ``(N, H, Lk)``, under a mask of one query per
        row (``Lq = 1``). ``rows``: ``(B')`` or ``(N,)`` the mask row of each output row, when they
        differ (shared contexts).
        """
        has_key = self.has_key if rows is None else self.has_key[rows]  # (B', Lq or 1), or (N, 1)
        if out.dim() == 2:
            return out.masked_fill(~has_key, 0.0), None if weights is None else weights.masked_fill(~has_key[..., None], 0.0)
        out = out.masked_fill(~has_key[..., None], 0.0)
        if weights is not None:
            weights = weights.masked_fill(~has_key[:, None, :, None], 0.0)
        return out, weights


class OutputGate(nn.Linear):
    """The query-dependent output gate (Qiu et al., 2025, "Gated Attention for Large Language Models").

    Multiplies the heads' concatenated outputs, channel by channel, by ``sigmoid(x W_g + b_g)``
    computed from the query token, before the output projection. It lets a query scale what it
    read by what it asked, a multiplicative interaction a plain residual sum must otherwise learn
    through the MLP. A ``Linear(dim, H * hd)`` whose forward also takes the merged heads; in a
    :class:`CrossAttention` it is ``gate_proj`` (the parameter names of saved models).
    """

    def forward(self, x: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, Lq, dim)`` queries, ``merged`` ``(B, Lq, H * hd)`` heads -> gated ``(B, Lq, H * hd)``."""
        return merged * torch.sigmoid(super().forward(x))



class MultiHeadAttention(nn.Module):
    """The core every attention layer of vlfuse shares: projections, heads, the attention core, pruning.

    It holds the query projection ``q_proj``, the fused key/value projection ``kv_proj`` (rows:
    keys, then values), the output projection ``out_proj`` and the optional :class:`OutputGate`
    ``gate_proj``, and computes ``out_proj(gate(heads(normalize(Q K^T / sqrt(hd)) V)))`` for all
    heads at once. The layers differ only in where their keys come from and which keys each query
    may see, and each is a thin subclass that says so in its ``forward``:
    :class:`CrossAttention` (another sequence), :class:`SelfAttention` (the sequence itself, under
    a padding mask), :class:`~vlfuse.layers.causal.CausalSelfAttention` (itself, the tokens before
    each, with a key/value cache) and :class:`~vlfuse.layers.local_attention.LocalSelfAttention`
    (itself, under a local layout). All of them share these parameter names, which are
    ``nn.MultiheadAttention``'s split in two (see :meth:`from_torch`), so that saved models of
    every format load into them.

    The core is SDPA; the explicit matmul-normalise-matmul path runs only for a call that asks for
    the weights, with a normaliser other than softmax, or with ``use_sdpa = False``.

    Args:
        dim: width of the queries and of the output.
        num_heads: number of attention heads; ``dim`` must be divisible by it.
        kv_dim: width of the sequence keys and values come from (default: ``dim``).
        dropout: dropout probability on the attention weights, in training mode.
        bias: whether the projections have biases.
        normalizer: how scores become weights, a name of :data:`NORMALIZERS`: ``"softmax"`` (the
            SDPA path) or ``"leaky_relu"`` (:func:`leaky_relu_normalize`, explicit path).
        output_gate: gate the heads' outputs by the query (:class:`OutputGate`, as ``gate_proj``).

    Attributes:
        use_sdpa: set to False for the explicit reference path.
        head_ids: original indices of the heads still present, in the order of the weight rows.
        attends_itself: the keys and values come from the queries' own sequence (class attribute).
    """

    attends_itself: ClassVar[bool] = False

    def __init__(
        self,
        dim: int,
        num_heads: int = 16,
        *,
        kv_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        normalizer: Normalizer = "softmax",
        output_gate: bool = False,
    ) -> None:
        super().__init__()
        if normalizer not in NORMALIZERS:
            raise ValueError(f"normalizer must be one of {tuple(NORMALIZERS)}, got {normalizer!r}")
        if num_heads < 1:
            raise ValueError(f"num_heads must be at least 1, got {num_heads}")
        if dim % num_heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dim, self.kv_dim, self.head_dim = dim, dim if kv_dim is None else kv_dim, dim // num_heads
        self.dropout = dropout
        self.normalizer, self.normalize = normalizer, NORMALIZERS[normalizer]
        self.use_sdpa = True
        self.head_ids: list[int] = list(range(num_heads))
        inner = num_heads * self.head_dim
        self.q_proj = nn.Linear(dim, inner, bias=bias)
        self.kv_proj = nn.Linear(self.kv_dim, 2 * inner, bias=bias)  # rows: [keys; values]
        self.out_proj = nn.Linear(inner, dim, bias=bias)
        self.gate_proj = OutputGate(dim, inner) if output_gate else None
        self.reset_parameters()

    @property
    def num_heads(self) -> int:
        return len(self.head_ids)

    @property
    def pruned_heads(self) -> set[int]:
        """Original indices of the heads removed so far."""
        return set(range(self.dim // self.head_dim)) - set(self.head_ids)

    def reset_parameters(self) -> None:
        """Xavier-uniform projections (as in the original Transformer), zero biases."""
        inner = self.num_heads * self.head_dim
        nn.init.xavier_uniform_(self.q_proj.weight)
        # Initialise keys and values separately so each gets the fan of its own matrix.
        nn.init.xavier_uniform_(self.kv_proj.weight[:inner])
        nn.init.xavier_uniform_(self.kv_proj.weight[inner:])
        nn.init.xavier_uniform_(self.out_proj.weight)
        for linear in (self.q_proj, self.kv_proj, self.out_proj):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.gate_proj is not None:
            nn.init.xavier_uniform_(self.gate_proj.weight)
            nn.init.zeros_(self.gate_proj.bias)  # gates start near 0.5 on average

    # ------------------------------------------------------------------------- the shared steps
    def project_context(self, context: torch.Tensor, context_mask: torch.Tensor | None = None) -> ProjectedContext:
        """Project ``context`` ``(B, Lk, kv_dim)`` to keys and values once, for reuse across calls."""
        _check_context(context, context_mask, self.kv_dim)
        if type(self.kv_proj) is nn.Linear:
            # Two products with the halves of kv_proj rather than one product split in two: the keys and
            # the values each come out contiguous for SDPA, and backward adds the two input gradients
            # instead of concatenating the key and value gradients into one (B, Lk, 2 * H * hd) tensor.
            # Slices, not chunk(): an ONNX export folds them into two stored weights, which int8 quantizes.
            weight, bias, inner = self.kv_proj.weight, self.kv_proj.bias, self.kv_proj.out_features // 2
            key = F.linear(context, weight[:inner], None if bias is None else bias[:inner])  # (B, Lk, H * hd)
            value = F.linear(context, weight[inner:], None if bias is None else bias[inner:])  # (B, Lk, H * hd)
        else:
            # A module put in its place (a peft LoRA layer, a quantized Linear) runs as it is: its
            # weight alone would leave out what the module adds.
            key, value = self.kv_proj(context).chunk(2, dim=-1)  # each (B, Lk, H * hd)
        return ProjectedContext(self.split_heads(key), self.split_heads(value), context_mask)

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, L, H * hd) -> (B, H, L, hd)``."""
        b, length, _ = t.shape
        return t.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)

    def attend(
        self,
        x: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_mask: KeyMask | None = None,
        *,
        need_weights: bool = False,
        head_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queries from ``x`` ``(B, Lq, dim)`` over ``key``/``value`` ``(B, H, Lk, hd)``: ``(out (B, Lq, dim), weights)``.

        ``key_mask`` (over ``(B, Lq or 1, Lk)``) says which keys each query may see; a query left
        with none gets a zero output. ``head_mask``: ``(H,)`` or ``(B, H)`` factors on the heads.
        """
        q = self.split_heads(self.q_proj(x))  # (B, H, Lq, hd)
        out, weights = self.core(q, key, value, None if key_mask is None else key_mask.attend, need_weights)
        b, h, lq, hd = out.shape
        if head_mask is not None and head_mask.dim() == 2:
            head_mask = head_mask[:, None]  # (B, 1, H): broadcast over tokens
        out = self.project_out(out.transpose(1, 2).reshape(b, lq, h * hd), x, head_mask)  # from (B, Lq, H * hd)
        if key_mask is not None:
            out, weights = key_mask.zero_empty(out, weights)
        return out, weights

    def core(
        self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, need_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`attention_core` with this layer's options: ``q`` ``(B, H, Lq, hd)`` -> ``(out (B, H, Lq, hd), weights)``;
        ``mask`` as for :func:`attention_core` (every query must keep a key)."""
        return attention_core(
            q, key, value, mask,
            dropout_p=self.dropout if self.training else 0.0, use_sdpa=self.use_sdpa, need_weights=need_weights,
            normalize=self.normalize,
        )

    def project_out(self, merged: torch.Tensor, x: torch.Tensor, head_mask: torch.Tensor | None) -> torch.Tensor:
        """Concatenated heads ``(..., H * hd)`` -> ``(..., dim)``: scale each head by ``head_mask`` (broadcast
        to ``(..., H)``), gate by the queries ``x`` ``(..., dim)``, project."""
        if head_mask is not None:
            heads = merged.unflatten(-1, (self.num_heads, self.head_dim))  # (..., H, hd)
            merged = (heads * head_mask[..., None]).flatten(-2)
        if self.gate_proj is not None:
            merged = self.gate_proj(x, merged)
        return self.out_proj(merged)

    # ------------------------------------------------------------------------------- pruning
    @torch.no_grad()
    def prune_heads(self, heads: Iterable[int]) -> None:
        """Remove heads for real, by their original index (idempotent for removed heads).

        The q/k/v rows, the gate rows and the output-projection columns of those heads are sliced
        away, so the remaining heads cost proportionally less.
        """
        original_count = self.dim // self.head_dim
        heads = set(int(h) for h in heads)
        bad = sorted(h for h in heads if not 0 <= h < original_count)
        if bad:
            raise ValueError(f"head indices {bad} out of range for a layer built with {original_count} heads")
        keep = [i for i, h in enumerate(self.head_ids) if h not in heads]
        if not keep:
            raise ValueError(f"cannot prune every head of a {type(self).__name__} layer")
        if len(keep) == self.num_heads:
            return
        hd, inner = self.head_dim, self.num_heads * self.head_dim
        rows = torch.tensor([i * hd + j for i in keep for j in range(hd)], device=self.q_proj.weight.device)
        self.q_proj = _slice_linear(self.q_proj, rows, dim=0)
        self.kv_proj = _slice_linear(self.kv_proj, torch.cat([rows, rows + inner]), dim=0)
        self.out_proj = _slice_linear(self.out_proj, rows, dim=1)
        if self.gate_proj is not None:
            self.gate_proj = _slice_linear(self.gate_proj, rows, dim=0)
        self.head_ids = [self.head_ids[i] for i in keep]

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, **options) -> "MultiHeadAttention":
        """Copy the weights of a ``batch_first`` :class:`nn.MultiheadAttention` (``kdim``/``vdim`` too);
        ``options`` go to the constructor (e.g. a local attention's ``layout``)."""
        weights = _weights_of_torch_attention(mha)
        if mha.kdim != mha.embed_dim:
            if cls.attends_itself:
                raise ValueError(
                    f"{cls.__name__} attends a sequence over itself: it needs kdim == vdim == embed_dim "
                    f"({mha.embed_dim}), got kdim={mha.kdim} (CrossAttention.from_torch copies this layer)"
                )
            options["kv_dim"] = mha.kdim
        attn = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias="q_proj.bias" in weights, **options)
        attn.load_state_dict(weights)
        return attn.to(mha.out_proj.weight.device, mha.out_proj.weight.dtype)

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, kv_dim={self.kv_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}"
        if self.normalizer != "softmax":
            text += f", normalizer={self.normalizer}"
        return text + (", output_gate=True" if self.gate_proj is not None else "")


class CrossAttention(MultiHeadAttention):
    """Multi-head attention whose queries come from ``x`` and keys/values from ``context``.

    The layer of the fusion blocks: text tokens are the queries, image tokens the keys and values.
    Keys and values can be projected once (:meth:`project_context`) and read by many query rows
    (``context_index``, e.g. many questions about one image); :meth:`prune_heads` removes heads for
    real (the remaining ones cost less); ``head_mask`` switches them off per call.

    Args:
        dim: width of the query sequence ``x`` and of the output.
        num_heads: number of attention heads; ``dim`` must be divisible by it.
        kv_dim: width of the context sequence (default: ``dim``).
        dropout, bias, normalizer, output_gate: see :class:`MultiHeadAttention`.
    """

    def keys_values(
        self,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        kv: ProjectedContext | ContextTokens | None = None,
    ) -> ProjectedContext:
        """``kv`` as given, or the keys/values of ``context`` or of ``kv``'s :class:`ContextTokens`
        (exactly one of ``context`` and ``kv``)."""
        if (context is None) == (kv is None):
            raise ValueError("pass exactly one of context or kv")
        if kv is not None and context_mask is not None:
            raise ValueError("context_mask belongs to project_context when kv is given")
        if isinstance(kv, ContextTokens):
            return self.project_context(kv.tokens, kv.mask)
        return kv if kv is not None else self.project_context(context, context_mask)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        context_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        kv: ProjectedContext | None = None,
        context_index: torch.Tensor | None = None,
        head_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to ``context``.

        Args:
            x: ``(B, Lq, dim)`` queries.
            context: ``(Bc, Lk, kv_dim)`` keys/values; omit when ``kv`` is given.
            context_mask: ``(Bc, Lk)`` bool, True where a key may be attended. A query whose keys
                are all masked gets a zero output (and zero gradients), never NaN (:class:`KeyMask`).
            need_weights: also return the per-head attention weights ``(B, H, Lq, Lk)``. Only this
                call takes the explicit path; other layers keep the fast one.
            kv: keys/values from :meth:`project_context`, instead of ``context``.
            context_index: ``(B,)`` the context row each row of ``x`` attends to, when several
                rows share one context (e.g. many questions about one image). Default: row i
                attends to context row i, and ``Bc`` must equal ``B``.
            head_mask: ``(H,)`` or ``(B, H)`` factors, one per head present (in the order of
                ``head_ids``), multiplying each head's output before the output projection: 0
                gives the same output as pruning that head, 1 leaves it; differentiable.

        Returns:
            ``(B, Lq, dim)``, or ``(output, weights)`` when ``need_weights`` is set.
        """
        kv = self.keys_values(context, context_mask, kv)
        check_queries(x, self.dim, kv, self.num_heads, context_index, head_mask)
        if context_index is not None and torch.compiler.is_compiling():  # packing's sizes depend on the data
            kv, context_index = kv.rows(context_index), None
        if context_index is None:
            key_mask = None if kv.mask is None else KeyMask(kv.mask[:, None, :])  # over (B, 1, Lk)
            out, weights = self.attend(x, kv.key, kv.value, key_mask, need_weights=need_weights, head_mask=head_mask)
            return (out, weights) if need_weights else out
        b, lq, h = x.shape[0], x.shape[1], self.num_heads
        layout = PackedTokens.of(x, None, context_index, kv.batch_size)  # every row's tokens, grouped by context row
        out, weights = self.attend_packed(
            layout.pack(x), kv, layout.groups, need_weights=need_weights, head_mask=layout.per_token(head_mask)
        )
        out = layout.unpack(out, x)  # (B, Lq, dim)
        weights = None if weights is None else weights.view(b, lq, h, kv.key.shape[2]).transpose(1, 2)  # (B, H, Lq, Lk)
        return (out, weights) if need_weights else out

    def attend_packed(
        self,
        tokens: torch.Tensor,
        kv: ProjectedContext,
        groups: ContextGroups,
        *,
        need_weights: bool = False,
        head_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from packed query tokens, each to its own context row (see :mod:`vlfuse.layers.packing`).

        The projections and the gate run on the ``N`` tokens alone; attention runs once per
        context row over all the tokens that read it, ``(Bc, H, Lg, hd)``.

        Args:
            tokens: ``(N, dim)`` query tokens, e.g. the real tokens of padded questions.
            kv: keys/values of the ``Bc`` context rows, from :meth:`project_context`.
            groups: the context row of each token, as :class:`~vlfuse.layers.packing.ContextGroups`.
            need_weights: also return the weights ``(N, H, Lk)``.
            head_mask: ``(H,)`` or ``(N, H)`` factors on the heads' outputs (see :meth:`forward`).

        Returns:
            ``(output (N, dim), weights (N, H, Lk) or None)``.
        """
        n, h, hd = tokens.shape[0], self.num_heads, self.head_dim  # not len(): it fixes a symbolic size
        key_mask = None if kv.mask is None else KeyMask(kv.mask[:, None, :])  # over (Bc, 1, Lk)
        q = groups.group(self.q_proj(tokens))  # (Bc, Lg, H * hd)
        q = q.view(groups.num_contexts, groups.size, h, hd).transpose(1, 2)  # (Bc, H, Lg, hd)
        out, weights = self.core(q, kv.key, kv.value, None if key_mask is None else key_mask.attend, need_weights)
        merged = groups.ungroup(out.transpose(1, 2).reshape(groups.num_contexts, groups.size, h * hd))  # (N, H * hd)
        if weights is not None:
            weights = groups.ungroup(weights.transpose(1, 2).flatten(2)).view(n, h, kv.key.shape[2])  # (N, H, Lk)
        out = self.project_out(merged, tokens, head_mask)  # (N, dim)
        if key_mask is not None:
            out, weights = key_mask.zero_empty(out, weights, rows=groups.context)
        return out, weights


class SelfAttention(MultiHeadAttention):
    """Multi-head attention of a sequence over itself, with a padding mask: a fusion block's text self-attention.

    Args:
        dim: width of the tokens.
        num_heads: number of attention heads; ``dim`` must be divisible by it.
        dropout, bias, normalizer, output_gate: see :class:`MultiHeadAttention`.
    """

    attends_itself = True

    def __init__(
        self,
        dim: int,
        num_heads: int = 16,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        normalizer: Normalizer = "softmax",
        output_gate: bool = False,
    ) -> None:
        super().__init__(dim, num_heads, dropout=dropout, bias=bias, normalizer=normalizer, output_gate=output_gate)

    def check_tokens(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        """``x`` must be ``(B, L, dim)`` and ``mask``, if any, a bool ``(B, L)``: a ``ValueError`` names them."""
        if x.dim() != 3:
            raise ValueError(f"x must be (batch, length, {self.dim}), got shape {tuple(x.shape)}")
        if x.shape[-1] != self.dim:
            raise ValueError(f"x has width {x.shape[-1]}, but this layer expects dim={self.dim}")
        if mask is not None and mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor (True for real tokens), got dtype {mask.dtype}")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"mask must have shape (batch, length) = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from each token of ``x`` ``(B, L, dim)`` to every real token of its row.

        Args:
            mask: ``(B, L)`` bool, True for real (non-padding) tokens; padding keys get no weight.
            need_weights: also return the weights ``(B, H, L, L)`` (the explicit path).

        Returns:
            ``(B, L, dim)``, or ``(output, weights)`` when ``need_weights`` is set.
        """
        self.check_tokens(x, mask)
        kv = self.project_context(x, mask)
        key_mask = None if mask is None else KeyMask(mask[:, None, :])  # over (B, 1, L)
        out, weights = self.attend(x, kv.key, kv.value, key_mask, need_weights=need_weights)
        return (out, weights) if need_weights else out

def _check_context(context: torch.Tensor, context_mask: torch.Tensor | None, kv_dim: int) -> None:
    if context.dim() != 3:
        raise ValueError(f"context must be (batch, length, {kv_dim}), got shape {tuple(context.shape)}")
    if context.shape[-1] != kv_dim:
        raise ValueError(f"context has width {context.shape[-1]}, but this layer expects kv_dim={kv_dim}")
    if context_mask is not None and context_mask.dtype != torch.bool:
        raise ValueError(f"context_mask must be a bool tensor (True = may attend), got dtype {context_mask.dtype}")
    if context_mask is not None and context_mask.shape != context.shape[:2]:
        raise ValueError(
            f"context_mask must have shape (batch, context length) = {tuple(context.shape[:2])}, "
            f"got {tuple(context_mask.shape)}"
        )


def check_head_mask(head_mask: torch.Tensor | None, batch: int, heads: int) -> None:
    """``head_mask``, if any, must be ``(H,)`` or ``(B, H)`` over the heads present."""
    if head_mask is not None and head_mask.shape not in ((heads,), (batch, heads)):
        raise ValueError(
            f"head_mask must have shape ({heads},) or ({batch}, {heads}) (the heads present), got {tuple(head_mask.shape)}"
        )


def check_queries(
    x: torch.Tensor,
    dim: int,
    kv: ProjectedContext | ContextTokens,
    heads: int,
    context_index: torch.Tensor | None,
    head_mask: torch.Tensor | None = None,
) -> None:
    """The one check of a cross-attention's inputs: ``x`` must be ``(B, Lq, dim)``, ``kv`` have the
    layer's heads and one row per row of ``x`` or ``context_index`` point into its rows, and
    ``head_mask`` (if any) be ``(H,)`` or ``(B, H)``."""
    check_head_mask(head_mask, x.shape[0] if x.dim() == 3 else 0, heads)
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"x must be (batch, length, {dim}), got shape {tuple(x.shape)}")
    batch = x.shape[0]
    if isinstance(kv, ProjectedContext) and kv.key.shape[1] != heads:
        raise ValueError(f"kv was projected with {kv.key.shape[1]} heads, this layer has {heads}")
    contexts = kv.batch_size
    if context_index is None:
        if contexts != batch:
            raise ValueError(f"batch sizes differ: x has {batch}, context has {contexts} (pass context_index?)")
        return
    if context_index.shape != (batch,) or context_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"context_index must be an integer tensor of shape ({batch},), "
            f"got {context_index.dtype} {tuple(context_index.shape)}"
        )
    if torch.compiler.is_compiling():  # the values are data: not checked in a compiled or exported program
        return
    if batch and (int(context_index.min()) < 0 or int(context_index.max()) >= contexts):
        raise ValueError(f"context_index values must be in [0, {contexts}) for {contexts} context rows")


def _weights_of_torch_attention(mha: nn.MultiheadAttention) -> dict[str, torch.Tensor]:
    """The weights of ``mha`` under :class:`CrossAttention`'s parameter names."""
    if not mha.batch_first:
        raise ValueError("from_torch needs nn.MultiheadAttention(batch_first=True)")
    if mha.kdim != mha.vdim:
        raise ValueError(f"CrossAttention needs kdim == vdim, got kdim={mha.kdim}, vdim={mha.vdim}")
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError("add_bias_kv and add_zero_attn have no CrossAttention equivalent")
    if mha._qkv_same_embed_dim:
        w_q, w_k, w_v = mha.in_proj_weight.split(mha.embed_dim)
    else:
        w_q, w_k, w_v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    weights = {"q_proj.weight": w_q, "kv_proj.weight": torch.cat([w_k, w_v]), "out_proj.weight": mha.out_proj.weight}
    if mha.in_proj_bias is not None:
        b_q, b_k, b_v = mha.in_proj_bias.split(mha.embed_dim)
        weights.update({"q_proj.bias": b_q, "kv_proj.bias": torch.cat([b_k, b_v]), "out_proj.bias": mha.out_proj.bias})
    return {name: w.detach() for name, w in weights.items()}


def _slice_linear(linear: nn.Linear, index: torch.Tensor, dim: int) -> nn.Linear:
    """A new Linear of the same class keeping rows (dim=0, outputs) or columns (dim=1, inputs) ``index``."""
    weight = linear.weight.index_select(dim, index).clone()
    out_features, in_features = weight.shape
    new = type(linear)(in_features, out_features, bias=linear.bias is not None, device=weight.device, dtype=weight.dtype)
    new.weight.copy_(weight)
    if linear.bias is not None:
        new.bias.copy_(linear.bias.index_select(0, index) if dim == 0 else linear.bias)
    new.weight.requires_grad_(linear.weight.requires_grad)
    return new

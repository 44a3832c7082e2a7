"""Causal self-attention with a key/value cache, for decoders that write text token by token.

Each token attends to itself and to the tokens before it. While generating, the keys and values
of the tokens written so far are kept in a :class:`KVCache`, so each new token costs one row of
projections and one row of attention instead of a pass over the whole prefix.
"""

from __future__ import annotations

import torch

from vlfuse.layers.attention import MultiHeadAttention, Normalizer


class KVCache:
    """The keys and values of the tokens one causal attention layer has seen so far.

    Attributes:
        key: ``(B, H, L, hd)`` keys of the ``L`` tokens seen, or ``None`` before the first.
        value: ``(B, H, L, hd)`` their values.
    """

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """How many tokens the cache holds."""
        return 0 if self.key is None else self.key.shape[2]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the keys/values ``(B, H, Lnew, hd)`` of new tokens; return those of every token seen."""
        if self.key is not None:
            key, value = torch.cat([self.key, key], dim=2), torch.cat([self.value, value], dim=2)  # (B, H, L + Lnew, hd)
        self.key, self.value = key, value
        return key, value

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` ``(B',)`` (in that order): beam search follows its surviving beams."""
        if self.key is not None:
            self.key, self.value = self.key[rows], self.value[rows]


def causal_mask(num_queries: int, num_past: int, device: torch.device | None = None) -> torch.Tensor | None:
    """``(Lq, num_past + Lq)`` bool, True where query ``i`` (token ``num_past + i``) may attend a key;
    ``None`` for one query, which may attend every key."""
    if num_queries == 1:
        return None
    allowed = torch.ones(num_queries, num_past + num_queries, dtype=torch.bool, device=device)
    return allowed.tril(diagonal=num_past)


class CausalSelfAttention(MultiHeadAttention):
    """Multi-head self-attention in which each token attends to itself and the tokens before it.

    The core of :class:`~vlfuse.layers.attention.MultiHeadAttention` (its parameters and options) on
    the layer's own input. Right padding needs no mask: a real token never attends the padding
    after it.

    Args:
        dim: width of the tokens.
        num_heads: number of attention heads; ``dim`` must be divisible by it.
        dropout, bias, normalizer, output_gate: see :class:`~vlfuse.layers.attention.MultiHeadAttention`.
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

    def forward(
        self, x: torch.Tensor, *, cache: KVCache | None = None, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from each token of ``x`` ``(B, Lq, dim)`` to itself and the tokens before it.

        Args:
            cache: the keys/values of earlier tokens; the tokens of ``x`` follow them, and their
                own keys/values are added to it. ``None``: ``x`` is the whole sequence.
            need_weights: also return the weights ``(B, H, Lq, L)`` (the explicit path).

        Returns:
            ``(B, Lq, dim)``, or ``(output, weights)`` when ``need_weights`` is set.
        """
        q = self.split_heads(self.q_proj(x))  # (B, H, Lq, hd)
        key, value = (self.split_heads(t) for t in self.kv_proj(x).chunk(2, dim=-1))  # each (B, H, Lq, hd)
        past = 0
        if cache is not None:
            past = cache.length
            key, value = cache.append(key, value)  # each (B, H, past + Lq, hd)
        out, weights = self.core(q, key, value, causal_mask(x.shape[1], past, x.device), need_weights)
        b, h, lq, hd = out.shape
        out = self.project_out(out.transpose(1, 2).reshape(b, lq, h * hd), x, None)  # from (B, Lq, H * hd)
        return (out, weights) if need_weights else out

"""In-memory caches for training on the same inputs epoch after epoch: a frozen encoder's outputs,
one entry per distinct input, and each distinct question's tokens."""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Callable, Hashable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

DEFAULT_MAX_BYTES = 2 * 2**30
"""Memory a cache may fill (2 GiB): easy-VQA's features fit many times over; a set larger than this
has its first features cached and the rest computed each epoch, instead of running out of memory."""


def tensor_key(row: torch.Tensor) -> bytes:
    """A key for one input row (e.g. an image's pixels): a digest of its bytes, shape and dtype."""
    data = row.detach().contiguous().cpu()
    digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=16)
    digest.update(f"{tuple(data.shape)}{data.dtype}".encode())
    return digest.digest()


class FeatureCache:
    """Remembers what a frozen encoder returned for each input, so it runs once per input.

    The first epoch fills it; later ones read it, so that only the layers that learn run. Entries
    stay on the device they were computed on, detached (a frozen encoder needs no gradient).

    Args:
        max_bytes: stop adding entries once they would take more memory than this; outputs that do
            not fit are returned all the same, and computed again next time.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._store: dict[Hashable, torch.Tensor] = {}
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._store)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._store

    def clear(self) -> None:
        self._store.clear()
        self.nbytes = 0

    def get(self, keys: Sequence[Hashable], compute: Callable[[list[int]], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """The output of each key, computing those not yet cached in one call.

        Args:
            keys: one per input row.
            compute: given the rows (positions in ``keys``) to compute, their outputs, one each.
        """
        first: dict[Hashable, int] = {}
        for i, key in enumerate(keys):
            if key not in self._store:
                first.setdefault(key, i)
        computed: dict[Hashable, torch.Tensor] = {}
        if first:
            with torch.no_grad():
                computed = {key: output.detach() for key, output in zip(first, compute(list(first.values())))}
        for key, output in computed.items():
            if self.nbytes + output.nbytes <= self.max_bytes:
                self._store[key] = output
                self.nbytes += output.nbytes
        self.misses += len(first)
        self.hits += len(keys) - len(first)
        return [self._store[key] if key in self._store else computed[key] for key in keys]


class TokenCache:
    """Tokenizes each distinct question once and pads every batch from what it kept.

    Gives what ``tokenize(questions)`` gives: ``input_ids`` and ``attention_mask`` ``(Bq, Lt)``,
    padded to the batch's longest question on the tokenizer's side.

    Args:
        tokenize: questions -> ``{"input_ids", "attention_mask"}``, padded to the longest.
        pad_token_id: the tokenizer's padding id.
        padding_side: the tokenizer's, ``"right"`` or ``"left"``.
    """

    def __init__(
        self, tokenize: Callable[[list[str]], dict[str, torch.Tensor]], pad_token_id: int, padding_side: str = "right"
    ) -> None:
        self._tokenize = tokenize
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.tokens = FeatureCache()
        """Each question's real tokens (no padding), by question."""

    def __call__(self, questions: Sequence[str]) -> dict[str, torch.Tensor]:
        def compute(new: list[int]) -> list[torch.Tensor]:
            encoded = self._tokenize([questions[i] for i in new])
            return [ids[mask.bool()] for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]

        rows = self.tokens.get(list(questions), compute)  # each (real tokens,)
        pad = partial(pad_sequence, batch_first=True, padding_side=self.padding_side)
        return {
            "input_ids": pad(rows, padding_value=self.pad_token_id),  # (Bq, Lt)
            "attention_mask": pad([torch.ones_like(row) for row in rows], padding_value=0),
        }

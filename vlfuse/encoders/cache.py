"""An in-memory cache of a frozen encoder's outputs, one entry per distinct input."""

from __future__ import annotations

import hashlib
from typing import Callable, Hashable, Sequence

import torch

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

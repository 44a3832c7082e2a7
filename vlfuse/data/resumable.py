"""A training sampler and DataLoader whose order and position survive a restart.

The order of an epoch is a function of ``(seed, epoch)`` alone (DistributedSampler's: a
permutation drawn with ``seed + epoch``, of which each rank takes every ``num_replicas``-th index),
so a run resumed at epoch ``e`` shuffles epoch ``e`` as the uninterrupted run did. The loader's
``state_dict`` adds how many batches of the current epoch it has handed out; Lightning's fit loop
saves it in every checkpoint (as it does for torchdata's ``StatefulDataLoader``), and a restored
loader skips those batches on its next pass over the same epoch.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class EpochShuffleSampler(DistributedSampler):
    """DistributedSampler's shuffled order, which can start part-way through an epoch.

    Being a ``DistributedSampler``, Lightning calls its ``set_epoch`` before every epoch and does
    not replace it under DDP; pass the trainer's ``num_replicas`` and ``rank`` there.

    Args:
        dataset: the training dataset.
        seed: seed of every epoch's permutation (together with the epoch).
        num_replicas: processes sharing the data (DDP world size).
        rank: this process's rank.
    """

    def __init__(self, dataset: Dataset, *, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.start = 0
        """Indices of this rank's share to skip on the next pass only (batches already trained on)."""

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start = self.start, 0
        return iter(indices[start:])


class ResumableDataLoader(DataLoader):
    """A DataLoader over an :class:`EpochShuffleSampler` that saves and restores its place in the epoch.

    ``state_dict()`` is ``{"seed", "epoch", "batches"}``: the sampler's seed and epoch and the
    batches of that epoch handed out so far. After ``load_state_dict``, the next pass over that
    epoch skips those batches without loading them; a pass over any other epoch starts at its
    beginning (a checkpoint written at the end of epoch ``e`` resumes with epoch ``e + 1``).

    Iteration is lazy: the sampler's epoch and position are read when the first batch is asked
    for, not when ``iter()`` is called (Lightning creates the iterator before it restores a
    checkpoint and before it sets the epoch). The worker processes' base seed is drawn from a
    generator seeded with ``seed + epoch`` at each pass, so random augmentations in workers
    depend on the epoch, not on how many passes this process has made.

    Where Lightning replaces the sampler (``overfit_batches`` puts a SequentialSampler in), the
    loader is a plain DataLoader with an empty state.

    Args:
        dataset: the training dataset.
        sampler: its sampler.
        **kwargs: any other DataLoader argument (``batch_size``, ``collate_fn``, ``num_workers``...).
    """

    def __init__(self, dataset: Dataset, sampler: EpochShuffleSampler, **kwargs) -> None:
        kwargs.setdefault("generator", torch.Generator())
        super().__init__(dataset, sampler=sampler, **kwargs)
        self._batches_handed_out = 0
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches) restored by load_state_dict

    @property
    def _resumable(self) -> bool:
        return isinstance(self.sampler, EpochShuffleSampler)

    def state_dict(self) -> dict[str, int]:
        if not self._resumable:
            return {}
        return {"seed": self.sampler.seed, "epoch": self.sampler.epoch, "batches": self._batches_handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not (state and self._resumable):
            return
        self.sampler.seed = state["seed"]
        self.sampler.set_epoch(state["epoch"])
        self._resume_at = (state["epoch"], state["batches"])

    def __iter__(self) -> Iterator:
        return self._batches()

    def _batches(self) -> Iterator:
        if not self._resumable:
            yield from super().__iter__()
            return
        epoch = self.sampler.epoch
        skip = self._resume_at[1] if self._resume_at is not None and self._resume_at[0] == epoch else 0
        self._resume_at = None
        self.sampler.start = skip * self.batch_size
        self.generator.manual_seed(self.sampler.seed + epoch)
        self._batches_handed_out = skip
        for batch in super().__iter__():
            self._batches_handed_out += 1
            yield batch

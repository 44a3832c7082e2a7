"""What every front-end of a saved model shares: the device, the batch size and the torch threads."""

from __future__ import annotations

import torch
from torch import nn

from vlfuse.runtime import DEFAULT_DEVICE, DEFAULT_THREADS, check_threads


class ModelRunner:
    """Runs ``model`` in eval mode on ``device``, ``batch_size`` items per forward pass.

    Args:
        model: the model (put in eval mode and moved to ``device``).
        device: where to run, e.g. ``"cpu"`` or ``"cuda"``.
        batch_size: items per forward pass.
        threads: torch's CPU threads during a call (restored after it); ``None`` leaves torch's
            setting. The default, 1, stays fast when other processes share the cores
            (:mod:`vlfuse.runtime`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device = DEFAULT_DEVICE,
        batch_size: int = 64,
        threads: int | None = DEFAULT_THREADS,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        check_threads(threads, "threads")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.batch_size = batch_size
        self.threads = threads

"""Shared fixtures: a tiny architecture that trains in seconds on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlfuse.encoders import ImageEncoderConfig, TextEncoderConfig
from vlfuse.model import VLFuseConfig

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def tiny_config(**overrides) -> VLFuseConfig:
    """A model small enough to train in seconds: widths 32, one layer each, 16 fusion heads."""
    fields = dict(
        image=ImageEncoderConfig(image_size=32, patch_size=8, width=32, depth=1, num_heads=2),
        text=TextEncoderConfig(width=32, depth=1, num_heads=2, max_length=16),
        fusion_dim=32,
        fusion_depth=2,
        fusion_heads=16,
        dropout=0.0,
    )
    fields.update(overrides)
    return VLFuseConfig(**fields)


def tiny_cli_args(root: Path, limit_images: int = 8, *, map_program: bool = False) -> list[str]:
    """Command-line overrides that shrink any config to a tiny model on a few images.

    ``map_program``: the config's readout is ``map_program``, which needs text and fusion depth 0.
    """
    depth = 0 if map_program else 1
    return [
        "--model.architecture.image.image_size=32",
        "--model.architecture.image.patch_size=8",
        "--model.architecture.image.width=32",
        "--model.architecture.image.depth=1",
        "--model.architecture.image.num_heads=2",
        "--model.architecture.text.width=32",
        f"--model.architecture.text.depth={depth}",
        "--model.architecture.text.num_heads=2",
        "--model.architecture.fusion_dim=32",
        f"--model.architecture.fusion_depth={depth}",
        f"--data.init_args.limit_images={limit_images}",
        "--data.init_args.batch_size=4",
        "--data.init_args.num_workers=0",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--checkpoint.dirpath={root / 'checkpoints'}",
        f"--export.dirpath={root / 'model'}",
    ]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices on a loaded 2-core machine: OpenMP waits for the busy core cost 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny() -> VLFuseConfig:
    return tiny_config()

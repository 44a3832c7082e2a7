"""scripts/shapes_probe.py: per-cell linear probes of a SHAPES model's patch tokens."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, SHARED, load_script, tiny_config
from vlfuse.encoders import ImageEncoderConfig
from vlfuse.model import VLFuseModel

probe = load_script("shapes_probe")
needs_shapes = pytest.mark.skipif(not (SHARED / "data" / "shapes").exists(), reason="needs ../shared/data/shapes")


def test_a_3x3_grid_gives_the_tokens_themselves_and_a_finer_grid_the_mean_of_each_cells_patches():
    tokens = torch.randn(2, 9, 5)
    torch.testing.assert_close(probe.cell_features(tokens, (3, 3)), tokens.reshape(-1, 5))
    fine = torch.randn(1, 36, 5)  # a 6x6 grid: each scene cell holds a 2x2 block of patches
    cells = probe.cell_features(fine, (6, 6))
    grid = fine.reshape(6, 6, 5)
    torch.testing.assert_close(cells[0], grid[:2, :2].mean((0, 1)))
    torch.testing.assert_close(cells[5], grid[2:4, 4:].mean((0, 1)))  # row 1, column 2


def test_the_probe_reads_a_label_that_the_features_hold_and_not_one_they_do_not():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (600,), generator=g)
    holding = torch.nn.functional.one_hot(labels, 4).float() @ torch.randn(4, 16, generator=g) + 0.1 * torch.randn(600, 16, generator=g)
    assert probe.probe_accuracy(holding, labels) > 0.95
    assert probe.probe_accuracy(torch.randn(600, 16, generator=g), labels) < 0.45  # chance: about 0.25


@needs_shapes
def test_the_command_probes_a_saved_model(tmp_path, one_thread):
    config = tiny_config(image=ImageEncoderConfig(image_size=30, patch_size=10, width=32, depth=1, num_heads=2))
    model = VLFuseModel.from_config(config, ["false", "true"], ["is a red shape above a circle"])
    model.save_pretrained(tmp_path / "model")
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "shapes_probe.py"), "--model", str(tmp_path / "model"), "--scenes", "300",
         "--threads", "1"],
        capture_output=True, text=True, check=True, env={**os.environ, "VLFUSE_SHAPES_DIR": str(SHARED / "data" / "shapes")},
    ).stdout
    lines = [line for line in out.splitlines() if "held out" in line]
    assert len(lines) == 2 and "colour of a cell" in lines[0] and "2700 cells" in lines[0]
    colour = float(lines[0].split(": ")[-1].split("%")[0])
    assert colour > 90  # colour is linear in the pixels: even an untrained patch embedding holds it

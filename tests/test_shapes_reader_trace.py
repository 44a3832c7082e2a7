"""scripts/shapes_reader_trace.py: the reader's probes, every N steps of a fit, as a callback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, SHARED, load_script, tiny_cli_args, tiny_config
from vlfuse.cli import main as vlfuse_main
from vlfuse.model import VLFuseModel

trace = load_script("shapes_reader_trace")
SHAPES_DIR = SHARED / "data" / "shapes"
needs_shapes = pytest.mark.skipif(not SHAPES_DIR.exists(), reason="needs ../shared/data/shapes")
pytestmark = pytest.mark.usefixtures("one_thread")


def fit(root: Path, *extra: str) -> dict[str, torch.Tensor]:
    """``vlfuse fit --config configs/shapes_fusion.yaml``, tiny, 2 epochs of 2 steps: the exported weights."""
    args = [
        "fit", "--config", str(REPO / "configs" / "shapes_fusion.yaml"), *tiny_cli_args(root, map_program=True),
        "--trainer.max_epochs=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
        "--data.init_args.images_per_question=2", *extra,
    ]
    assert vlfuse_main(args) == 0
    return load_file(root / "model" / "model.safetensors")


@needs_shapes
def test_a_traced_fit_writes_a_row_every_n_steps_and_trains_exactly_as_an_untraced_one(tmp_path, monkeypatch):
    monkeypatch.setenv("VLFUSE_SHAPES_DIR", str(SHAPES_DIR))
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    plain = fit(tmp_path / "plain")
    traced = fit(tmp_path / "traced", "--trainer.callbacks+=shapes_reader_trace.ReaderTrace",
                 "--trainer.callbacks.every_n_steps=2", "--trainer.callbacks.scenes=60")
    assert plain.keys() == traced.keys()
    for name in plain:  # the probes draw nothing from the run's random generators and leave its mode
        torch.testing.assert_close(traced[name], plain[name], rtol=0, atol=0, msg=name)

    rows = trace.read_trace(tmp_path / "traced" / "latest" / trace.TRACE_FILE)  # in the run's own folder
    assert [(row["step"], row["epoch"]) for row in rows] == [(1, 0), (2, 0), (4, 1)]
    for row in rows:
        assert set(row["finds"]) == {"red", "green", "blue", "circle", "square", "triangle"}
        assert all(0 <= auc <= 1 for auc in row["finds"].values())
        assert 0 <= row["circle_square"]["median"] <= row["circle_square"]["max"]
        assert -1 <= row["circle_square"]["least_query_cosine"] <= 1
        right = row["shifts"]["right_of right"]  # cell_moves: the two heaviest moves, most first
        assert len(right) == 2 and right[0][1] >= right[1][1] and right[0][0] == [0, 0]  # the stay bias still holds
    assert rows[0]["finds"] != rows[-1]["finds"]  # the model the probes read is the one being trained


@needs_shapes
def test_the_printed_trace_has_a_line_per_row_and_a_broken_row_is_named(tmp_path):
    row = {"step": 53, "epoch": 0, "finds": {"circle": 0.61, "square": 0.62, "triangle": 0.65},
           "circle_square": {"median": 7.49, "max": 12.9, "least_query_cosine": 0.31},
           "shifts": {"left_of left": [[[0, 0], 0.93], [[0, -1], 0.01]], "right_of right": [[[0, 0], 0.85], [[0, 1], 0.02]],
                      "left_of of": [[[0, 0], 0.85], [[0, 1], 0.07]], "right_of of": [[[0, 0], 0.85], [[0, 1], 0.07]]}}
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "step": 106}) + "\n")
    command = [sys.executable, str(REPO / "scripts" / "shapes_reader_trace.py"), str(path)]
    env = {**os.environ, "VLFUSE_SHAPES_DIR": str(SHAPES_DIR)}
    lines = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout.splitlines()
    assert len(lines) == 4 and lines[1].split()[:3] == ["step", "epoch", "circle"]  # two header lines, a line a row
    assert lines[2].split()[:8] == ["53", "0", "0.61", "0.62", "0.65", "7.5", "12.9", "0.31"]
    assert "(0, -1) 0.01" in lines[2] and lines[3].split()[0] == "106"
    path.write_text(json.dumps(row) + "\n{not json\n")
    broken = subprocess.run(command, capture_output=True, text=True, env=env)
    assert broken.returncode != 0 and f"{path}:2: not a trace row" in broken.stderr


def test_the_trace_refuses_a_model_without_a_cell_reader_and_bad_arguments():
    class Module:
        model = VLFuseModel.from_config(tiny_config(), ["no", "yes"], ["is it red"])

    with pytest.raises(ValueError, match="cell_steps or cell_moves.*'fusion_stack'"):
        trace.ReaderTrace().on_fit_start(None, Module())
    with pytest.raises(ValueError, match="every_n_steps must be at least 1, got 0"):
        trace.ReaderTrace(every_n_steps=0)

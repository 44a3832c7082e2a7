"""scripts/head_count_study.py: commands, result collection, resuming, tables; one tiny real run."""

import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vlfuse.analysis.data import build_datamodule, load_batches
from vlfuse.analysis.head_scores import evaluate
from vlfuse.model import VLFuseModel

from conftest import REPO, load_script, tiny_cli_args

SCRIPT = REPO / "scripts" / "head_count_study.py"
CONFIG = REPO / "configs" / "easy_vqa.yaml"


study = load_script("head_count_study")


def option(command, name):
    return next(a.split("=", 1)[1] for a in reversed(command) if a.startswith(f"--{name}="))


def test_dry_run_prints_one_command_per_setting_and_seed(capsys):
    argv = ["--config", str(CONFIG), "--heads", "1", "4", "--seeds", "0", "1", "--epochs", "2", "--dry-run"]
    assert study.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    assert sum("--model.architecture.fuser.heads=4" in line for line in lines) == 2
    assert all("--trainer.max_epochs=2" in line and "vlfuse.cli fit" in line for line in lines)


@pytest.mark.parametrize(
    "study_name, expected",
    [
        ("dropout", ["fuser.attn_dropout=0.0", "fuser.attn_dropout=0.1", "fuser.attn_dropout=0.3", "fuser.attn_dropout=0.5"]),
        ("diversity", ["fuser.diversity_weight=0.0", "fuser.diversity_weight=0.1"]),
        ("normalizer", ["fuser.normalizer=softmax", "fuser.normalizer=leaky_relu"]),
    ],
)
def test_option_studies_vary_their_option(study_name, expected):
    args, _ = study.parse_args(["--config", str(CONFIG), "--study", study_name])
    overrides = [s.overrides[0] for s in study.study_settings(args)]
    assert overrides == [f"--model.architecture.{e}" for e in expected]


class FakeFit:
    """Stands in for `vlfuse fit`: writes a metrics.csv whose accuracy depends on heads and seed."""

    def __init__(self, fail_heads=()):
        self.calls, self.fail_heads = [], set(fail_heads)

    def __call__(self, command, **kwargs):
        self.calls.append(command)
        heads, seed = int(option(command, "model.architecture.fuser.heads")), int(option(command, "seed_everything"))
        if heads in self.fail_heads:
            return SimpleNamespace(returncode=1)
        run_dir = Path(option(command, "trainer.default_root_dir"))
        rows = [
            {"epoch": 0, "val/acc": 0.5, "test/acc": ""},
            {"epoch": 1, "val/acc": 0.6 + heads / 100 + seed / 1000, "test/acc": ""},
            {"epoch": 1, "val/acc": 0.55, "test/acc": ""},  # worse last epoch: the best is kept
            {"epoch": 1, "val/acc": "", "test/acc": 0.7 + heads / 100 + seed / 1000},
        ]
        with (run_dir / "metrics.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, ["epoch", "val/acc", "test/acc"])
            writer.writeheader()
            writer.writerows(rows)
        return SimpleNamespace(returncode=0)


def test_results_are_collected_summarised_and_resumed(tmp_path, monkeypatch, capsys):
    fake = FakeFit()
    monkeypatch.setattr(study.subprocess, "run", fake)
    argv = ["--config", str(CONFIG), "--heads", "2", "8", "--seeds", "0", "1", "2", "--out", str(tmp_path)]
    assert study.main(argv) == 0
    assert len(fake.calls) == 6
    result = json.loads((tmp_path / "heads_8" / "seed1" / "result.json").read_text())
    assert result["val_acc_best"] == pytest.approx(0.681) and result["test_acc"] == pytest.approx(0.781)
    table = (tmp_path / "summary.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| heads=8 |"))
    assert re.search(r"\| 3 \| 78\.1 ± 0\.1 \| 68\.1 ± 0\.1 \|", row), row
    assert (tmp_path / "summary.png").stat().st_size > 0
    assert len((tmp_path / "runs.csv").read_text().splitlines()) == 7
    capsys.readouterr()
    # A second invocation trains nothing: every run has its result.json.
    assert study.main(argv) == 0
    assert len(fake.calls) == 6
    assert capsys.readouterr().out.count("skip") == 6


def test_failed_runs_are_reported_and_retried(tmp_path, monkeypatch):
    monkeypatch.setattr(study.subprocess, "run", FakeFit(fail_heads={4}))
    argv = ["--config", str(CONFIG), "--heads", "1", "4", "--seeds", "0", "--out", str(tmp_path)]
    assert study.main(argv) == 1
    assert not (tmp_path / "heads_4" / "seed0" / "result.json").exists()
    fake = FakeFit()
    monkeypatch.setattr(study.subprocess, "run", fake)
    assert study.main(argv) == 0
    assert len(fake.calls) == 1  # only the failed run again


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        study.parse_args(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(SystemExit):
        study.parse_args(["--config", str(CONFIG), "--epochs", "0"])


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    """One real tiny run: 1 head count x 1 seed, 1 epoch on 8 images; and the seconds the study took."""
    out = tmp_path_factory.mktemp("study")
    extra = [*tiny_cli_args(out / "unused"), "--test_after_fit=false"]
    command = [sys.executable, str(SCRIPT), "--config", str(CONFIG), "--heads", "2", "--seeds", "0", "--epochs", "1",
               "--out", str(out), "--", *extra]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, extra, elapsed


def test_a_tiny_real_run_records_the_val_accuracy_of_its_model_and_a_table(tiny_study):
    out, extra, elapsed = tiny_study
    result = json.loads((out / "heads_2" / "seed0" / "result.json").read_text())
    # One epoch: the best val/acc is the exported model's accuracy on the val split, measured again here.
    model = VLFuseModel.from_pretrained(out / "heads_2" / "seed0" / "model")
    assert (model.num_fusion_layers, model.num_heads_built) == (1, 2)  # the study's heads, the tiny run's one block
    datamodule = build_datamodule(CONFIG, [a for a in extra if a.startswith("--data.")])
    assert result["val_acc_best"] == pytest.approx(evaluate(model, load_batches(datamodule, model, "val")), abs=1e-6)
    assert result["test_acc"] is None  # --test_after_fit=false
    assert 0 < result["wall_s"] <= elapsed  # the fit command ran inside the study
    assert "| heads=2 | 1 |" in (out / "summary.md").read_text()


def save_with_heads_edited(model_dir: Path, out: Path, *, sharpen=(), flatten=(), silence=()) -> Path:
    """A copy of a saved model whose cross-attention heads (positions) are edited in every layer:
    ``sharpen`` scales the head's query rows 100x (peaked attention), ``flatten`` zeroes them (uniform
    attention: scores all 0), ``silence`` zeroes its columns of the output projection (no contribution)."""
    model = VLFuseModel.from_pretrained(model_dir)
    with torch.no_grad():
        for block in model.fuser.stack.blocks:
            attn = block.cross_attn
            for heads, scale in ((sharpen, 100.0), (flatten, 0.0)):
                for head in heads:
                    rows = slice(head * attn.head_dim, (head + 1) * attn.head_dim)
                    attn.q_proj.weight[rows] *= scale
                    attn.q_proj.bias[rows] *= scale
            for head in silence:
                attn.out_proj.weight[:, head * attn.head_dim : (head + 1) * attn.head_dim] = 0.0
    return model.save_pretrained(out)


@pytest.mark.parametrize(
    "edits, dead",
    [
        (dict(sharpen=[0, 1]), 0),
        (dict(sharpen=[0], silence=[1]), 1),  # dead by its contribution
        (dict(flatten=[0, 1]), 2),  # dead by their entropy
    ],
    ids=["both-peaked", "one-silent", "both-uniform"],
)
def test_dead_heads_of_a_real_run_are_the_uniform_and_the_silent_ones(tiny_study, tmp_path, edits, dead):
    out, extra, _ = tiny_study
    model_dir = save_with_heads_edited(out / "heads_2" / "seed0" / "model", tmp_path / "edited", **edits)
    assert study.count_dead_heads(model_dir, CONFIG, extra, max_batches=2) == dead  # one fusion layer of 2 heads

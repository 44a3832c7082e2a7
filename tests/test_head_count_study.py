"""scripts/head_count_study.py: commands, result collection, resuming, tables; one tiny real run."""

import csv
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, tiny_cli_args

SCRIPT = REPO / "scripts" / "head_count_study.py"
CONFIG = REPO / "configs" / "easy_vqa.yaml"


def load_script():
    spec = importlib.util.spec_from_file_location("head_count_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


study = load_script()


def option(command, name):
    return next(a.split("=", 1)[1] for a in reversed(command) if a.startswith(f"--{name}="))


def test_dry_run_prints_one_command_per_setting_and_seed(capsys):
    argv = ["--config", str(CONFIG), "--heads", "1", "4", "--seeds", "0", "1", "--epochs", "2", "--dry-run"]
    assert study.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    assert sum("--model.architecture.fusion_heads=4" in line for line in lines) == 2
    assert all("--trainer.max_epochs=2" in line and "vlfuse.cli fit" in line for line in lines)


@pytest.mark.parametrize(
    "study_name, expected",
    [
        ("dropout", ["attn_dropout=0.0", "attn_dropout=0.1", "attn_dropout=0.3", "attn_dropout=0.5"]),
        ("diversity", ["diversity_weight=0.0", "diversity_weight=0.1"]),
        ("normalizer", ["attention_normalizer=softmax", "attention_normalizer=leaky_relu"]),
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
        heads, seed = int(option(command, "model.architecture.fusion_heads")), int(option(command, "seed_everything"))
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
    """One real tiny run: 1 head count x 1 seed, 1 epoch on 8 images."""
    out = tmp_path_factory.mktemp("study")
    extra = [*tiny_cli_args(out / "unused"), "--test_after_fit=false"]
    command = [sys.executable, str(SCRIPT), "--config", str(CONFIG), "--heads", "2", "--seeds", "0", "--epochs", "1",
               "--out", str(out), "--", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, extra


def test_a_tiny_real_run_gives_a_result_and_a_table(tiny_study):
    out, _ = tiny_study
    result = json.loads((out / "heads_2" / "seed0" / "result.json").read_text())
    assert 0 <= result["val_acc_best"] <= 1 and result["test_acc"] is None and result["wall_s"] > 0
    assert (out / "heads_2" / "seed0" / "model" / "model.safetensors").exists()
    assert "| heads=2 | 1 |" in (out / "summary.md").read_text()


def test_dead_heads_of_a_real_run(tiny_study):
    pytest.importorskip("vlfuse.analysis.head_roles")
    out, extra = tiny_study
    dead = study.count_dead_heads(out / "heads_2" / "seed0" / "model", CONFIG, extra, max_batches=2)
    assert 0 <= dead <= 2  # one fusion layer of 2 heads

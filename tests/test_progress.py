"""Progress that a log file keeps (issue 37): one line per epoch on standard error when it is not a
terminal (:class:`vlfuse.callbacks.EpochSummary`, installed by ``vlfuse fit``), and the training
curves of a run folder (``vlfuse plot RUN``, :mod:`vlfuse.curves`)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from vlfuse.callbacks import EpochSummary, epoch_line, format_duration
from vlfuse.cli import main
from vlfuse.curves import run_history

from conftest import REPO, tiny_cli_args

EPOCH = re.compile(r"vlfuse: epoch (\d+)/(\d+): train loss [\d.]+, train acc [\d.]+, val acc ([\d.]+) \(best ([\d.]+)\), ")


# ------------------------------------------------------------------------------ the epoch line
@pytest.mark.parametrize(
    "seconds, text",
    [(0.4, "0 s"), (41.2, "41 s"), (59.6, "1 min 0 s"), (290, "4 min 50 s"), (3600, "1 h 00 min"), (7530, "2 h 05 min")],
)
def test_durations_read_as_a_person_says_them(seconds, text):
    assert format_duration(seconds) == text


def test_the_line_shows_the_epochs_metrics_the_best_and_the_time_left():
    metrics = {"train/loss_epoch": 0.4123, "train/acc": 0.8712, "val/acc": 0.9021, "val/loss": 0.3, "val/questions": 92.0}
    line = epoch_line(3, 10, metrics, {"val/acc": 0.9021}, seconds=41.3, left=290.0)
    assert line == (
        "vlfuse: epoch 3/10: train loss 0.412, train acc 0.871, val acc 0.902 (best 0.902), 41 s, about 4 min 50 s left"
    )


def test_the_last_epochs_line_has_no_time_left_and_a_caption_model_shows_its_scores():
    metrics = {"train/loss_epoch": 2.5, "val/bleu4": 0.41, "val/cider": 3.2104, "val/loss": 2.0}
    line = epoch_line(2, 2, metrics, {"val/cider": 3.5}, seconds=7.0, left=0.0)
    assert line == "vlfuse: epoch 2/2: train loss 2.500, val BLEU-4 0.410, val CIDEr-D 3.210 (best 3.500), 7 s"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def fake_trainer(epoch: int, metrics: dict[str, float], *, progress_bar: bool = False, max_steps: int = -1) -> SimpleNamespace:
    """The trainer state that :class:`EpochSummary` reads, at the end of epoch ``epoch`` (from 0) of 10,
    of 100 steps each."""
    return SimpleNamespace(
        callback_metrics={name: torch.tensor(value) for name, value in metrics.items()}, current_epoch=epoch,
        max_epochs=10, is_global_zero=True, sanity_checking=False, progress_bar_callback=object() if progress_bar else None,
        max_steps=max_steps, num_training_batches=100, accumulate_grad_batches=1, global_step=100 * (epoch + 1),
    )


def run_epochs(summary: EpochSummary, accuracies: list[float], **trainer_options) -> None:
    """Epochs 0, 1, ... of a fake fit whose validation accuracies are ``accuracies``."""
    summary.on_train_start(fake_trainer(0, {}), None)
    for epoch, accuracy in enumerate(accuracies):
        trainer = fake_trainer(epoch, {"train/loss_epoch": 1.0, "train/acc": 0.5, "val/acc": accuracy}, **trainer_options)
        summary.on_train_epoch_start(trainer, None)
        summary.on_validation_epoch_end(trainer, None)
        summary.on_train_epoch_end(trainer, None)


def test_the_callback_keeps_the_best_accuracy_and_estimates_the_rest(capsys):
    run_epochs(EpochSummary(), [0.5, 0.75, 0.625])
    lines = capsys.readouterr().err.splitlines()
    assert [EPOCH.match(line).groups() for line in lines] == [
        ("1", "10", "0.500", "0.500"), ("2", "10", "0.750", "0.750"), ("3", "10", "0.625", "0.750"),
    ]
    assert all(line.endswith(" s left") for line in lines)  # 7 epochs to go at the pace so far


def test_the_time_left_ends_where_max_steps_ends_the_run(capsys):
    run_epochs(EpochSummary(), [0.5, 0.75, 0.625], max_steps=300)  # 3 epochs of 100 steps, not 10
    lines = capsys.readouterr().err.splitlines()
    assert [line.endswith(" s left") for line in lines] == [True, True, False]


def test_nothing_is_printed_under_a_progress_bar_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    run_epochs(EpochSummary(), [0.5], progress_bar=True)
    assert sys.stderr.getvalue() == ""
    run_epochs(EpochSummary(), [0.5], progress_bar=False)  # no bar: the lines are the only progress
    assert sys.stderr.getvalue().startswith("vlfuse: epoch 1/10: ")


def test_lines_can_be_turned_off_and_the_best_survives_a_checkpoint(capsys):
    summary = EpochSummary(lines=False)
    run_epochs(summary, [0.5, 0.75])
    assert capsys.readouterr().err == ""
    resumed = EpochSummary()
    resumed.load_state_dict(summary.state_dict())
    run_epochs(resumed, [0.625])
    assert EPOCH.match(capsys.readouterr().err).groups()[2:] == ("0.625", "0.750")


def test_an_epoch_without_validation_shows_no_stale_validation_score(capsys):
    summary = EpochSummary()
    trainer = fake_trainer(0, {"train/loss_epoch": 1.0, "val/acc": 0.5})
    summary.on_train_start(trainer, None)
    summary.on_train_epoch_start(trainer, None)
    summary.on_train_epoch_end(trainer, None)
    assert "val acc" not in capsys.readouterr().err


# ------------------------------------------------------------------------------ vlfuse fit, vlfuse plot
@pytest.fixture(scope="module")
def fitted(tmp_path_factory, one_thread) -> tuple[Path, str]:
    """The root of a tiny 2-epoch ``vlfuse fit`` logging to CSV in the run folder, and its standard error."""
    root = tmp_path_factory.mktemp("fit")
    capture = io.StringIO()
    stderr, sys.stderr = sys.stderr, capture
    try:
        code = main([
            "fit", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_cli_args(root),
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={root}",
            "--trainer.max_epochs=2", "--test_after_fit=false",
        ])  # fmt: skip
    finally:
        sys.stderr = stderr
    assert code == 0
    return root, capture.getvalue()


def test_fit_prints_one_line_per_epoch_with_the_val_accuracy(fitted):
    root, err = fitted
    lines = [line for line in err.splitlines() if line.startswith("vlfuse: epoch ")]
    assert [EPOCH.match(line).groups()[:2] for line in lines] == [("1", "2"), ("2", "2")]
    assert lines[0].endswith(" s left") and not lines[1].endswith(" left")


def test_fit_draws_the_curves_into_the_run_folder(fitted):
    root, _ = fitted
    with Image.open(root / "version_0" / "curves.png") as image:
        assert image.format == "PNG" and image.width > 600 and image.height > 300


def test_plot_writes_a_png_of_the_latest_run(fitted, tmp_path, capsys):
    root, _ = fitted
    assert main(["plot", str(root / "latest"), "--out", str(tmp_path / "curves.png")]) == 0
    assert capsys.readouterr().out == f"vlfuse: wrote the training curves to {tmp_path / 'curves.png'}\n"
    with Image.open(tmp_path / "curves.png") as image:
        assert image.format == "PNG" and image.width > 600 and image.height > 300
        assert image.size == Image.open(root / "version_0" / "curves.png").size  # loss and accuracy panels


def test_plot_loads_neither_torch_nor_lightning(fitted, tmp_path):
    root, _ = fitted
    code = (
        "import sys\nfrom vlfuse.cli import main\n"
        f"code = main(['plot', {str(root)!r}, '--out', {str(tmp_path / 'curves.png')!r}])\n"
        "print(code, [m for m in ('torch', 'lightning') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-1] == "0 []"  # a folder of runs: its latest run's curves


def test_plot_of_a_folder_without_metrics_csv_is_one_line_naming_what_it_looked_for(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vlfuse: error: no training log in {tmp_path}: looked for {tmp_path / 'metrics.csv'} and ")
    assert len(err.splitlines()) == 1


def test_a_continued_part_replaces_the_steps_a_killed_part_logged_after_its_checkpoint(tmp_path):
    (tmp_path / "resume_1").mkdir()
    (tmp_path / "metrics.csv").write_text("epoch,step,train/loss_step\n0,10,2.0\n0,20,1.5\n1,30,1.2\n1,40,1.")
    (tmp_path / "resume_1" / "metrics.csv").write_text("epoch,step,train/loss_step,val/acc\n1,30,1.1,\n1,39,,0.8\n")
    parts = [tmp_path / "metrics.csv", tmp_path / "resume_1" / "metrics.csv"]
    assert run_history(parts) == [
        {"epoch": 0, "step": 10, "train/loss_step": 2.0}, {"epoch": 0, "step": 20, "train/loss_step": 1.5},
        {"epoch": 1, "step": 30, "train/loss_step": 1.1}, {"epoch": 1, "step": 39, "val/acc": 0.8},
    ]

"""Runs kept apart and checkpoints written whole (issue 31).

- Run folders: two fits of one config in one root leave each other's files alone; ``--ckpt_path
  last`` continues the latest run in its folder, an explicit checkpoint its own run; evaluations log
  apart; DDP ranks share rank 0's folder (through the environment, or the job's id).
- Atomic checkpoints: a failed write leaves the old checkpoint, and a process killed at random
  moments while it saves leaves a whole checkpoint every time.

The fits train the easy-VQA config shrunk by ``tiny_overrides`` on 8 images for one epoch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vlfuse import checkpoint_io, runs
from vlfuse.checkpoint_io import AtomicCheckpointIO, temp_path
from vlfuse.commands.lightning import run_lightning, with_atomic_checkpoints

from conftest import REPO, tiny_overrides


def fit(root: Path, *extra: str):
    """A tiny ``vlfuse fit`` of configs/easy_vqa.yaml in ``root`` with the config's CSV logger and the
    default run folders; returns the CLI."""
    return run_lightning([
        "fit", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_overrides(),
        f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}",
        "--trainer.max_epochs=1", "--test_after_fit=false", *extra,
    ])  # fmt: skip


def digests(folder: Path) -> dict[str, str]:
    """The SHA-256 of every file under ``folder``, by relative path."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*")) if path.is_file()
    }  # fmt: skip


def load_last(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, one_thread) -> dict:
    """Two fits of one config in one root, the first as a job script starts it (``--ckpt_path last``
    before any run): the root, what each printed, the first run's files after each, where ``latest``
    pointed, the second fit's CLI."""
    root = tmp_path_factory.mktemp("two_runs")
    printed = io.StringIO()  # capsys is for one test
    with contextlib.redirect_stdout(printed):
        with pytest.warns(UserWarning, match="no last checkpoint available"):
            first = fit(root, "--ckpt_path=last")
        first_files = digests(root / "version_0")
        second = fit(root)
    return {
        "root": root,
        "printed": printed.getvalue(),
        "first": first,
        "second": second,
        "first_files": first_files,
        "first_files_after_second": digests(root / "version_0"),
        "latest": os.readlink(root / "latest"),
    }


def test_second_fit_gets_a_folder_of_its_own_and_leaves_the_first_runs_files_unchanged(two_runs):
    root = two_runs["root"]
    files = two_runs["first_files"]
    assert {"model/model.safetensors", "checkpoints/last.ckpt", "metrics.csv", "config.yaml"} <= set(files)
    assert any(name.startswith("checkpoints/epoch=") for name in files)
    assert two_runs["first_files_after_second"] == files
    assert two_runs["latest"] == "version_1"
    assert not (root / "checkpoints").exists() and not (root / "model").exists()
    assert not (root / "lightning_logs").exists()
    for cli, version in ((two_runs["first"], 0), (two_runs["second"], 1)):
        run = root / f"version_{version}"
        assert cli.trainer.checkpoint_callback.dirpath == str(run / "checkpoints")
        assert cli.trainer.logger.log_dir == str(run)
        assert (run / "model" / "model.safetensors").is_file()


def test_each_fit_prints_its_run_folder(two_runs):
    root = two_runs["root"]
    printed = [line for line in two_runs["printed"].splitlines() if line.startswith("vlfuse: run folder")]
    assert printed == [f"vlfuse: run folder {root / 'version_0'}", f"vlfuse: run folder {root / 'version_1'}"]


def test_ckpt_path_last_continues_the_latest_run_and_an_explicit_checkpoint_its_own_run(two_runs, one_thread):
    root = two_runs["root"]
    first, second = root / "version_0", root / "version_1"
    second_log = (second / "metrics.csv").read_bytes()
    newer = time.time() + 60  # the first run's last.ckpt is the newest of the root's: it must not matter
    os.utime(first / "checkpoints" / "last.ckpt", (newer, newer))

    fit(root, "--ckpt_path=last", "--trainer.max_epochs=2")
    assert sorted(path.name for path in root.iterdir()) == ["latest", "version_0", "version_1"]
    assert load_last(second)["epoch"] == 2 - 1 and load_last(second)["global_step"] == 4
    assert digests(first) == two_runs["first_files"]
    assert (second / "metrics.csv").read_bytes() == second_log  # the first part's log, kept
    assert {int(row.split(",")[0]) for row in (second / "resume_1" / "metrics.csv").read_text().splitlines()[1:]} == {1}
    assert not list(second.glob("checkpoints/last-v*.ckpt"))

    fit(root, f"--ckpt_path={first / 'checkpoints' / 'last.ckpt'}", "--trainer.max_epochs=2")
    assert load_last(first)["global_step"] == 4
    assert (first / "resume_1" / "metrics.csv").is_file()
    assert os.readlink(root / "latest") == "version_0"
    assert sorted(path.name for path in root.iterdir()) == ["latest", "version_0", "version_1"]


def test_test_with_ckpt_path_best_evaluates_the_latest_runs_best_checkpoint_and_logs_apart(two_runs, one_thread):
    root = two_runs["root"]
    latest = runs.latest_run(root)
    before = digests(latest)
    cli = run_lightning([
        "test", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_overrides(),
        f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}", "--ckpt_path=best",
    ])  # fmt: skip
    assert Path(cli.trainer.ckpt_path).parent == latest / "checkpoints"
    assert Path(cli.trainer.ckpt_path).name.startswith("epoch=")
    assert cli.trainer.logger.log_dir == str(root / "test" / "version_0")
    assert (root / "test" / "version_0" / "metrics.csv").is_file()
    assert digests(latest) == before


def test_a_fast_dev_run_keeps_to_its_own_root(tmp_path, one_thread):
    fit(tmp_path, "--trainer.fast_dev_run=true")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fast_dev_run"]
    assert (tmp_path / "fast_dev_run" / "latest" / "model" / "config.json").is_file()


# ------------------------------------------------------------------------- choosing and claiming
def test_processes_claiming_at_once_get_distinct_folders(tmp_path):
    (tmp_path / "version_7").mkdir()
    claimed: list[Path] = []
    threads = [threading.Thread(target=lambda: claimed.append(runs.claim(tmp_path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(path.name for path in claimed) == sorted(f"version_{n}" for n in range(8, 16))


def test_a_rank_that_lightning_started_uses_the_folders_rank_0_passed_down(tmp_path, monkeypatch):
    monkeypatch.delenv(runs.RUN_DIR_ENV, raising=False)
    leader = runs.choose("fit", tmp_path, run_dir=None, ckpt_path=None)
    runs.share_with_other_ranks(leader)
    try:
        child = runs.choose("fit", tmp_path, run_dir=None, ckpt_path=None)
    finally:
        runs.forget_shared()
    assert leader.leader and not child.leader
    assert child.folder == leader.folder.absolute() and child.log_dir == leader.log_dir.absolute()
    assert [path.name for path in tmp_path.iterdir()] == ["version_0"]
    assert runs.LOG_DIR_ENV not in os.environ


def test_externally_launched_ranks_share_the_jobs_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("RANK", "1")
    other = runs.choose("fit", tmp_path, run_dir=None, ckpt_path=None)
    assert (other.folder, other.leader) == (tmp_path / "job_abc", False)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())  # rank 0 creates it
    monkeypatch.setenv("RANK", "0")
    leader = runs.choose("fit", tmp_path, run_dir=None, ckpt_path=None)
    assert (leader.folder, leader.log_dir, leader.leader) == (tmp_path / "job_abc", tmp_path / "job_abc", True)
    assert (tmp_path / "job_abc").is_dir()


def test_externally_launched_ranks_without_a_job_id_need_a_run_dir(tmp_path, monkeypatch):
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "TORCHELASTIC_RUN_ID": "none"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ValueError, match="pass --run_dir DIR"):
        runs.choose("fit", tmp_path, run_dir=None, ckpt_path=None)
    named = runs.choose("fit", tmp_path, run_dir=str(tmp_path / "mine"), ckpt_path=None)
    assert named.folder == tmp_path / "mine" and named.folder.is_dir()


# ------------------------------------------------------------------------------ atomic checkpoints
def test_the_cli_writes_checkpoints_atomically_unless_given_a_checkpoint_io(two_runs):
    assert isinstance(two_runs["second"].trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    own = TorchCheckpointIO()
    assert with_atomic_checkpoints([own], "auto") == [own]
    assert [type(plugin) for plugin in with_atomic_checkpoints(None, "auto")] == [AtomicCheckpointIO]


def test_a_failure_in_the_middle_of_a_write_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"weights": torch.arange(1000.0)}, target)
    old = target.read_bytes()

    def write_part_then_fail(obj, file):
        file.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_io.torch, "save", write_part_then_fail)
    with pytest.raises(OSError, match="disk full"):
        AtomicCheckpointIO().save_checkpoint({"weights": torch.zeros(1000)}, target)
    assert target.read_bytes() == old
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]


def save_forever(target: str, first: int) -> None:
    """Save versions ``first``, ``first + 1``, ... of a 16 MB checkpoint to ``target`` until killed."""
    torch.set_num_threads(1)  # no OpenMP team in a forked process
    writer = AtomicCheckpointIO()
    for version in range(first, first + 10_000):
        writer.save_checkpoint({"version": version, "weights": torch.full((4_000_000,), float(version))}, target)


def test_a_process_killed_at_random_moments_leaves_a_whole_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    fork = multiprocessing.get_context("fork")
    rng = random.Random(0)
    version = 0
    for _ in range(20):
        process = fork.Process(target=save_forever, args=(str(target), version + 1))
        process.start()
        while not target.exists():
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        checkpoint = torch.load(target, weights_only=True)
        assert checkpoint["version"] >= version
        version = checkpoint["version"]
        assert torch.equal(checkpoint["weights"], torch.full((4_000_000,), float(version)))
    AtomicCheckpointIO().save_checkpoint({"version": version + 1}, target)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]  # the killed writers' files, removed
    assert not temp_path(target).exists()

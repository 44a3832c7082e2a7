"""The README's multi-device command, run as users run it: 2 CPU processes (gloo), Lightning's ddp.

Each run is the README's command line with size overrides only (widths, image count, epochs), in a
temporary working directory so that the config's ``runs/easy_vqa`` lands there, under a hard
timeout. ``vlfuse`` waits for the rank it started, so its exit status is that of both ranks.

The test split is cut to an odd number of images: the ranks get 5 and 4, and a sampler that
padded the shorter rank with a repeated image would change the number of questions scored.
"""

from __future__ import annotations

import csv
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vlfuse.analysis.data import build_datamodule, load_batches
from vlfuse.analysis.head_scores import evaluate
from vlfuse.cli import main
from vlfuse.data import IGNORE_INDEX
from vlfuse.commands.lightning import wait_for_other_ranks
from vlfuse.model import VLFuseModel
from vlfuse.runs import choose

from conftest import REPO, tiny_cli_args

CONFIG = REPO / "configs" / "easy_vqa.yaml"
IMAGES = 9  # per split; odd, so that the 2 ranks get unequal shares of the test split
DDP = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
SIZE_OPTIONS = ("--model.architecture.", "--data.init_args.limit_images", "--data.init_args.batch_size")
TIMEOUT_S = 300  # a hang fails the test instead of blocking the suite
SUMMARY = re.compile(r"^vlfuse: test accuracy (\d\.\d{4}) \((\d+) questions\)", re.MULTILINE)


def size_args(root: Path) -> list[str]:
    """conftest's tiny overrides, keeping only those that set sizes (the run keeps its logger,
    checkpoint and export paths)."""
    return [arg for arg in tiny_cli_args(root, limit_images=IMAGES) if arg.startswith(SIZE_OPTIONS)]


def run_vlfuse(cwd: Path, subcommand: str, *extra: str) -> subprocess.CompletedProcess:
    """``vlfuse SUBCOMMAND --config configs/easy_vqa.yaml --trainer.strategy ddp ...`` in ``cwd``;
    checks that both ranks started and that the command exited 0 without a traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "vlfuse.cli", subcommand, "--config", str(CONFIG), *DDP, *size_args(cwd), *extra]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in result.stderr
    assert "Traceback" not in result.stderr
    return result


def fit(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_vlfuse(cwd, "fit", "--trainer.max_epochs=1", *extra)


def printed_summaries(stdout: str) -> list[tuple[str, int]]:
    """Every ``vlfuse: test accuracy A (N questions)`` line, as (A, N)."""
    return [(accuracy, int(questions)) for accuracy, questions in SUMMARY.findall(stdout)]


def config_datamodule(*overrides: str):
    """The config's datamodule on the same images as the runs."""
    return build_datamodule(CONFIG, [f"--data.init_args.limit_images={IMAGES}", *overrides])


def one_process_evaluation(model_dir: Path, split: str) -> tuple[float, int]:
    """The saved model's accuracy on ``split``, and the questions scored, in this process without
    Lightning."""
    model = VLFuseModel.from_pretrained(model_dir)
    datamodule = config_datamodule()
    batches = load_batches(datamodule, model, split)
    questions = sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in batches)
    assert questions == sum(len(record.questions) for record in datamodule.records(split))
    return evaluate(model, batches), questions


def one_process_summary(model_dir: Path) -> tuple[str, int]:
    """What the summary line says of the test split when one process evaluates the saved model."""
    accuracy, questions = one_process_evaluation(model_dir, "test")
    return f"{accuracy:.4f}", questions


def logged_metric(cwd: Path, name: str) -> float:
    """The one value of ``name`` in the CSV log that the run in ``cwd`` wrote (a fit's in its run folder,
    a ``validate`` or ``test`` command's in ``runs/easy_vqa/<subcommand>/version_0``)."""
    [metrics_file] = (cwd / "runs" / "easy_vqa").rglob("metrics.csv")
    [value] = [row[name] for row in csv.DictReader(metrics_file.open()) if row.get(name)]
    return float(value)


def saved_models(root: Path) -> list[Path]:
    return sorted(weights.parent for weights in root.rglob("model.safetensors"))


def datamodule_of_rank(rank: int, world_size: int = 2):
    """The config's datamodule as a rank of a ``world_size``-process trainer sees it."""
    datamodule = config_datamodule("--data.init_args.image_size=32")
    datamodule.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world_size, "rank": rank})
    return datamodule


def test_distributed_evaluation_loaders_share_out_each_image_once():
    for split in ("val", "test"):
        shares = [list(getattr(datamodule_of_rank(rank), f"{split}_dataloader")().sampler) for rank in (0, 1)]
        assert sorted(shares[0] + shares[1]) == list(range(IMAGES)), split


def test_more_processes_than_evaluation_images_is_a_one_line_error():
    with pytest.raises(ValueError, match=f"the test split has {IMAGES} images, fewer than the 10 processes"):
        datamodule_of_rank(0, world_size=10).test_dataloader()


def test_vlfuse_exit_status_is_that_of_a_failed_rank_it_started():
    ranks = [subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"]) for code in (0, 3)]
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=ranks)))
    assert wait_for_other_ranks(trainer) == 3


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's command with ``test_after_fit`` at the config's default (true)."""
    cwd = tmp_path_factory.mktemp("ddp_fit")
    return cwd, fit(cwd)


def test_readme_ddp_fit_tests_once_and_exports_one_model_that_predict_loads(fitted, capsys):
    cwd, result = fitted
    assert len(printed_summaries(result.stdout)) == 1, result.stdout
    assert result.stdout.count("vlfuse: test accuracy") == 1
    model_dir = cwd / "runs" / "easy_vqa" / "version_0" / "model"  # rank 0's run folder, the only one
    assert saved_models(cwd) == [model_dir]
    assert sorted(path.name for path in (cwd / "runs" / "easy_vqa").iterdir()) == ["latest", "version_0"]
    assert "vlfuse: run folder runs/easy_vqa/version_0\n" in result.stdout
    assert "; model saved to runs/easy_vqa/version_0/model" in result.stdout
    record = config_datamodule().records("test")[0]
    question = ["--image", str(record.image), "--question", record.questions[0]]
    assert main(["predict", "--model", str(model_dir), *question]) == 0
    assert capsys.readouterr().out.startswith("answer: ")


def test_ddp_epoch_metrics_are_synchronised_and_evaluation_repeats_no_image(fitted):
    _, result = fitted
    assert "sync_dist=True" not in result.stderr  # Lightning's warning about an unsynchronised epoch metric
    assert "Using `DistributedSampler` with the dataloaders" not in result.stderr  # its padding sampler


def test_two_process_test_accuracy_equals_the_one_process_evaluation_of_the_exported_model(fitted):
    cwd, result = fitted
    model_dir = cwd / "runs" / "easy_vqa" / "latest" / "model"
    assert printed_summaries(result.stdout) == [one_process_summary(model_dir)]
    # The printed line has 4 decimals; the CSV log has the whole value.
    accuracy, questions = one_process_evaluation(model_dir, "test")
    assert logged_metric(cwd, "test/acc") == pytest.approx(accuracy, abs=1e-6)
    assert logged_metric(cwd, "test/questions") == questions


def test_readme_ddp_fit_without_test_after_fit_exits_0_and_exports_the_model(tmp_path):
    result = fit(tmp_path, "--test_after_fit", "false")
    assert "vlfuse: test accuracy" not in result.stdout
    assert saved_models(tmp_path) == [tmp_path / "runs" / "easy_vqa" / "version_0" / "model"]
    VLFuseModel.from_pretrained(tmp_path / "runs" / "easy_vqa" / "latest" / "model")


def test_ddp_test_of_a_saved_model_prints_the_one_process_accuracy(fitted, tmp_path):
    model_dir = fitted[0] / "runs" / "easy_vqa" / "latest" / "model"
    result = run_vlfuse(tmp_path, "test", "--model.pretrained", str(model_dir))
    assert printed_summaries(result.stdout) == [one_process_summary(model_dir)]


@pytest.mark.slow
def test_ddp_validate_of_a_saved_model_logs_the_one_process_accuracy(fitted, tmp_path):
    model_dir = fitted[0] / "runs" / "easy_vqa" / "latest" / "model"
    run_vlfuse(tmp_path, "validate", "--model.pretrained", str(model_dir))
    accuracy, questions = one_process_evaluation(model_dir, "val")
    assert logged_metric(tmp_path, "val/acc") == pytest.approx(accuracy, abs=1e-6)
    assert logged_metric(tmp_path, "val/questions") == questions


def node_command(cwd: Path, *extra: str) -> list[str]:
    """The README's multi-node command for one node of two, one process on each (CPU, gloo)."""
    nodes = ["--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "2"]
    return [sys.executable, "-m", "vlfuse.cli", "fit", "--config", str(CONFIG), *nodes, *size_args(cwd), "--trainer.max_epochs=1", *extra]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_nodes_launched_one_per_node_train_into_one_run_folder_and_test_once(tmp_path):
    """Two simulated nodes on this machine, each launched as a cluster launches one: its NODE_RANK,
    the first node's address and port, and the world size in the environment; the same command and
    --run_dir on both."""
    cluster = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    command = node_command(tmp_path, "--run_dir", "runs/easy_vqa/two_nodes")
    nodes = [
        subprocess.Popen(command, cwd=tmp_path, env={**os.environ, **cluster, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=TIMEOUT_S) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
        assert "Traceback" not in stderr
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1][1]
    model_dir = tmp_path / "runs" / "easy_vqa" / "two_nodes" / "model"
    assert saved_models(tmp_path) == [model_dir]  # written once, by the first node
    assert sorted(path.name for path in (tmp_path / "runs" / "easy_vqa").iterdir()) == ["latest", "two_nodes"]
    # the test split scored once over both nodes, each image by one of them, as one process scores it
    assert printed_summaries(outputs[0][0]) == [one_process_summary(model_dir)]
    assert printed_summaries(outputs[1][0]) == []


def test_nodes_launched_one_per_node_without_a_shared_run_dir_stop_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for node in ("0", "1"):
        monkeypatch.setenv("NODE_RANK", node)
        with pytest.raises(ValueError, match="once per node .* pass --run_dir DIR, the same in every process"):
            choose("fit", tmp_path / "runs", run_dir=None, ckpt_path=None)
    monkeypatch.setenv("NODE_RANK", "1")
    follower = choose("fit", tmp_path / "runs", run_dir=str(tmp_path / "shared"), ckpt_path=None)
    assert (follower.folder, follower.leader) == (tmp_path / "shared", False)
    monkeypatch.setenv("WORLD_SIZE", "1")  # NODE_RANK alone (set on some single machines) is one run of its own
    assert choose("fit", tmp_path / "runs", run_dir=None, ckpt_path=None).folder == tmp_path / "runs" / "version_0"

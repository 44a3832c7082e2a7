"""A resumed run ends where the uninterrupted one does: from an epoch-end checkpoint, from a step
checkpoint after SIGKILL mid-epoch, and from the checkpoint SIGTERM writes.

Every run trains the easy-VQA config shrunk by ``tiny_cli_args`` (dropout 0.1 stays on, so the
random generators matter) on 24 images, 6 batches an epoch, for 3 epochs, on one thread.
"""

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import Dataset, SequentialSampler

from vlfuse.cli import main
from vlfuse.data.resumable import EpochShuffleSampler, ResumableDataLoader
from vlfuse.resume import SIGTERM_EXIT_CODE

from conftest import REPO, tiny_cli_args

IMAGES = 24  # 6 batches of 4 images an epoch
EPOCHS = 3


class SignalAtStep(Callback):
    """Test helper: the training process sends itself ``signum`` once ``step`` optimizer steps are done."""

    def __init__(self, signum: int, step: int) -> None:
        self.signum = signum
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def fit_args(root: Path, *extra: str, checkpoint_dir: bool = True) -> list[str]:
    """``vlfuse fit`` arguments of the tiny run in ``root``, logging per-epoch losses to CSV.

    ``checkpoint_dir=False`` leaves ``--checkpoint.dirpath`` out: checkpoints go to the default folder.
    """
    tiny = [a for a in tiny_cli_args(root, IMAGES) if checkpoint_dir or not a.startswith("--checkpoint.dirpath")]
    return [
        "fit",
        "--config",
        str(REPO / "configs" / "easy_vqa.yaml"),
        *tiny,
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={root}",
        f"--trainer.max_epochs={EPOCHS}",
        "--test_after_fit=false",
        *extra,
    ]


def fit_in_subprocess(args: list[str], *, signum: int, step: int) -> subprocess.CompletedProcess:
    """Run ``vlfuse fit`` in a process of its own (one thread) that sends itself ``signum`` at ``step``."""
    callback = f'[{{"class_path": "test_resume.SignalAtStep", "init_args": {{"signum": {signum}, "step": {step}}}}}]'
    tests = str(Path(__file__).parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), tests]))
    command = [sys.executable, "-m", "vlfuse.cli", *args, f"--trainer.callbacks={callback}"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def epoch_metrics(root: Path) -> dict[int, dict[str, float]]:
    """Per epoch: the logged step and the epoch's training and validation losses, from every CSV log in
    ``root`` (each run folder's ``metrics.csv``, then its resumed parts', ``resume_K/metrics.csv``)."""
    metrics: dict[int, dict[str, float]] = {}
    for log in sorted(root.rglob("metrics.csv")):
        for row in csv.DictReader(log.open()):
            epoch = metrics.setdefault(int(row["epoch"]), {})
            epoch["step"] = int(row["step"])
            for name in ("train/loss_epoch", "val/loss"):
                if row[name]:
                    epoch[name] = float(row[name])
    return metrics


def last_checkpoint(checkpoints: Path) -> dict:
    return torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)


def assert_same_weights(checkpoints: Path, reference: Path) -> None:
    """The final weights (``last.ckpt`` in the folders ``checkpoints`` and ``reference`` of the finished
    runs) are bit-identical."""
    ours, theirs = last_checkpoint(checkpoints), last_checkpoint(reference)
    assert ours["global_step"] == theirs["global_step"] == EPOCHS * IMAGES // 4
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for name, weight in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][name], weight), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, one_thread) -> Path:
    """The reference run, keeping every epoch's checkpoint."""
    root = tmp_path_factory.mktemp("uninterrupted")
    assert main(fit_args(root, "--checkpoint.save_top_k=-1")) == 0
    return root


# ---------------------------------------------------------------------------------- the data order
class Numbers(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def test_training_order_is_a_function_of_seed_and_epoch():
    orders = {}
    for epoch in (0, 1):
        for attempt in range(2):
            sampler = EpochShuffleSampler(Numbers(20), seed=3)
            sampler.set_epoch(epoch)
            orders[epoch, attempt] = list(sampler)
    assert orders[0, 0] == orders[0, 1] and orders[1, 0] == orders[1, 1]
    assert orders[0, 0] != orders[1, 0]
    assert sorted(orders[0, 0]) == list(range(20))


def test_ranks_share_an_epoch_without_overlap():
    shares = []
    for rank in (0, 1):
        sampler = EpochShuffleSampler(Numbers(20), seed=3, num_replicas=2, rank=rank)
        sampler.set_epoch(4)
        shares.append(list(sampler))
    assert len(shares[0]) == len(shares[1]) == 10
    assert sorted(shares[0] + shares[1]) == list(range(20))


def _loader(seed: int = 5, num_workers: int = 0) -> ResumableDataLoader:
    dataset = Numbers(14)
    sampler = EpochShuffleSampler(dataset, seed=seed)
    return ResumableDataLoader(
        dataset, sampler, batch_size=4, num_workers=num_workers, persistent_workers=num_workers > 0
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restored_loader_hands_out_the_rest_of_the_epoch(num_workers):
    first = _loader(num_workers=num_workers)
    first.sampler.set_epoch(2)
    whole_epoch = [batch.tolist() for batch in first]
    batches = iter(first)
    for _ in range(2):
        next(batches)
    state = first.state_dict()
    assert state == {"seed": 5, "epoch": 2, "batches": 2}

    restored = _loader(seed=99, num_workers=num_workers)  # the seed comes back from the state too
    restored.load_state_dict(state)
    assert [batch.tolist() for batch in restored] == whole_epoch[2:]
    assert len(restored) == 4  # Lightning counts the epoch's batches from its own progress
    restored.sampler.set_epoch(3)
    assert len([batch for batch in restored]) == 4  # the skip applied to epoch 2 only


def test_state_saved_at_the_end_of_an_epoch_starts_the_next_epoch_at_its_beginning():
    finished = _loader()
    finished.sampler.set_epoch(0)
    list(finished)
    restored = _loader()
    restored.load_state_dict(finished.state_dict())
    restored.sampler.set_epoch(1)
    reference = _loader()
    reference.sampler.set_epoch(1)
    assert [b.tolist() for b in restored] == [b.tolist() for b in reference]


def test_loader_whose_sampler_lightning_replaced_iterates_in_that_samplers_order():
    # Lightning's overfit_batches rebuilds the loader with a SequentialSampler.
    replaced = _update_dataloader(_loader(), SequentialSampler(Numbers(14)))
    assert [b.tolist() for b in replaced] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]
    assert replaced.state_dict() == {}


# ---------------------------------------------------------------------------------- whole runs
def test_resume_from_epoch_checkpoint_repeats_the_uninterrupted_losses_and_weights(uninterrupted, tmp_path, one_thread):
    checkpoint = uninterrupted / "checkpoints" / "epoch=0-step=6.ckpt"
    # Every epoch kept, as in the reference: last.ckpt then is the final epoch's, whether or not it was the best.
    assert main(fit_args(tmp_path, f"--ckpt_path={checkpoint}", "--checkpoint.save_top_k=-1")) == 0
    resumed, reference = epoch_metrics(tmp_path), epoch_metrics(uninterrupted)
    assert sorted(resumed) == [1, 2]
    for epoch in (1, 2):
        assert resumed[epoch]["step"] == reference[epoch]["step"]  # the loggers' step continues
        for name in ("train/loss_epoch", "val/loss"):
            assert resumed[epoch][name] == pytest.approx(reference[epoch][name], abs=1e-6), (epoch, name)
    assert_same_weights(tmp_path / "checkpoints", uninterrupted / "checkpoints")


def test_run_killed_mid_epoch_resumes_from_its_step_checkpoint_to_the_same_weights(uninterrupted, tmp_path, one_thread):
    args = fit_args(tmp_path, "--checkpoint.every_n_train_steps=3")
    killed = fit_in_subprocess(args, signum=signal.SIGKILL, step=11)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    stopped = last_checkpoint(tmp_path / "checkpoints")
    assert (stopped["global_step"], stopped["epoch"]) == (9, 1)  # half-way through the second epoch
    assert stopped["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"seed": 0, "epoch": 1, "batches": 3}]

    assert main([*args, "--ckpt_path=last"]) == 0
    assert_same_weights(tmp_path / "checkpoints", uninterrupted / "checkpoints")
    resumed, reference = epoch_metrics(tmp_path), epoch_metrics(uninterrupted)
    for epoch in (1, 2):
        assert resumed[epoch]["val/loss"] == pytest.approx(reference[epoch]["val/loss"], abs=1e-6), epoch


def test_sigterm_saves_last_checkpoint_from_which_ckpt_path_last_finishes_the_run(uninterrupted, tmp_path, one_thread):
    # No --checkpoint.dirpath: the run folder's, where --ckpt_path last finds it again.
    args = fit_args(tmp_path, checkpoint_dir=False)
    stopped = fit_in_subprocess(args, signum=signal.SIGTERM, step=10)
    assert stopped.returncode == SIGTERM_EXIT_CODE, stopped.stderr[-2000:]
    assert "stopped by SIGTERM at step 10" in stopped.stdout + stopped.stderr
    run = tmp_path / "version_0"
    assert last_checkpoint(run / "checkpoints")["global_step"] == 10

    assert main([*args, "--ckpt_path=last"]) == 0
    assert [path.name for path in tmp_path.glob("version_*")] == ["version_0"]  # the same run, continued
    assert_same_weights(run / "checkpoints", uninterrupted / "checkpoints")
    assert sorted(epoch_metrics(run)) == [0, 1, 2]

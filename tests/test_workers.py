"""DataLoader workers change nothing but speed: 0, 2 and 4 workers give the same batches in the same
order (also after a resume mid-epoch), and a run on one thread the same losses and weights; workers
keep no decoded images (they last one pass)."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from vlfuse.cli import main
from vlfuse.data.dataset import collate_grouped
from vlfuse.datamodules import EasyVQADataModule

from conftest import load_script
from test_resume import IMAGES, assert_same_weights, epoch_metrics, fit_args

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 workers on 2 cores, on purpose

WORKERS = (0, 2, 4)


def datamodule(num_workers: int) -> EasyVQADataModule:
    data = EasyVQADataModule(limit_images=IMAGES, batch_size=4, image_size=32, num_workers=num_workers, seed=5)
    data.setup("fit")
    return data


def epoch_batches(loader, epoch: int) -> list[dict]:
    loader.sampler.set_epoch(epoch)
    return list(loader)


def assert_same_batches(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        assert a["questions"] == b["questions"] and a["image_keys"] == b["image_keys"]
        assert (a["pixel_values"] is None) == (b["pixel_values"] is None)
        for key in ("pixel_values", "labels", "image_index"):
            if a[key] is not None:
                assert torch.equal(a[key], b[key]), key


def test_every_worker_count_gives_the_same_training_batches_in_the_same_order():
    reference = datamodule(0).train_dataloader()
    expected = {epoch: epoch_batches(reference, epoch) for epoch in (0, 1)}
    assert expected[0][0]["questions"] != expected[1][0]["questions"]  # a new order each epoch
    for workers in WORKERS[1:]:
        loader = datamodule(workers).train_dataloader()
        assert loader.num_workers == workers
        for epoch in (0, 1):
            assert_same_batches(epoch_batches(loader, epoch), expected[epoch])


def test_a_loader_with_workers_resumes_mid_epoch_at_the_next_batch():
    expected = epoch_batches(datamodule(0).train_dataloader(), 1)
    first = datamodule(2).train_dataloader()
    first.sampler.set_epoch(1)
    batches = iter(first)
    seen = [next(batches) for _ in range(2)]
    state = first.state_dict()
    resumed = datamodule(2).train_dataloader()
    resumed.load_state_dict(state)
    assert_same_batches(seen + list(resumed), expected)


def test_evaluation_batches_are_the_same_with_workers():
    expected = list(datamodule(0).val_dataloader())
    loader = datamodule(2).val_dataloader()
    for _ in range(2):
        assert_same_batches(list(loader), expected)


def test_workers_stop_decoding_once_every_image_is_cached():
    data = datamodule(2)
    loader = data.train_dataloader()
    dataset = loader.dataset
    assert all(batch["pixel_values"] is not None for batch in epoch_batches(loader, 0))
    dataset.decode_only_uncached(set(dataset.image_keys))  # what a frozen encoder's full cache does
    assert all(batch["pixel_values"] is None for batch in epoch_batches(loader, 1))  # the next epoch's workers see it


class Budgets(Dataset):
    """The decoded-image budget of whichever process reads each item."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return self.dataset.decoded_budget()


@pytest.mark.parametrize("workers", WORKERS)
def test_workers_keep_no_decoded_images_and_the_main_process_its_budget(workers):
    dataset = datamodule(0).dataset("train")
    budgets = {int(b) for b in DataLoader(Budgets(dataset), batch_size=1, num_workers=workers)}
    assert budgets == {0 if workers else dataset.keep_decoded_bytes}


def test_a_run_with_two_workers_trains_as_a_run_without_on_one_thread(tmp_path, one_thread):
    roots = {workers: tmp_path / f"workers_{workers}" for workers in (0, 2)}
    for workers, root in roots.items():
        assert main(fit_args(root, f"--data.init_args.num_workers={workers}")) == 0
    assert epoch_metrics(roots[2]) == epoch_metrics(roots[0])
    assert_same_weights(roots[2] / "checkpoints", roots[0] / "checkpoints")


def test_the_workers_benchmark_times_every_worker_count_on_photographs_it_writes(tmp_path, capsys):
    bench = load_script("bench_workers")
    bench.main(["--data", str(tmp_path / "photos"), "--images", "3", "--photo-size", "64", "48", "--image-size", "32",
                "--workers", "0", "2", "--repeats", "1", "--epochs", "2"])
    table = capsys.readouterr().out
    assert "3 JPEGs of 64x48 -> 32 px" in table
    assert [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| first") or line.startswith("| second")] == [
        [" first ", " 0 "], [" first ", " 2 "], [" second ", " 0 "], [" second ", " 2 "]
    ]
    assert len(list((tmp_path / "photos" / "train").glob("*.jpg"))) == 3

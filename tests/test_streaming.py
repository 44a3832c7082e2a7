"""Streaming shards (issue 34, item 2): ``vlfuse convert`` writes litdata chunks of a dataset and
``StreamingDataModule`` trains from them, answering the same questions as from the folder.

Every test reads one tiny imagefolder (easy-VQA test images: 16 training images, 4 validation, 4
test) converted once per module."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

from vlfuse.cli import main
from vlfuse.data.streaming import INDEX_NAME, ShardDecoder, open_split
from vlfuse.datamodules import ImageFolderDataModule, StreamingDataModule

from conftest import REPO, load_script, tiny_cli_args
from test_data_forms import easy_rows, write_images, write_table
from test_resume import fit_in_subprocess, last_checkpoint

SPLITS = {"train": range(0, 16), "validation": range(16, 20), "test": range(20, 24)}
SPLIT_DIRS = {"train": "train", "val": "validation", "test": "test"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagefolder")
    for split, images in SPLITS.items():
        write_table(root / split / "metadata.jsonl", write_images(root / split, easy_rows(images)))
    return root


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "easy"
    assert main(["convert", "--data-dir", str(folder), "--out", str(out)]) == 0
    return out


def digest_rows(images_and_records) -> Counter:
    """``(sha256 of the image bytes, question, answer)`` of every question, counted."""
    return Counter(
        (hashlib.sha256(data).hexdigest(), q, a)
        for data, record in images_and_records
        for q, a in zip(record.questions, record.answers)
    )


# ------------------------------------------------------------------------------------------ round trip
def test_shards_hold_the_folders_images_as_stored_and_its_questions(folder, shards):
    source = ImageFolderDataModule(data_dir=str(folder), image_size=32)
    for split in ("train", "val", "test"):
        decoder = ShardDecoder(source.data_vocab, 32, "bilinear", split)
        stream = open_split(str(shards), split, None)
        read = [decoder.record(stream[i]) for i in range(len(stream))]
        ours = digest_rows((data, record) for record, data, _ in read)
        theirs = digest_rows((Path(r.image).read_bytes(), r) for r in source.records(split))
        assert ours == theirs and sum(ours.values()) > len(read)
        assert [key for _, _, key in read] == [str(Path(r.image).absolute()) for r in source.records(split)]  # in order


def test_images_decode_as_from_their_files_and_the_index_keeps_vocabulary_and_questions(folder, shards):
    source = ImageFolderDataModule(data_dir=str(folder), image_size=32)
    data = StreamingDataModule(data_dir=str(shards), image_size=32)
    assert data.answers == source.answers
    assert Counter(data.train_questions) == Counter(source.train_questions)
    for interpolation in ("bilinear", "bicubic"):
        source.interpolation = data.interpolation = interpolation
        ours, theirs = data.dataset("val"), source.dataset("val")
        assert len(ours) == len(theirs) == 4
        for i in range(4):
            a, b = ours[i], theirs[i]
            assert torch.equal(a["pixel_values"], b["pixel_values"]), (interpolation, i)
            assert a["questions"] == b["questions"] and torch.equal(a["labels"], b["labels"])
            assert a["image_key"] == b["image_key"]


def test_shards_with_another_serializer_are_refused_without_reading_it(shards, tmp_path):
    forged = tmp_path / "forged"
    for path in shards.rglob("*"):
        if path.is_file():
            (forged / path.relative_to(shards)).parent.mkdir(parents=True, exist_ok=True)
            (forged / path.relative_to(shards)).write_bytes(path.read_bytes())
    index = json.loads((forged / "val" / "index.json").read_text())
    index["config"]["data_format"] = ["bytes", "pickle"]
    (forged / "val" / "index.json").write_text(json.dumps(index))
    data = StreamingDataModule(data_dir=str(forged), image_size=32)
    with pytest.raises(ValueError, match="'pickle' serializer; vlfuse shards hold only bytes, str fields"):
        data.dataset("val")[0]


def test_a_folder_that_is_not_a_shard_folder_is_named(folder):
    with pytest.raises(FileNotFoundError, match=f"{folder}/{INDEX_NAME} not found"):
        StreamingDataModule(data_dir=str(folder)).answers


# ------------------------------------------------------------------------------------------ order
def keys(loader) -> list[list[str]]:
    return [batch["image_keys"] for batch in loader]


def train_loader(shards: Path, seed: int = 0, batch_size: int = 3, **kwargs):
    data = StreamingDataModule(data_dir=str(shards), image_size=32, batch_size=batch_size, seed=seed, **kwargs)
    return data.train_dataloader()


def test_training_batches_come_in_an_order_fixed_by_the_seed_and_the_epoch(shards, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    loader = train_loader(shards)
    first, second = keys(loader), keys(loader)
    again = train_loader(shards)
    assert keys(again) == first and keys(again) == second  # the same two epochs
    assert first != second and keys(train_loader(shards, seed=1)) != first
    for epoch in (first, second):
        flat = [key for batch in epoch for key in batch]
        assert len(set(flat)) == len(flat) == 16  # every training image once an epoch
    batch = next(iter(train_loader(shards)))
    assert batch["pixel_values"].shape == (3, 3, 32, 32) and batch["image_index"].max() == 2
    assert len(batch["questions"]) == len(batch["labels"]) == len(batch["image_index"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_restored_mid_epoch_hands_out_the_rest_of_the_epoch(shards, monkeypatch, num_workers):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    whole = train_loader(shards, num_workers=num_workers)
    keys(whole)  # epoch 1
    epoch_two = keys(whole)
    interrupted = train_loader(shards, num_workers=num_workers)
    keys(interrupted)
    batches = iter(interrupted)
    seen = [next(batches)["image_keys"] for _ in range(2)]
    state = interrupted.state_dict()
    assert seen == epoch_two[:2]
    restored = train_loader(shards, num_workers=num_workers)
    restored.load_state_dict(state)
    assert keys(restored) == epoch_two[2:]


def test_two_ranks_share_the_training_split_and_each_evaluation_split_without_overlap(shards, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    shares = {}
    for batch_size in (4, 3):
        for rank in (0, 1):
            monkeypatch.setenv("WORLD_SIZE", "2")
            monkeypatch.setenv("GLOBAL_RANK", str(rank))
            shares[batch_size, rank] = [key for batch in keys(train_loader(shards, batch_size=batch_size)) for key in batch]
    assert len(shares[4, 0]) == len(shares[4, 1]) == 8
    assert len(set(shares[4, 0] + shares[4, 1])) == 16
    # litdata drops each rank's last incomplete batch under DDP: every rank steps as often as the others
    assert len(shares[3, 0]) == len(shares[3, 1]) == 6 and not set(shares[3, 0]) & set(shares[3, 1])
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("GLOBAL_RANK")
    data = StreamingDataModule(data_dir=str(shards), image_size=32)
    test = data.dataset("test")
    whole = [test[i]["image_key"] for i in range(len(test))]
    parts = [[test[i]["image_key"] for i in UnrepeatedDistributedSampler(test, num_replicas=2, rank=r, shuffle=False)] for r in (0, 1)]
    assert sorted(parts[0] + parts[1]) == sorted(whole) and not set(parts[0]) & set(parts[1])


def test_limit_images_keeps_the_first_images_of_each_split(shards, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    everything = StreamingDataModule(data_dir=str(shards), image_size=32).dataset("train")
    first = {everything[i]["image_key"] for i in range(5)}
    limited = train_loader(shards, limit_images=5)
    assert {key for batch in keys(limited) for key in batch} == first
    assert len(StreamingDataModule(data_dir=str(shards), image_size=32, limit_images=3).dataset("test")) == 3


def test_a_url_streams_through_a_cache_folder_as_the_local_folder_reads(shards, tmp_path, monkeypatch):
    """``local:`` is litdata's object store on a local folder: chunks are downloaded into the cache."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    remote = train_loader(f"local:{shards}", cache_dir=str(tmp_path / "cache"))
    assert keys(remote) == keys(train_loader(shards))
    assert (tmp_path / "cache" / INDEX_NAME).is_file()
    with pytest.raises(ValueError, match="give data.init_args.cache_dir"):
        StreamingDataModule(data_dir="s3://bucket/shards").answers


# ------------------------------------------------------------------------------------------ the commands
def test_convert_refuses_an_existing_folder_and_leaves_no_staging_behind(folder, shards, capsys):
    before = sorted(p.name for p in shards.parent.iterdir())
    assert main(["convert", "--data-dir", str(folder), "--out", str(shards)]) == 2
    assert f"--out {shards} exists" in capsys.readouterr().err
    assert sorted(p.name for p in shards.parent.iterdir()) == before == ["easy"]
    assert sorted(p.name for p in shards.iterdir()) == ["test", "train", "val", INDEX_NAME]


def test_convert_of_a_config_takes_its_data_overrides(folder, tmp_path):
    out = tmp_path / "two"
    config = str(REPO / "configs" / "imagefolder_vqa.yaml")
    assert main(["convert", "--config", config, f"--data.init_args.data_dir={folder}", "--data.init_args.limit_images=2", "--out", str(out)]) == 0
    index = json.loads((out / INDEX_NAME).read_text())
    assert {split: entry["images"] for split, entry in index["splits"].items()} == {"train": 2, "val": 2, "test": 2}
    assert index["answers"] == ImageFolderDataModule(data_dir=str(folder)).answers  # the vocabulary of all the data


FIT_STEPS = ["--trainer.max_epochs=1", "--trainer.num_sanity_val_steps=0", "--test_after_fit=false"]


def accuracy_line(out: str) -> str:
    """The one ``vlfuse: test accuracy A (N questions)`` that ``out`` prints (without what follows it)."""
    lines = re.findall(r"^vlfuse: test accuracy \d\.\d{4} \(\d+ questions\)", out, re.MULTILINE)
    assert len(lines) == 1, out
    return lines[0]


def test_fit_on_the_shards_then_test_answers_as_from_the_folder(folder, shards, tmp_path, capsys):
    config = str(REPO / "configs" / "streaming_vqa.yaml")
    tiny = tiny_cli_args(tmp_path / "run", limit_images=16)
    assert main(["fit", "--config", config, f"--data.init_args.data_dir={shards}", *tiny, *FIT_STEPS]) == 0
    model = tmp_path / "run" / "model"
    assert (model / "model.safetensors").is_file()
    capsys.readouterr()
    lines = []
    for config, data_dir in (("streaming_vqa", shards), ("imagefolder_vqa", folder)):
        args = ["test", "--config", str(REPO / "configs" / f"{config}.yaml"), f"--data.init_args.data_dir={data_dir}",
                f"--model.pretrained={model}", *tiny_cli_args(tmp_path / config)]
        assert main(args) == 0
        lines.append(accuracy_line(capsys.readouterr().out))
    assert lines[0] == lines[1] and "questions" in lines[0]


def test_a_fit_killed_mid_epoch_resumes_from_the_loaders_saved_place_to_the_same_weights(shards, tmp_path, one_thread):
    """As tests/test_resume.py's run killed by SIGKILL, on the shards: 16 images, 4 batches an epoch, 2 epochs."""
    def fit_args(root: Path, *extra: str) -> list[str]:
        return ["fit", "--config", str(REPO / "configs" / "streaming_vqa.yaml"), f"--data.init_args.data_dir={shards}",
                *tiny_cli_args(root, limit_images=16), "--trainer.max_epochs=2", "--trainer.num_sanity_val_steps=0",
                "--test_after_fit=false", *extra]

    assert main(fit_args(tmp_path / "whole")) == 0
    killed_args = fit_args(tmp_path / "killed", "--checkpoint.every_n_train_steps=2")
    killed = fit_in_subprocess(killed_args, signum=signal.SIGKILL, step=7)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    stopped = last_checkpoint(tmp_path / "killed" / "checkpoints")
    assert (stopped["global_step"], stopped["epoch"]) == (6, 1)  # half-way through the second epoch
    [state] = stopped["loops"]["fit_loop"]["state_dict"]["combined_loader"]  # litdata's loader state
    assert (state["current_epoch"], state["num_samples_yielded"]) == (2, 8)

    assert main([*killed_args, "--ckpt_path=last"]) == 0
    ours, theirs = last_checkpoint(tmp_path / "killed" / "checkpoints"), last_checkpoint(tmp_path / "whole" / "checkpoints")
    assert ours["global_step"] == theirs["global_step"] == 8
    for name, weight in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][name], weight), name


# ------------------------------------------------------------------------------------------ the stress test
def stress_with_shards(tmp_path, capsys, rows: int, images: int) -> str:
    load_script("stress_imagefolder").main(["--data", str(tmp_path / "data"), "--rows", str(rows), "--images", str(images), "--shards"])
    out = capsys.readouterr().out
    assert re.search(rf"^epoch: {images:,} images in [\d.]+ s", out, re.MULTILINE), out
    assert re.search(r"^convert: [\d.]+ s \(imports included\); peak memory \d+ MB", out, re.MULTILINE), out
    assert re.search(rf"^shards epoch: {images:,} images in [\d.]+ s \(\d+ images/s, [\d.]+x the folder's\)", out, re.MULTILINE), out
    assert "same items as the folder's epoch: yes" in out
    assert sorted(p.name for p in (tmp_path / "data_shards").iterdir()) == ["train", INDEX_NAME]
    return out


@pytest.mark.slow
def test_the_stress_script_reads_an_epoch_from_shards_beside_the_folder(tmp_path, capsys):
    stress_with_shards(tmp_path, capsys, 40, 8)


@pytest.mark.slow
def test_two_hundred_thousand_rows_over_twenty_thousand_images_from_shards(tmp_path, capsys):
    stress_with_shards(tmp_path, capsys, 200_000, 20_000)


@pytest.mark.slow
def test_a_two_process_ddp_fit_on_the_shards_tests_once_as_one_process_does(shards, tmp_path, capsys):
    """Two CPU processes (gloo): litdata shares the training split by the trainer's ranks, the test split
    is scored once, and the printed accuracy is that of one process testing the saved model."""
    config = str(REPO / "configs" / "streaming_vqa.yaml")
    tiny = tiny_cli_args(tmp_path / "run", limit_images=16)
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    command = [sys.executable, "-m", "vlfuse.cli", "fit", "--config", config, f"--data.init_args.data_dir={shards}",
               *tiny, *ddp, "--trainer.max_epochs=1", "--trainer.num_sanity_val_steps=0"]
    result = subprocess.run(command, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in result.stderr
    assert "Traceback" not in result.stderr
    # each process trained on its half: 8 of the 16 images, 2 batches of 4, where one process takes 4
    assert last_checkpoint(tmp_path / "run" / "checkpoints")["global_step"] == 2
    two_processes = accuracy_line(result.stdout)
    args = ["test", "--config", config, f"--data.init_args.data_dir={shards}", f"--model.pretrained={tmp_path / 'run' / 'model'}",
            *tiny_cli_args(tmp_path / "one")]
    assert main(args) == 0
    assert accuracy_line(capsys.readouterr().out) == two_processes

"""Model folders are written atomically and read as untrusted data (issue 31).

Each damaged or hostile folder is refused with one line that names the file, by the Python API and
by the command a user types (``vlfuse predict``), and nothing in a folder runs code or allocates
what its config claims before the weights file is checked.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlfuse import model_io
from vlfuse.captioning import CaptionConfig, CaptionModel
from vlfuse.cli import main as vlfuse_main
from vlfuse.encoders import ImageEncoderConfig, build_word_tokenizer
from vlfuse.model import VLFuseModel

from conftest import COLOUR_ANSWERS, logits, make_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A tiny model saved once, and the batch it is checked on."""
    model, batch = make_model()
    directory = model.eval().save_pretrained(tmp_path_factory.mktemp("saved") / "model")
    return directory, batch


@pytest.fixture
def folder(saved, tmp_path) -> Path:
    """A fresh copy of the saved model folder, to damage."""
    return Path(shutil.copytree(saved[0], tmp_path / "model"))


def edit_config(folder: Path, change) -> None:
    """Apply ``change`` to ``config.json``'s data (``config.json`` has no digest of its own)."""
    meta = json.loads((folder / "config.json").read_text())
    change(meta)
    (folder / "config.json").write_text(json.dumps(meta))


def record_digests(folder: Path) -> None:
    """Record the digests of the files as they are now: a folder changed on purpose, digests and all."""
    edit_config(folder, lambda meta: meta.update(files=model_io.file_digests(folder)))


def forget_digests(folder: Path) -> None:
    """Remove ``files`` from ``config.json``: a folder written before digests were recorded."""
    edit_config(folder, lambda meta: meta.pop("files"))


def refused(folder: Path, pattern: str) -> str:
    """Load ``folder``: it must fail with one line matching ``pattern`` that names a file of it."""
    with pytest.raises(ValueError) as caught:
        VLFuseModel.from_pretrained(folder)
    message = str(caught.value)
    assert "\n" not in message, message
    assert str(folder) in message, message
    assert re.search(pattern, message), message
    return message


# ------------------------------------------------------------------------------ writing
def test_a_saved_folder_lists_every_file_with_its_digest(saved):
    directory, _ = saved
    meta = json.loads((directory / "config.json").read_text())
    files = meta["files"]
    assert sorted(files) == ["answers.json", "model.safetensors", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]
    for name, entry in files.items():
        assert entry == {"size": (directory / name).stat().st_size, "sha256": model_io.sha256(directory / name)}
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".")], "no staging folder is left"


def test_saving_over_a_model_replaces_it_whole_and_over_other_folders_refuses(saved, tmp_path):
    directory, batch = saved
    model = VLFuseModel.from_pretrained(directory)
    target = model.save_pretrained(tmp_path / "m")
    with torch.no_grad():
        model.head.classifier[-1].bias.add_(1.0)
    model.save_pretrained(target)
    torch.testing.assert_close(logits(VLFuseModel.from_pretrained(target), batch), logits(model, batch), atol=0, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes exists and is not a vlfuse model folder: not replaced"):
        model.save_pretrained(notes)
    assert (notes / "todo.txt").read_text() == "mine"


def test_a_killed_saves_staging_folder_is_removed_by_the_next_save(saved, tmp_path):
    model = VLFuseModel.from_pretrained(saved[0])
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()  # a process id that no longer runs
    abandoned = tmp_path / f".m{model_io.STAGING}{child.pid}-abc"
    abandoned.mkdir()
    mine = tmp_path / f".m{model_io.STAGING}{os.getpid()}-def"  # a save of a running process: kept
    mine.mkdir()
    model.save_pretrained(tmp_path / "m")
    assert not abandoned.exists() and mine.exists()


def save_alternately(folder: str, sources: list[str], saving) -> None:
    """In a forked child: save the models of ``sources`` to ``folder`` in turn, forever; set the
    event ``saving`` once the first save began."""
    torch.set_num_threads(1)
    models = [VLFuseModel.from_pretrained(source) for source in sources]
    saving.set()
    while True:
        for model in models:
            model.save_pretrained(folder)


def test_a_save_killed_at_any_moment_leaves_the_old_model_or_the_new_one(saved, tmp_path):
    """SIGKILL a process that saves two different models into one folder in turn, 30 times at random
    moments: every time the folder loads and answers exactly as one of the two models."""
    directory, batch = saved
    model = VLFuseModel.from_pretrained(directory)
    other_dir = tmp_path / "other"
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-1.0)
    model.answers.reverse()  # answers.json differs too: a mix of files would answer wrongly
    model.save_pretrained(other_dir)
    expected = [logits(VLFuseModel.from_pretrained(d), batch) for d in (directory, other_dir)]
    assert not torch.equal(expected[0], expected[1])
    target = tmp_path / "target"
    VLFuseModel.from_pretrained(directory).save_pretrained(target)
    rng = random.Random(0)
    context = multiprocessing.get_context("fork")
    outcomes, mid_save = [], []
    for _ in range(30):
        saving = context.Event()
        child = context.Process(target=save_alternately, args=(str(target), [str(directory), str(other_dir)], saving))
        child.start()
        assert saving.wait(60)
        time.sleep(rng.random() * 0.3)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        mid_save.append(any(tmp_path.glob(f".target{model_io.STAGING}*")))
        loaded = logits(VLFuseModel.from_pretrained(target), batch)
        outcomes.append(next(i for i, e in enumerate(expected) if torch.equal(loaded, e)))
    assert set(outcomes) == {0, 1}, "the kills should land in both models' saves"
    assert sum(mid_save) >= 5, f"only {sum(mid_save)} of 30 kills landed in the middle of a save"


# ------------------------------------------------------------------------------ reading
@pytest.mark.parametrize("name", ["answers.json", "model.safetensors", "tokenizer/tokenizer.json"])
def test_a_file_changed_after_the_save_is_named(folder, name):
    path = folder / name
    path.write_bytes(path.read_bytes()[:-3] + b"   ")
    refused(folder, f"{name} does not match .*config.json: it is not the file that was saved")


def test_a_shuffled_answer_list_is_refused(folder):
    answers = folder / "answers.json"
    answers.write_text(json.dumps(list(reversed(json.loads(answers.read_text())))))
    refused(folder, "answers.json does not match")


def test_a_file_added_to_the_tokenizer_is_refused(folder):
    (folder / "tokenizer" / "special_tokens_map.json").write_text("{}")
    refused(folder, r"special_tokens_map.json was not saved with the model")


@pytest.mark.parametrize(
    "content, pattern",
    [
        (b"", "header too small"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1", "not a safetensors weights file"),
        (bytes(random.Random(1).randrange(256) for _ in range(4096)), "not a safetensors weights file"),
        (None, "not a safetensors weights file"),  # a pickle, written by torch.save
    ],
    ids=["zero bytes", "truncated", "random bytes", "a pickle"],
)
def test_a_weights_file_that_is_not_safetensors_is_one_line(folder, content, pattern):
    weights = folder / "model.safetensors"
    if content is None:
        torch.save({"weights": torch.zeros(3)}, weights)
    else:
        weights.write_bytes(content)
    refused(folder, "model.safetensors does not match")  # the digest tells first
    forget_digests(folder)
    refused(folder, f"model.safetensors is not a safetensors weights file: .*{pattern}|{pattern}")


def test_a_truncated_copy_of_the_weights_is_refused_without_digests(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    forget_digests(folder)
    refused(folder, "model.safetensors is not a safetensors weights file")


def test_non_finite_weights_are_refused(saved, tmp_path):
    model = VLFuseModel.from_pretrained(saved[0])
    with torch.no_grad():
        model.head.classifier[-1].weight[0, 0] = float("nan")
    directory = model.save_pretrained(tmp_path / "nan")
    refused(directory, r"model.safetensors: head.classifier.2.weight holds NaN or infinite values")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "answers.json"])
def test_a_fifo_in_place_of_a_file_is_refused_without_opening_it(folder, name):
    (folder / name).unlink()
    os.mkfifo(folder / name)
    refused(folder, f"{name} is not a regular file")  # opening a FIFO would wait for a writer forever


@pytest.mark.parametrize(
    "change, pattern",
    [
        (lambda meta: meta.clear() or meta.update(x=1), "is not a vlfuse model of format"),
        (lambda meta: meta["config"]["image"].update(mean=[0.5, 0.5]), r"image.mean must give 3 numbers"),
        (lambda meta: meta["config"]["image"].update(patch_size=0), r"image.patch_size must be between 1 and 32, got 0"),
        (lambda meta: meta["config"]["image"].update(image_size="big"), r"image.image_size must be int, got 'big'"),
        (lambda meta: meta["config"]["image"].update(name="resnet18"), r"image encoder 'resnet18' is not a vision transformer"),
        (lambda meta: meta["config"]["fuser"].update(depth=100_000), r"fuser.depth must be between 1 and 1024, got 100000"),
        (lambda meta: meta["config"].update(fusion_dim=-4), r"fusion_dim must be between 1 and 65536, got -4"),
        (lambda meta: meta["text_encoder_config"].update(num_hidden_layers=10**9), r"num_hidden_layers must be between 0 and 1024"),
        (lambda meta: meta.update(text_encoder_config=[]), r"text_encoder_config must be a transformers config"),
        (lambda meta: meta["config"].pop("image") and meta["config"].update(image=7), r"config.json: .*"),
        (lambda meta: meta["config"]["image"].update(std=["a", "b", "c"]), r"image.std\[0\] must be float, got 'a'"),
        (lambda meta: meta["config"]["fuser"].update(mlp_ratio=-2.0), r"fuser.mlp_ratio must be above 0 and at most 64, got -2.0"),
        (lambda meta: meta["config"].update(pruned_heads={"0": "abc"}), r"pruned_heads\['0'\] must be list, got 'abc'"),
        (lambda meta: meta["config"].update(pruned_heads={"\u00b2": [1]}), r"pruned_heads maps layer numbers to head ids"),
        (lambda meta: meta.update(format_version=True), r"config.json is not a vlfuse model of format .*format True"),
        (lambda meta: meta["config"]["text"].update(max_length=64), r"text.max_length 64 is more than the 16 positions of the text encoder"),
        (lambda meta: meta["text_encoder_config"].update(_attn_implementation="kernels-community/flash-attn"),
         r"text_encoder_config._attn_implementation: a private setting of transformers"),
        (lambda meta: meta["text_encoder_config"].update(attn_implementation="kernels-community/flash-attn"),
         r"text_encoder_config.attn_implementation must be one of \[None, 'eager', 'sdpa'\]"),
        (lambda meta: meta["text_encoder_config"].update(dtype="float64"), r"text_encoder_config.dtype must be one of \[None, 'float32'\]"),
        (lambda meta: meta["text_encoder_config"].update(hidden_act="os.system"), r"text_encoder_config.hidden_act must name one of transformers' activations"),
        (lambda meta: meta["text_encoder_config"].update(layer_norm_eps="x"), r"text_encoder_config.layer_norm_eps must be null or int or float, got 'x'"),
        (lambda meta: meta["text_encoder_config"].update(pad_token_id=10**6), r"text_encoder_config.pad_token_id must be a token id below vocab_size"),
        (lambda meta: meta["text_encoder_config"].update(extra=list(range(2000))), r"text_encoder_config.extra is not a setting of this encoder type and is larger"),
    ],
    ids=["no model", "mean of 2", "patch 0", "size not int", "not a ViT", "depth 1e5", "width < 0", "layers 1e9",
         "text config a list", "image not a mapping", "std of strings", "mlp ratio < 0", "pruned heads a string",
         "pruned layer not ascii", "format true", "text longer than its positions", "private attention", "hub kernel",
         "float64 encoder", "activation by any name", "eps a string", "pad id past the vocabulary", "large unknown key"],
)
def test_a_bad_config_is_one_line_naming_it(folder, change, pattern):
    edit_config(folder, change)
    message = refused(folder, pattern)
    assert "config.json" in message


def test_a_config_json_larger_than_any_vlfuse_writes_is_refused_before_it_is_parsed(folder):
    edit_config(folder, lambda meta: meta.update(pad=[[1]] * 1_000_000))  # 5 MB of small lists
    refused(folder, r"config.json is 4.8 MiB, more than the 4 MiB this file of a model folder may be")


def test_a_config_json_that_is_a_list_is_one_line(folder):
    (folder / "config.json").write_text("[]")
    refused(folder, r"config.json is not a vlfuse model of format 1 or 2 or 3")


def test_sizes_in_a_config_are_checked_against_the_weights_before_anything_is_allocated(folder, monkeypatch):
    """A vocabulary of 4 million (2 GB of embeddings) is compared with the weights file's header on
    the meta device: the model is never built with real tensors."""
    edit_config(folder, lambda meta: meta["text_encoder_config"].update(vocab_size=4_000_000))
    built_on = []
    original = VLFuseModel.__init__

    def spy(self, *args, **kwargs):
        built_on.append(torch.empty(0).device.type)  # the device new tensors go to
        original(self, *args, **kwargs)

    monkeypatch.setattr(VLFuseModel, "__init__", spy)
    refused(folder, r"word_embeddings.weight is \(\d+, 32\) in the file, \(4000000, 32\) in the model")
    assert built_on == ["meta"]


def test_a_saved_text_configs_task_head_keys_are_left_out_and_settings_of_pretrained_encoders_pass(folder, saved):
    """10**8 labels would allocate a table of 10**8 names in transformers; a head's labels say nothing
    of the encoder, so they are not passed on. Settings that pretrained BERT-like configs carry and
    the model type does not define load, as they did."""
    def change(meta):
        meta["text_encoder_config"].update(num_labels=10**8, id2label={str(i): f"L{i}" for i in range(1000)},
                                           gradient_checkpointing=False, position_embedding_type="absolute")
    edit_config(folder, change)
    model = VLFuseModel.from_pretrained(folder)
    assert model.text_encoder.model.config.num_labels == 2
    assert torch.equal(logits(model, saved[1]), logits(VLFuseModel.from_pretrained(saved[0]), saved[1]))


def test_buffers_a_model_computes_are_bounded_by_its_weights_before_anything_is_allocated(tmp_path):
    """A table that a model computes from its config (not in its weights file) may not make a small
    folder allocate gigabytes: its size is known on the meta device, and the real build never runs."""
    from safetensors.torch import save_file

    class Derived(torch.nn.Module):
        def __init__(self, cells: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4))
            self.register_buffer("offsets", torch.zeros(cells, cells, dtype=torch.int64), persistent=False)

    save_file({"weight": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    built_on = []

    def build(cells: int):
        built_on.append(torch.empty(0).device.type)
        return Derived(cells)

    header = model_io.read_header(tmp_path)
    with pytest.raises(ValueError, match=r"the model would hold 2,048 MiB of tensors that are not in model.safetensors"):
        model_io.build_checked(lambda: build(16_384), header, tmp_path, "config.json")  # 16384**2 int64: 2 GiB
    assert built_on == ["meta"]
    assert model_io.build_checked(lambda: build(64), header, tmp_path, "config.json").offsets.shape == (64, 64)


def test_weights_of_another_kind_than_the_models_are_refused(folder):
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    state["image_proj.weight"] = state["image_proj.weight"].to(torch.int64)
    save_file(state, str(folder / "model.safetensors"))
    record_digests(folder)
    refused(folder, r"model.safetensors: image_proj.weight is stored as torch.int64, where .* needs torch.float32")
    state["image_proj.weight"] = state["image_proj.weight"].to(torch.float16)  # another float: cast, as torch loads it
    save_file(state, str(folder / "model.safetensors"))
    record_digests(folder)
    assert VLFuseModel.from_pretrained(folder).image_proj.weight.dtype == torch.float32


def test_tokenizer_ids_beyond_the_text_encoders_vocabulary_are_refused(folder):
    words = [f"word{i}" for i in range(500)]
    build_word_tokenizer(words, 16).save_pretrained(folder / "tokenizer")
    record_digests(folder)
    refused(folder, r"tokenizer gives token ids up to 503, but the model has \d+ word embeddings")


def test_a_tokenizer_file_larger_than_its_vocabulary_needs_is_refused_before_it_is_parsed(folder, monkeypatch):
    tokenizer_json = folder / "tokenizer" / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    data["model"]["vocab"].update({f"w{i}": i for i in range(100, 200_000)})  # ids past the embeddings, 2.6 MB
    tokenizer_json.write_text(json.dumps(data))
    record_digests(folder)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: pytest.fail("parsed"))
    refused(folder, r"tokenizer.json is [\d,]+ bytes, more than the [\d,]+ a tokenizer of \d+ tokens may need")


def test_a_tokenizer_the_tokenizers_library_refuses_is_one_line(folder):
    tokenizer_json = folder / "tokenizer" / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    data["model"]["vocab"]["bad"] = -5
    tokenizer_json.write_text(json.dumps(data))
    record_digests(folder)
    refused(folder, r"tokenizer cannot be read as a tokenizer: invalid value: integer `-5`")


def test_a_tokenizer_that_names_code_runs_none_and_asks_nothing(folder, monkeypatch, tmp_path):
    """``auto_map`` naming a .py file of the folder: transformers would ask on a terminal, and run it
    on "y". vlfuse passes trust_remote_code=False: the code never runs, nothing is asked."""
    marker = tmp_path / "ran"
    config_file = folder / "tokenizer" / "tokenizer_config.json"
    (folder / "tokenizer" / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    config_file.write_text(json.dumps(tokenizer_config))
    record_digests(folder)
    monkeypatch.setattr("builtins.input", lambda *args: pytest.fail("a prompt was shown"))
    model = VLFuseModel.from_pretrained(folder)  # with the tokenizer class transformers ships
    assert type(model.tokenizer).__module__.startswith("transformers.")
    tokenizer_config.pop("tokenizer_class")  # now only the folder's code could build it
    config_file.write_text(json.dumps(tokenizer_config))
    record_digests(folder)
    refused(folder, r"cannot load a tokenizer from .*tokenizer")
    assert not marker.exists()


def test_predict_refuses_a_damaged_folder_in_one_line(folder, tmp_path, capsys):
    (folder / "model.safetensors").write_bytes(b"")
    image = tmp_path / "red.png"
    Image.new("RGB", (32, 32), "red").save(image)
    status = vlfuse_main(["predict", "--model", str(folder), "--image", str(image), "--question", "what colour is it?"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("vlfuse: error: ") and err.count("\n") == 1, err
    assert "model.safetensors does not match" in err


# ------------------------------------------------------------------------------ caption models
def test_a_caption_model_is_saved_with_digests_and_checked(tmp_path):
    config = CaptionConfig(image=ImageEncoderConfig(image_size=30, patch_size=10, width=16, depth=1, num_heads=2), dim=16, depth=1)
    model = CaptionModel.from_config(config, ["there is a red square ."])
    directory = model.save_pretrained(tmp_path / "captions")
    assert "model.safetensors" in json.loads((directory / "config.json").read_text())["files"]
    CaptionModel.from_pretrained(directory)
    words = [f"word{i}" for i in range(50)]
    build_word_tokenizer(words, 16).save_pretrained(tmp_path / "tokenizer")  # ids past the decoder's embeddings
    other = Path(shutil.copytree(directory, tmp_path / "other"))
    shutil.rmtree(other / "tokenizer")
    shutil.copytree(tmp_path / "tokenizer", other / "tokenizer")
    record_digests(other)
    with pytest.raises(ValueError, match=r"tokenizer gives token ids up to 53, but the model has \d+ word embeddings"):
        CaptionModel.from_pretrained(other)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.safetensors does not match"):
        CaptionModel.from_pretrained(directory)


def test_a_saved_model_still_answers_as_it_did(saved):
    """The checks change nothing of a good folder: the same logits as the model that was saved."""
    directory, batch = saved
    torch.manual_seed(0)
    model, _ = make_model()
    torch.testing.assert_close(logits(VLFuseModel.from_pretrained(directory), batch), logits(model.eval(), batch), atol=0, rtol=0)
    assert VLFuseModel.from_pretrained(directory).answers == COLOUR_ANSWERS


# ------------------------------------------------------------------------------ through vlfuse test
def lightning_test_args(tmp_path: Path) -> list[str]:
    from conftest import REPO, tiny_overrides

    return ["test", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_overrides(8),
            f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.logger=false"]


def test_vlfuse_test_refuses_a_damaged_pretrained_folder_in_one_line(folder, tmp_path, capsys):
    (folder / "model.safetensors").write_bytes(b"")
    assert vlfuse_main([*lightning_test_args(tmp_path), f"--model.pretrained={folder}"]) == 2
    err = capsys.readouterr().err
    assert f"vlfuse: error: {folder / 'model.safetensors'} does not match" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "write, message",
    [
        (lambda path: torch.save({"state_dict": {}, "hparams": argparse.Namespace(lr=1)}, path),
         "--ckpt_path: the checkpoint holds a Python object (argparse.Namespace) that loading it would have to run code for"),
        (lambda path: path.write_bytes(bytes(range(256))), "--ckpt_path: not a checkpoint torch can read"),
        (lambda path: torch.save({"state_dict": {"w": torch.zeros(64)}}, path) or path.write_bytes(path.read_bytes()[:200]),
         "--ckpt_path: the checkpoint is damaged or truncated"),
    ],
    ids=["pickled object", "random bytes", "truncated"],
)
def test_vlfuse_test_refuses_a_checkpoint_it_cannot_read_safely_in_one_line(tmp_path, capsys, write, message):
    checkpoint = tmp_path / "given.ckpt"
    write(checkpoint)
    assert vlfuse_main([*lightning_test_args(tmp_path), f"--ckpt_path={checkpoint}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vlfuse: error: {message}") and err.count("\n") == 1, err


# ------------------------------------------------------------------------------ vlfuse fit killed in its export
def fit_command(root: Path, seed: int, export: Path) -> list[str]:
    from conftest import REPO, tiny_cli_args

    return [sys.executable, "-m", "vlfuse.cli", "fit", "--config", str(REPO / "configs" / "easy_vqa.yaml"),
            *tiny_cli_args(root), f"--export.dirpath={export}", f"--seed_everything={seed}", "--threads=1",
            "--trainer.max_epochs=1", "--test_after_fit=false"]


def kill_when_staging_appears(command: list[str], target: Path, delay: float) -> bool:
    """Run ``command``; SIGKILL it ``delay`` seconds after a save into ``target`` began (its hidden
    staging folder appeared). Returns whether the kill came before the process ended."""
    pattern = f".{target.name}{model_io.STAGING}"

    def staging() -> set[str]:
        return {entry.name for entry in os.scandir(target.parent) if entry.name.startswith(pattern)}

    abandoned = staging()  # by an earlier kill: the next save removes them
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while process.poll() is None:
        if staging() - abandoned:
            time.sleep(delay)
            process.kill()
            break
        time.sleep(0.0005)
    return process.wait() == -signal.SIGKILL


@pytest.mark.slow
def test_vlfuse_fit_killed_at_many_points_of_its_export_leaves_the_old_model_or_the_new(tmp_path):
    """The issue's case: `vlfuse fit` exports into a folder that holds another run's model and is
    SIGKILLed at 12 points of that export (0 to 11 ms after it began; it takes about 6): the folder
    answers as the old model or the new, or refuses in one line, never a mix."""
    env_batch = make_model()[1]
    old_dir, new_dir, target = tmp_path / "old", tmp_path / "new", tmp_path / "target"
    subprocess.run(fit_command(tmp_path / "run_old", 0, old_dir), check=True, capture_output=True)
    subprocess.run(fit_command(tmp_path / "run_new", 1, new_dir), check=True, capture_output=True)
    expected = [logits(VLFuseModel.from_pretrained(d), env_batch) for d in (old_dir, new_dir)]
    assert not torch.equal(expected[0], expected[1])
    outcomes = []
    for attempt in range(12):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(old_dir, target)
        killed = kill_when_staging_appears(fit_command(tmp_path / f"run_{attempt}", 1, target), target, attempt * 0.001)
        try:
            loaded = logits(VLFuseModel.from_pretrained(target), env_batch)
        except ValueError as err:
            assert "\n" not in str(err)
            outcomes.append(("refused", killed))
            continue
        outcomes.append((next(name for name, e in zip(("old", "new"), expected) if torch.equal(loaded, e)), killed))
    print("outcomes (model, killed before it ended):", outcomes)
    assert {name for name, _ in outcomes} <= {"old", "new", "refused"}
    assert sum(killed for _, killed in outcomes) >= 8, outcomes
    assert {"old", "new"} <= {name for name, _ in outcomes}, "kills should land before and after the new model took its place"


def test_a_saved_folder_and_its_files_get_the_permissions_of_any_new_folder_and_file(saved, tmp_path):
    directory = VLFuseModel.from_pretrained(saved[0]).save_pretrained(tmp_path / "m")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain.txt").write_text("")
    assert directory.stat().st_mode == (tmp_path / "plain").stat().st_mode
    modes = {path.name: path.stat().st_mode for path in directory.rglob("*") if path.is_file()}
    assert modes and set(modes.values()) == {(tmp_path / "plain.txt").stat().st_mode}, modes  # the weights too


def test_a_checkpoint_given_as_a_model_folder_says_what_to_give(tmp_path, capsys):
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, checkpoint)
    image = tmp_path / "red.png"
    Image.new("RGB", (32, 32), "red").save(image)
    assert vlfuse_main(["predict", "--model", str(checkpoint), "--image", str(image), "--question", "what is it?"]) == 2
    assert capsys.readouterr().err == (
        f"vlfuse: error: {checkpoint} is a Lightning checkpoint, not a model folder: give the run's model/ folder, which "
        "vlfuse fit exports at its end (runs/NAME/latest/model), or evaluate the checkpoint with vlfuse test --ckpt_path\n"
    )

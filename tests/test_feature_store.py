"""A frozen image encoder's features on disk: ``vlfuse cache-features`` writes safetensors shards and an
index, resumably; training reads them instead of running the encoder, with the same results; a store
of another encoder, or a damaged one, is refused in one line."""

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vlfuse.cli import main
from vlfuse.commands.lightning import run_lightning
from vlfuse.encoders.feature_store import DiskFeatureStore, FeatureStoreWriter, StoreError, encoder_identity
from vlfuse import model_io
from vlfuse.model import VLFuseModel

from conftest import REPO, tiny_cli_args, tiny_config

IDENTITY = {"name": "vit", "weights_sha256": "0" * 64, "image_size": 32, "mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bilinear"}
SHAPE = (5, 3)
ANSWERS = ["yes", "no", "red"]
QUESTIONS = ["is it red?", "what colour is it?", "is there a circle?"]
CONFIG = str(REPO / "configs" / "easy_vqa.yaml")


def write_store(directory: Path, features: torch.Tensor, per_shard: int = 2, dtype=torch.float32) -> list[str]:
    """``features`` (N, 5, 3) under keys img0..imgN-1 in shards of ``per_shard``; returns the keys."""
    keys = [f"img{i}" for i in range(len(features))]
    with FeatureStoreWriter(directory, IDENTITY, dtype, SHAPE) as writer:
        for start in range(0, len(keys), per_shard):
            writer.add_shard(keys[start : start + per_shard], features[start : start + per_shard].to(dtype))
    return keys


def test_shards_round_trip_bit_for_bit_and_float16_to_its_precision(tmp_path):
    torch.manual_seed(0)
    features = torch.randn(7, *SHAPE) * 100
    keys = write_store(tmp_path / "f32", features)
    store = DiskFeatureStore(tmp_path / "f32")
    assert len(store) == 7 and len(store.shards) == 4 and "img6" in store and "img7" not in store
    order = ["img6", "img0", "img3", "img3"]  # across shards, repeated, out of order
    assert torch.equal(store.get(order), features[[6, 0, 3, 3]])
    assert torch.equal(store.get(keys), features)
    for dtype in (torch.float16, torch.bfloat16):
        write_store(tmp_path / str(dtype), features, per_shard=3, dtype=dtype)
        read = DiskFeatureStore(tmp_path / str(dtype)).get(keys)
        assert read.dtype == dtype and torch.equal(read, features.to(dtype))
        assert torch.allclose(read.float(), features, rtol=torch.finfo(dtype).eps, atol=0)
    index = json.loads((tmp_path / "f32" / "index.json").read_text())
    assert index["keys"]["img5"] == [2, 1] and index["shards"][3]["rows"] == 1
    assert index["shards"][0]["sha256"] == model_io.sha256(tmp_path / "f32" / "shard-00000.safetensors")
    store.verify()
    store.close()
    assert torch.equal(store.get(["img1"]), features[[1]])  # closed files open again when read


def test_a_store_of_another_encoder_dtype_or_a_foreign_folder_is_never_overwritten(tmp_path):
    write_store(tmp_path / "store", torch.zeros(3, *SHAPE))
    other = {**IDENTITY, "weights_sha256": "1" * 64}
    with pytest.raises(StoreError, match="weights_sha256 is '0000.*' there, '1111.*' here\\): give another --out"):
        FeatureStoreWriter(tmp_path / "store", other, torch.float32, SHAPE)
    with pytest.raises(StoreError, match="dtype is 'float32' there, 'float16' here"):
        FeatureStoreWriter(tmp_path / "store", IDENTITY, torch.float16, SHAPE)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match="is not a feature store \\(it holds notes.txt\\)"):
        FeatureStoreWriter(tmp_path / "mine", IDENTITY, torch.float32, SHAPE)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with FeatureStoreWriter(tmp_path / "store", IDENTITY, torch.float32, SHAPE):  # one writer at a time
        with pytest.raises(StoreError, match="another vlfuse cache-features is writing this store"):
            FeatureStoreWriter(tmp_path / "store", IDENTITY, torch.float32, SHAPE)
    assert len(DiskFeatureStore(tmp_path / "store")) == 3


def one_line_error(directory: Path, match: str) -> None:
    with pytest.raises(ValueError) as caught:
        DiskFeatureStore(directory)
    assert "\n" not in str(caught.value) and match in str(caught.value), str(caught.value)


def test_a_damaged_shard_or_index_is_refused_in_one_line_naming_the_file(tmp_path):
    store = tmp_path / "store"
    write_store(store, torch.randn(5, *SHAPE))
    shard = store / "shard-00001.safetensors"
    original = shard.read_bytes()
    shard.write_bytes(original[:-4])
    one_line_error(store, f"{shard} is {len(original) - 4} bytes, the index says {len(original)}: the shard is truncated")
    shard.write_bytes(b"\xff" * len(original))
    one_line_error(store, f"{shard} is not a safetensors file")
    header = len(original) - 2 * SHAPE[0] * SHAPE[1] * 4  # a header of another shape, same length and size
    shard.write_bytes(original[:header].replace(b"[2,5,3]", b"[2,3,5]") + original[header:])
    one_line_error(store, f"{shard} does not hold the index's features float32 [2, 5, 3] alone")
    shard.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit of the features flipped
    DiskFeatureStore(store)  # sizes and headers agree: only the digest tells
    with pytest.raises(StoreError, match=f"{shard}: its SHA-256 differs from the index's"):
        DiskFeatureStore(store).verify()
    shard.write_bytes(original)

    index_file = store / "index.json"
    index = json.loads(index_file.read_text())
    for damage, message in [
        (lambda i: i["keys"].update(img0=[1, 7]), "image 'img0' is at [1, 7], not [shard, row] of a listed shard"),
        (lambda i: i["shards"][0].update(file="../../etc/passwd"), "shard 0 is named '../../etc/passwd'"),
        (lambda i: i.update(shape=[5, -3]), "shape [5, -3] is not [tokens, width]"),
        (lambda i: i.update(dtype="float64"), "dtype 'float64' is not one of"),
        (lambda i: i.update(format="pickle"), "format is 'pickle'"),
    ]:
        damaged = json.loads(json.dumps(index))
        damage(damaged)
        index_file.write_text(json.dumps(damaged))
        one_line_error(store, f"{index_file} is not a valid feature store index: {message}")
    index_file.write_text(json.dumps(index)[:-10])
    one_line_error(store, f"{index_file}: not valid JSON")
    index_file.write_text(json.dumps(index))
    (store / "shard-00002.safetensors").unlink()
    one_line_error(store, "shard-00002.safetensors: the shard the index lists is missing")


# -------------------------------------------------------------------- the model reads the store
def frozen_model(seed: int = 0, cache: bool = True) -> VLFuseModel:
    base = tiny_config()
    config = dataclasses.replace(base, image=dataclasses.replace(base.image, freeze=True, cache_features=cache))
    torch.manual_seed(seed)
    return VLFuseModel.from_config(config, ANSWERS, QUESTIONS)


def store_of(model: VLFuseModel, directory: Path, pixels: torch.Tensor, keys: list[str], dtype=torch.float32) -> DiskFeatureStore:
    encoder = model.image_encoder.eval()
    with torch.no_grad():
        features = encoder(pixels)
    with FeatureStoreWriter(directory, encoder.feature_identity(), dtype, features.shape[1:]) as writer:
        writer.add_shard(keys, features.to(dtype))
    return DiskFeatureStore(directory)


def training_step(model: VLFuseModel, pixels, keys) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one training step on 3 images and 4 questions, and the gradients it gives."""
    model.train()
    model.zero_grad()
    torch.manual_seed(2)  # the same dropout masks each time
    tokens = model.processor.tokenize(["is it red?", "what colour is it?", "is it red?", "is there a circle?"])
    logits = model(pixels, tokens["input_ids"], tokens["attention_mask"], image_index=torch.tensor([0, 0, 1, 2]), image_keys=keys).logits
    loss = F.cross_entropy(logits, torch.tensor([0, 2, 1, 0]))
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_a_training_step_reading_the_store_equals_one_running_the_encoder(tmp_path, one_thread):
    torch.manual_seed(1)
    pixels, keys = torch.rand(3, 3, 32, 32), ["a.png", "b.png", "c.png"]
    live = frozen_model(cache=False)
    stored = frozen_model(cache=False)
    stored.image_encoder.use_feature_store(store_of(stored, tmp_path / "store", pixels, keys))
    live_loss, live_grads = training_step(live, pixels, keys)
    stored_loss, stored_grads = training_step(stored, None, keys)  # no pixels: every image is stored
    assert torch.equal(stored_loss, live_loss)
    assert live_grads.keys() == stored_grads.keys() and all(torch.equal(live_grads[n], stored_grads[n]) for n in live_grads)
    assert not any(name.startswith("image_encoder.") for name in stored_grads)


def test_images_the_store_lacks_are_encoded_with_a_warning_and_need_their_pixels(tmp_path, one_thread):
    torch.manual_seed(1)
    pixels, keys = torch.rand(3, 3, 32, 32), ["a.png", "b.png", "c.png"]
    model = frozen_model()
    model.image_encoder.use_feature_store(store_of(model, tmp_path / "store", pixels[[0, 2]], ["a.png", "c.png"]))
    live_loss, _ = training_step(frozen_model(cache=False), pixels, keys)
    with pytest.warns(UserWarning, match="image 'b.png' is not in the feature store"):
        loss, _ = training_step(model, pixels, keys)
    torch.testing.assert_close(loss, live_loss)
    assert len(model.image_encoder.cache) == 1  # only b.png went through the in-memory cache
    held = model.image_encoder.held_features()
    assert all(key in held for key in keys) and "d.png" not in held
    with pytest.raises(ValueError, match="the features of image 'd.png' are not cached"):
        training_step(model, None, ["a.png", "d.png", "c.png"])


def test_float16_store_gives_the_step_within_float16_precision(tmp_path, one_thread):
    torch.manual_seed(1)
    pixels, keys = torch.rand(3, 3, 32, 32), ["a.png", "b.png", "c.png"]
    model = frozen_model(cache=False)
    live_loss, _ = training_step(model, pixels, keys)
    model.image_encoder.use_feature_store(store_of(model, tmp_path / "store", pixels, keys, torch.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, _ = training_step(model, None, keys)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, live_loss, rtol=2e-3, atol=0)


def test_a_store_of_another_encoder_or_a_trained_encoder_is_refused(tmp_path):
    torch.manual_seed(1)
    pixels, keys = torch.rand(2, 3, 32, 32), ["a.png", "b.png"]
    store = store_of(frozen_model(seed=0), tmp_path / "store", pixels, keys)
    with pytest.raises(ValueError, match=r"holds another image encoder's features: weights_sha256 is '[0-9a-f]{64}' there"):
        frozen_model(seed=1).image_encoder.use_feature_store(store)
    resized = frozen_model(seed=0)
    resized.image_encoder.config.image_size = 48
    with pytest.raises(ValueError, match="image_size is 32 there, 48 here"):
        resized.image_encoder.use_feature_store(store)
    base = tiny_config()
    torch.manual_seed(0)
    trained = VLFuseModel.from_config(dataclasses.replace(base, image=dataclasses.replace(base.image, freeze=False)), ANSWERS, QUESTIONS)
    with pytest.raises(ValueError, match="the image encoder is trained, not frozen"):
        trained.image_encoder.use_feature_store(store)
    assert encoder_identity("x", trained.image_encoder.vit, vars(base.image))["weights_sha256"] == store.encoder["weights_sha256"]


# -------------------------------------------------------------------- the command
FROZEN = "--model.architecture.image.freeze=true"


def cache_features(root: Path, *extra: str) -> int:
    tiny = [a for a in tiny_cli_args(root) if a.startswith(("--model.", "--data."))]
    return main(["cache-features", "--config", CONFIG, *tiny, "--out", str(root / "store"), *extra])


def test_cache_features_then_fit_reads_the_store_and_trains_as_the_live_encoder(tmp_path, capsys):
    assert cache_features(tmp_path, FROZEN, "--images-per-shard=5", "--verify", "--threads=1") == 0
    out = capsys.readouterr().out
    assert f"vlfuse: 24 images' features (24 new) in {tmp_path / 'store'}: 5 shards" in out
    assert "matches its SHA-256" in out
    store = DiskFeatureStore(tmp_path / "store")
    fit = ["fit", "--config", CONFIG, FROZEN, "--trainer.max_epochs=2", "--test_after_fit=false"]
    with_store = run_lightning([*fit, *tiny_cli_args(tmp_path / "a"), f"--model.feature_store={tmp_path / 'store'}"])
    live = run_lightning([*fit, *tiny_cli_args(tmp_path / "b")])
    for name in ("train/loss_epoch", "val/loss", "val/acc"):
        assert with_store.trainer.callback_metrics[name] == live.trainer.callback_metrics[name], name
    assert with_store.model.model.image_encoder.store.encoder == store.encoder
    for split in ("train", "val", "test"):  # every image is stored: none is decoded
        assert not with_store.datamodule.dataset(split).decode_images
        assert live.datamodule.dataset(split).decode_images


def test_cache_features_resumes_an_interrupted_run_and_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    add_shard = FeatureStoreWriter.add_shard
    written = []

    def stop_after_two(self, keys, features):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(list(keys))
        add_shard(self, keys, features)

    monkeypatch.setattr(FeatureStoreWriter, "add_shard", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        cache_features(tmp_path / "run", FROZEN, "--images-per-shard=5")
    assert len(json.loads((tmp_path / "run" / "store" / "index.json").read_text())["shards"]) == 2
    monkeypatch.setattr(FeatureStoreWriter, "add_shard", lambda self, keys, features: (written.append(list(keys)), add_shard(self, keys, features)))
    assert cache_features(tmp_path / "run", FROZEN, "--images-per-shard=5") == 0
    assert [len(keys) for keys in written] == [5, 5, 5, 5, 4]  # the rerun wrote only the last three shards
    assert len({key for keys in written for key in keys}) == 24
    assert cache_features(tmp_path / "whole", FROZEN, "--images-per-shard=5") == 0
    resumed, whole = (json.loads((tmp_path / name / "store" / "index.json").read_text()) for name in ("run", "whole"))
    assert resumed == whole
    assert len(written) == 10  # a finished store rerun writes nothing
    assert cache_features(tmp_path / "run", FROZEN, "--images-per-shard=5") == 0 and len(written) == 10


def test_cache_features_refuses_a_trained_encoder_and_another_encoders_store_in_one_line(tmp_path, capsys):
    assert cache_features(tmp_path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the image encoder is not frozen" in err and "--model.architecture.image.freeze true" in err
    assert cache_features(tmp_path, FROZEN) == 0
    capsys.readouterr()
    assert cache_features(tmp_path, FROZEN, "--seed_everything=1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds another store (weights_sha256 is" in err and "give another --out" in err

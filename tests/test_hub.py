"""Models save and load through huggingface_hub's mixin, from a folder or a Hub repository (issue 35).

The repository cases use the Hub's own offline machinery: a snapshot laid out in a temporary Hub
cache as ``snapshot_download`` leaves one (``blobs/``, ``snapshots/COMMIT/`` of links, ``refs/main``;
checked by ``huggingface_hub.scan_cache_dir``), read with ``HF_HUB_OFFLINE=1``. Uploading
(``push_to_hub``) needs the Hub itself and is not tested here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, ModelHubMixin, scan_cache_dir

from vlfuse import model_io
from vlfuse.captioning import CaptionConfig, CaptionModel
from vlfuse.encoders import ImageEncoderConfig, build_word_tokenizer
from vlfuse.model import VLFuseModel

from conftest import REPO, logits, make_model

REPO_ID = "someone/tiny-vlfuse"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[VLFuseModel, dict, Path]:
    """A tiny model, the batch it is checked on, and its folder."""
    model, batch = make_model()
    model.eval()
    return model, batch, model.save_pretrained(tmp_path_factory.mktemp("saved") / "model")


def cache_snapshot(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> Path:
    """Lay ``folder`` out in the Hub cache ``cache`` as the snapshot ``commit`` of ``repo_id`` on ``main``,
    as ``snapshot_download`` does: each file a blob, the snapshot links to them. Returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


# ------------------------------------------------------------------------------ folders
def test_a_model_round_trips_through_the_mixin_with_its_card(saved, tmp_path):
    model, batch, folder = saved
    assert isinstance(model, ModelHubMixin)
    loaded = VLFuseModel.from_pretrained(folder)
    assert loaded.answers == model.answers
    torch.testing.assert_close(logits(loaded, batch), logits(model, batch), atol=0, rtol=0)
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "vlfuse" and card.data.pipeline_tag == "visual-question-answering"
    assert {"vlfuse", "model_hub_mixin"} <= set(card.data.tags)
    assert "README.md" not in json.loads((folder / "config.json").read_text())["files"]

    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    (copy / "README.md").write_text("# my notes on this model\n")  # the card is documentation, not the model
    torch.testing.assert_close(logits(VLFuseModel.from_pretrained(copy), batch), logits(model, batch), atol=0, rtol=0)
    (copy / "README.md").unlink()
    assert VLFuseModel.from_pretrained(copy).answers == model.answers


def test_save_pretrained_takes_the_arguments_push_to_hub_gives_it(saved, tmp_path):
    """``push_to_hub`` saves with ``save_pretrained(folder, config=..., model_card_kwargs=...)``."""
    model, _, _ = saved
    folder = model.save_pretrained(tmp_path / "m", config=None, model_card_kwargs={"intended_use": "Sorting red from blue."})
    assert "Sorting red from blue." in (folder / "README.md").read_text()
    assert str(model.generate_model_card(intended_use="Sorting red from blue.")) == (folder / "README.md").read_text()
    with pytest.raises(TypeError, match="saves its own config"):
        model.save_pretrained(tmp_path / "n", config={"fusion_dim": 3})
    with pytest.raises(ValueError, match=r"unknown \['licence'\]"):
        model.save_pretrained(tmp_path / "n", model_card_kwargs={"licence": "mit"})
    assert not (tmp_path / "n").exists()


def test_the_caption_model_round_trips_through_the_mixin(tmp_path):
    torch.manual_seed(0)
    config = CaptionConfig(image=ImageEncoderConfig(image_size=32, patch_size=8, width=32, depth=1, num_heads=2), dim=32, depth=1, heads=4)
    model = CaptionModel.from_config(config, ["a red circle", "a blue square"]).eval()
    assert isinstance(model, ModelHubMixin)
    folder = model.save_pretrained(tmp_path / "captions")
    loaded = CaptionModel.from_pretrained(folder)
    pixels, ids = torch.rand(2, 3, 32, 32), model.tokenize(["a red circle", "a blue square"])
    torch.testing.assert_close(loaded(pixels, ids), model(pixels, ids), atol=0, rtol=0)
    card = ModelCard.load(folder / "README.md")
    assert card.data.pipeline_tag == "image-to-text" and "image-captioning" in card.data.tags
    assert "caption decoder: dim 32, depth 1, heads 4" in card.text


def test_a_name_that_is_no_folder_and_no_repository_id_says_so(tmp_path):
    for name in (tmp_path / "missing", "runs/no/such/model", "no_such_folder"):
        with pytest.raises(FileNotFoundError, match="model folder not found"):
            VLFuseModel.from_pretrained(name)


# ------------------------------------------------------------------------------ Hub repositories
def test_a_repository_in_the_hub_cache_loads_offline_with_the_same_answers(saved, tmp_path):
    """``from_pretrained("OWNER/NAME")`` with ``HF_HUB_OFFLINE=1`` and the snapshot in ``HF_HOME``'s cache."""
    model, batch, folder = saved
    home = tmp_path / "hf_home"
    cache_snapshot(home / "hub", REPO_ID, folder)
    [repo] = scan_cache_dir(home / "hub").repos  # the Hub's own reader of its cache accepts the layout
    assert repo.repo_id == REPO_ID and [r.commit_hash for r in repo.revisions] == [COMMIT]
    torch.save({"batch": batch, "logits": logits(model, batch)}, tmp_path / "expected.pt")
    script = f"""
import json, sys, torch
sys.path.insert(0, {str(REPO / 'tests')!r})
from conftest import logits
from vlfuse import Predictor, VLFuseModel
expected = torch.load({str(tmp_path / 'expected.pt')!r}, weights_only=True)
results = {{}}
for revision in (None, {COMMIT!r}):
    model = VLFuseModel.from_pretrained({REPO_ID!r}, revision=revision)
    results[str(revision)] = torch.equal(logits(model, expected["batch"]), expected["logits"])
results["predictor answers"] = Predictor.from_pretrained({REPO_ID!r}).answers
try:
    VLFuseModel.from_pretrained("someone/not-cached")
except FileNotFoundError as err:
    results["missing"] = str(err)
print(json.dumps(results))
"""
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    assert results["None"] and results[COMMIT], "the snapshot answers as the folder it was made of"
    assert results["predictor answers"] == model.answers
    assert "\n" not in results["missing"] and "someone/not-cached" in results["missing"]
    assert "HF_HUB_OFFLINE" in results["missing"]  # the Hub's reason


def test_a_changed_file_in_the_hub_cache_is_refused_by_the_folder_checks(saved, tmp_path):
    model, _, folder = saved
    snapshot = cache_snapshot(tmp_path / "hub", REPO_ID, folder)
    answers = (snapshot / "answers.json").resolve()
    answers.write_text(json.dumps(list(reversed(model.answers))))
    with pytest.raises(ValueError, match="answers.json does not match .*config.json"):
        VLFuseModel.from_pretrained(REPO_ID, cache_dir=tmp_path / "hub", local_files_only=True)


def test_a_snapshot_may_link_into_its_repositorys_blobs_but_a_folder_not_out_of_itself(saved, tmp_path):
    """The cache's links stay inside the repository's cache folder; a plain folder's files stay inside it."""
    _, _, folder = saved
    snapshot = cache_snapshot(tmp_path / "hub", REPO_ID, folder)
    assert model_io.containing_folder(snapshot) == snapshot.parent.parent
    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    outside = tmp_path / "answers.json"
    shutil.move(copy / "answers.json", outside)
    (copy / "answers.json").symlink_to(outside)
    with pytest.raises(ValueError, match=f"answers.json is a link to {outside}, outside {copy}"):
        VLFuseModel.from_pretrained(copy)
    config = json.loads((copy / "config.json").read_text())
    del config["files"]  # a folder of before the digests: its links are checked all the same
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"answers.json is a link to {outside}, outside {copy}"):
        VLFuseModel.from_pretrained(copy)

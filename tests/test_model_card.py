"""The model card a folder gets at export, filled from the run, and ``vlfuse card`` (issue 35).

A tiny ``vlfuse fit --test_after_fit true`` on 8 easy-VQA images writes the folder whose card is
checked against what the run measured; ``vlfuse prune`` writes the card of the pruned model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard

from vlfuse import model_card
from vlfuse.cli import main as vlfuse_main
from vlfuse.commands.lightning import run_lightning
from vlfuse.model import VLFuseModel

from conftest import REPO, make_model, tiny_cli_args

EASY_VQA = REPO / "configs" / "easy_vqa.yaml"
FORMAT_1 = REPO / "tests" / "fixtures" / "format_v1" / "pool_swiglu_gate_pruned" / "model"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny fit that tests its best checkpoint: the CLI object and the exported folder."""
    root = tmp_path_factory.mktemp("fit")
    cli = run_lightning(["fit", "--config", str(EASY_VQA), *tiny_cli_args(root), "--trainer.max_epochs=2", "--test_after_fit=true"])
    return cli, root / "model"


def card_of(folder: Path) -> ModelCard:
    return ModelCard.load(folder / "README.md")


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


# ------------------------------------------------------------------------------ the card of a fit
def test_the_metadata_holds_library_task_data_and_the_metrics_the_run_measured(fitted):
    cli, folder = fitted
    data = card_of(folder).data
    assert data.library_name == "vlfuse" and data.pipeline_tag == "visual-question-answering"
    assert {"vlfuse", "vision-language", "model_hub_mixin"} <= set(data.tags)
    assert data.datasets == ["easy_vqa"] and data.metrics == ["accuracy"]
    results = {(r.dataset_split, r.metric_type): r.metric_value for r in data.eval_results}
    assert set(results) == {("val", "accuracy"), ("test", "accuracy")}
    tested = cli.trainer.callback_metrics["test/acc"]  # the test after the fit, on the best checkpoint
    assert results["test", "accuracy"] == pytest.approx(float(tested), abs=1e-6)
    assert results["val", "accuracy"] == pytest.approx(float(cli.trainer.checkpoint_callback.best_model_score), abs=1e-6)


def test_the_sections_are_filled_from_the_run(fitted):
    cli, folder = fitted
    text = card_of(folder).text
    model = VLFuseModel.from_pretrained(folder)  # the card leaves the folder's checks passing
    for heading in ("## Architecture", "## Parameters", "## Training", "## Evaluation", "## Software", "## Intended use", "## Limits"):
        assert heading in text
    assert f"{sum(p.numel() for p in model.parameters()):,} parameters" in text
    assert f"| fuser | {sum(p.numel() for p in model.fuser.parameters()):,} |" in text
    assert f"- answers: {len(model.answers)} (`answers.json`)" in text
    assert "timm `vit_tiny_r_s16_p8_224`, trained from scratch" in text
    train, test = (cli.datamodule.records(split) for split in ("train", "test"))
    assert f"| train | {len(train)} | {sum(len(r.questions) for r in train)} |" in text
    assert f"| test | {len(test)} | {sum(len(r.questions) for r in test)} |" in text
    command = next(line for line in text.splitlines() if line.startswith("Command: "))
    assert command.startswith("Command: `vlfuse fit --config ") and command.endswith(" --test_after_fit=true`")
    assert f"Seed: {yaml.safe_load(EASY_VQA.read_text())['seed_everything']}." in text
    assert f"| test | accuracy | {float(cli.trainer.callback_metrics['test/acc']):.4f} |" in text
    config = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert config["model"]["architecture"]["fusion_dim"] == 32 and config["test_after_fit"] is True
    assert f"| torch | {torch.__version__} |" in text
    assert "## How to use" in text and 'Predictor.from_pretrained("FOLDER_OR_OWNER/NAME")' in text


def test_the_card_names_the_commit_vlfuse_ran_from(fitted):
    _, folder = fitted
    recorded = json.loads((folder / "config.json").read_text())["card"]["run"]["software"]["commit"]
    inside = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if inside.returncode != 0:
        assert recorded is None
        return
    commit = recorded.removesuffix("+changes")
    assert f"vlfuse commit: {recorded}." in card_of(folder).text
    ancestor = subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", commit, "HEAD"])
    assert ancestor.returncode == 0, f"{commit} is not a commit of this checkout"


# ------------------------------------------------------------------------------ vlfuse card
def test_vlfuse_card_prints_the_card_and_write_brings_it_back(fitted, tmp_path, capsys):
    _, folder = fitted
    copy = copy_of(folder, tmp_path)
    written = (copy / "README.md").read_text()
    assert vlfuse_main(["card", str(copy)]) == 0
    printed = capsys.readouterr()
    assert printed.out == written and printed.err == ""

    (copy / "README.md").write_text("# notes\n")
    assert vlfuse_main(["card", str(copy)]) == 0
    assert "README.md differs from this card" in capsys.readouterr().err
    (copy / "README.md").unlink()
    assert vlfuse_main(["card", str(copy), "--write"]) == 0
    assert (copy / "README.md").read_text() == written
    assert not [p.name for p in copy.iterdir() if p.name.startswith(".")], "no temporary file is left"
    assert VLFuseModel.from_pretrained(copy).answers == VLFuseModel.from_pretrained(folder).answers


def test_a_folder_of_format_1_gets_a_card_and_still_answers_the_same(tmp_path, capsys):
    copy = copy_of(FORMAT_1, tmp_path)
    before = VLFuseModel.from_pretrained(copy).state_dict()
    assert vlfuse_main(["card", str(copy), "--write"]) == 0
    text = (copy / "README.md").read_text()
    assert "No run is recorded" in text and "buffers included" in text
    assert "pruned heads: layer 0: 3 heads" in text  # the format-1 architecture read as parts
    after = VLFuseModel.from_pretrained(copy).state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_vlfuse_card_refuses_what_is_no_model_folder_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert vlfuse_main(["card", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not the config of a vlfuse model folder" in err


# ------------------------------------------------------------------------------ metrics follow the weights
def test_a_run_record_travels_with_unchanged_weights_and_is_disowned_by_changed_ones(fitted, tmp_path):
    _, folder = fitted
    model = VLFuseModel.from_pretrained(folder)
    assert model.run_record is not None and model.run_record.command.startswith("vlfuse fit")
    again = model.save_pretrained(tmp_path / "again")  # e.g. what push_to_hub uploads
    assert card_of(again).data.eval_results == card_of(folder).data.eval_results
    with torch.no_grad():
        model.head.classifier[-1].bias.add_(1.0)
    changed = model.save_pretrained(tmp_path / "changed")
    card = card_of(changed)
    assert card.data.eval_results is None and card.data.metrics is None
    assert "These metrics were measured on other weights" in card.text
    assert "vlfuse fit --config" in card.text  # the run is still told


def test_a_model_saved_outside_a_run_says_it_has_no_record(tmp_path):
    model, _ = make_model()
    card = card_of(model.save_pretrained(tmp_path / "m"))
    assert "No run is recorded" in card.text and card.data.eval_results is None


def test_a_malformed_card_record_is_one_line_naming_config_json(fitted, tmp_path):
    _, folder = fitted
    copy = copy_of(folder, tmp_path)
    meta = json.loads((copy / "config.json").read_text())
    meta["card"]["run"]["seed"] = "zero"
    (copy / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"config.json: card.run.seed must be of type int, got str"):
        VLFuseModel.from_pretrained(copy)


@pytest.mark.parametrize("damage", [
    lambda meta: meta["card"]["parameters"].update(parts=[1, 2]),
    lambda meta: meta["card"]["parameters"].update(total="many"),
    lambda meta: meta["config"].update(image="vit"),
], ids=["parts a list", "total a word", "image a string"])
def test_vlfuse_card_of_a_config_with_values_of_another_kind_is_one_line(fitted, tmp_path, capsys, damage):
    _, folder = fitted
    copy = copy_of(folder, tmp_path)
    meta = json.loads((copy / "config.json").read_text())
    damage(meta)
    (copy / "config.json").write_text(json.dumps(meta))
    card = (copy / "README.md").read_bytes()
    assert vlfuse_main(["card", str(copy), "--write"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and f"{copy / 'config.json'}: cannot describe the model from it" in error
    assert (copy / "README.md").read_bytes() == card  # the card as it was


# ------------------------------------------------------------------------------ vlfuse prune
def test_vlfuse_prune_writes_the_card_of_the_pruned_model(fitted, tmp_path, capsys):
    _, folder = fitted
    out = tmp_path / "pruned"
    argv = ["prune", "--model", str(folder), "--config", str(EASY_VQA), "--score", "weight_norm", "--fraction", "0.5",
            "--limit-images", "8", "--latency-repeats", "1", "--latency-questions", "8", "--out", str(out)]
    assert vlfuse_main(argv) == 0
    printed = capsys.readouterr().out
    after = next(line for line in printed.splitlines() if line.startswith("| val accuracy, pruned"))
    card = card_of(out)
    [result] = card.data.eval_results
    assert result.dataset_split == "val" and f"{result.metric_value:.2%}" == after.split("|")[3].strip()
    text = card.text
    assert f"Command: `vlfuse {' '.join(argv)}`" in text
    assert f"Started from: {folder} (trained by `vlfuse fit --config" in text
    assert "pruned 8 of 16 cross-attention heads: fraction 0.5 of the weight_norm scores on val" in text
    assert "pruned heads: layer 0: 8 heads" in text
    assert VLFuseModel.from_pretrained(out).run_record.command == f"vlfuse {' '.join(argv)}"

from pathlib import Path

import pytest
import torch
import yaml

from vlfuse.cli import main, run_lightning
from vlfuse.model import VLFuseModel

from conftest import REPO, SHARED, tiny_cli_args

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
DATA_NEEDS = {
    "shapes": SHARED / "data" / "shapes",
    "vqa_v2": REPO / "data" / "vqa_v2",
    "imagefolder": REPO / "data" / "imagefolder",  # tests/test_imagefolder.py trains it on a folder it makes
}


def needs_data(config: Path):
    for key, path in DATA_NEEDS.items():
        if key in config.stem and not path.exists():
            pytest.skip(f"{config.name} needs {path}")


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_validates_against_the_cli(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    assert "class_path" in capsys.readouterr().out


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_trains_for_one_batch(config, tmp_path):
    needs_data(config)
    map_program = yaml.safe_load(config.read_text())["model"]["architecture"].get("readout") == "map_program"
    tiny = tiny_cli_args(tmp_path, map_program=map_program)
    cli = run_lightning(["fit", "--config", str(config), *tiny, "--trainer.fast_dev_run=true"])
    assert cli.trainer.global_step == 1
    model = VLFuseModel.from_pretrained(tmp_path / "model")
    assert model.answers == cli.datamodule.answers


def _fit(root, *extra):
    args = ["fit", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_cli_args(root), "--test_after_fit=false"]
    return run_lightning([*args, *extra])


def test_same_seed_gives_same_metrics(tmp_path):
    first = _fit(tmp_path / "a", "--trainer.max_epochs=1")
    second = _fit(tmp_path / "b", "--trainer.max_epochs=1")
    metrics = ("val/loss", "val/acc", "train/loss_epoch")
    for name in metrics:
        assert first.trainer.callback_metrics[name] == second.trainer.callback_metrics[name], name


def test_resumed_run_continues_from_its_checkpoint(tmp_path):
    first = _fit(tmp_path, "--trainer.max_epochs=1")
    steps_per_epoch = first.trainer.global_step
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.exists()
    # Lightning checkpoints hold plain types only: they load without unpickling code.
    assert "vlfuse_answers" in torch.load(last, weights_only=True)
    resumed = _fit(tmp_path, "--trainer.max_epochs=2", f"--ckpt_path={last}")
    assert resumed.trainer.current_epoch == 2
    assert resumed.trainer.global_step == 2 * steps_per_epoch


def test_fit_then_test_prints_accuracy_and_model_dir(tmp_path, capsys):
    _fit(tmp_path, "--trainer.max_epochs=1", "--test_after_fit=true")
    out = capsys.readouterr().out
    assert f"model saved to {tmp_path / 'model'}" in out
    assert "vlfuse: test accuracy" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model.architecture.fusion_dimm=3"], "model.architecture.fusion_dimm"),
        (["--model.architecture.image.name=vit_bogus"], "timm does not know the image encoder 'vit_bogus'"),
        (["--data.init_args.image_size=48"], "data.image_size (48) differs"),
    ],
)
def test_bad_configs_give_one_line_errors(tmp_path, capsys, extra, message):
    args = ["fit", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_cli_args(tmp_path)]
    try:
        code = main([*args, "--trainer.fast_dev_run=true", *extra])
    except SystemExit as exit_info:  # the argument parser exits by itself
        code = exit_info.code
    assert code != 0
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_test_runs_a_saved_pruned_model_given_by_directory(tmp_path):
    from vlfuse.analysis.data import build_datamodule, load_batches
    from vlfuse.analysis.head_scores import evaluate

    _fit(tmp_path / "fit", "--trainer.max_epochs=1")
    model = VLFuseModel.from_pretrained(tmp_path / "fit" / "model")
    model.prune_heads({0: range(8)})
    model.save_pretrained(tmp_path / "pruned")
    cli = run_lightning([
        "test", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_cli_args(tmp_path / "test"),
        f"--model.pretrained={tmp_path / 'pruned'}",
    ])
    assert cli.model.model.fusion.blocks[0].cross_attn.num_heads == 8
    datamodule = build_datamodule(REPO / "configs" / "easy_vqa.yaml", ["--data.init_args.limit_images=8"])
    expected = evaluate(model, load_batches(datamodule, model, "test"))
    assert abs(float(cli.trainer.callback_metrics["test/acc"]) - expected) < 1e-6


def test_a_pretrained_model_with_other_answers_is_refused(tmp_path, capsys):
    from conftest import tiny_config

    VLFuseModel.from_config(tiny_config(), ["yes", "no"], ["is it?"]).save_pretrained(tmp_path / "other")
    code = main([
        "test", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_cli_args(tmp_path),
        f"--model.pretrained={tmp_path / 'other'}",
    ])
    assert code == 2
    err = capsys.readouterr().err
    assert "answer vocabularies differ" in err and "Traceback" not in err

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from vlfuse.captioning import CaptionModel
from vlfuse.cli import main, run_lightning
from vlfuse.commands import SUBCOMMANDS
from vlfuse.commands.analyze import build_parser as build_analyze_parser
from vlfuse.commands.predict import build_parser as build_predict_parser
from vlfuse.commands.prune import build_parser as build_prune_parser
from vlfuse.fusers import FUSERS
from vlfuse.model import VLFuseModel
from vlfuse.runtime import DEFAULT_DEVICE, DEFAULT_THREADS

from conftest import REPO, SHARED, tiny_cli_args

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
DATA_NEEDS = {
    "shapes": SHARED / "data" / "shapes",
    "vqa_v2": REPO / "data" / "vqa_v2",
    "imagefolder": REPO / "data" / "imagefolder",  # tests/test_imagefolder.py trains it on a folder it makes
    "base_224": REPO / "data" / "imagefolder",  # tests/test_checkpointing.py trains it on a folder it makes
    "streaming": REPO / "shards" / "imagefolder",  # tests/test_streaming.py trains it on shards it converts
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
    model = yaml.safe_load(config.read_text())["model"]
    caption = model.get("class_path", "").startswith("vlfuse.captioning")
    fuser = None if caption else FUSERS.parse(model["architecture"].get("fuser", {}))
    reads_words = fuser is not None and fuser.reads_words  # text depth 0, as map_program and cell_steps
    tiny = tiny_cli_args(tmp_path, map_program=reads_words, caption=caption)
    cli = run_lightning(["fit", "--config", str(config), *tiny, "--trainer.fast_dev_run=true"])
    assert cli.trainer.global_step == 1
    if caption:
        assert CaptionModel.from_pretrained(tmp_path / "model").config.dim == 16
        return
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


def test_last_checkpoint_is_the_last_epochs_even_when_that_epoch_is_not_the_best(tmp_path):
    # lr 0: the second epoch's val accuracy equals the first's, so only the first is the best
    run = _fit(tmp_path, "--trainer.max_epochs=2", "--model.lr=0")
    assert "epoch=0-" in run.trainer.checkpoint_callback.best_model_path
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (1, run.trainer.global_step)


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
    assert main([*args, "--trainer.fast_dev_run=true", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.splitlines()) == 1


# ------------------------------------------------------------ the first ten minutes (issue 14)
EASY_VQA = str(REPO / "configs" / "easy_vqa.yaml")


@pytest.mark.parametrize(
    "args, line",
    [
        (["fit", "--config", EASY_VQA, "--model.foo", "1"], "vlfuse: error: unrecognized arguments: --model.foo 1"),
        (["fit", "--config", "no/such.yaml"],
         f"""vlfuse: error: Parser key "config": File does not exist: '{Path.cwd() / 'no' / 'such.yaml'}'"""),
        (["fit"], "vlfuse: error: no data given: give --config configs/easy_vqa.yaml (or any config in configs/)"),
        (["test", "--config", EASY_VQA, "--trainer.max_epochs", "abc"],
         """vlfuse: error: Parser key "trainer.max_epochs": invalid value 'abc', expected int or NoneType"""),
    ],
    ids=["unknown key", "missing config file", "fit without config", "bad value"],
)
def test_config_mistakes_print_one_line_without_usage(capsys, args, line):
    assert main(args) == 2
    assert capsys.readouterr().err == line + "\n"


def run_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlfuse.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_subcommand_with_its_whole_description():
    result = run_command("--help")
    assert result.returncode == 0
    words = " ".join(result.stdout.split())  # descriptions are wrapped, not cut
    for name, subcommand in SUBCOMMANDS.items():
        assert f" {name} {' '.join(subcommand.description.split())}" in words
    assert list(SUBCOMMANDS) == ["fit", "validate", "test", "plot", "predict", "caption", "explain", "analyze", "prune", "export", "cache-features", "convert", "card"]


def test_each_subcommand_lives_in_its_own_module_of_vlfuse_commands():
    import importlib

    import vlfuse.cli

    assert vlfuse.cli.SUBCOMMANDS is SUBCOMMANDS  # the dispatcher reads the package's table
    modules = {name: subcommand.module for name, subcommand in SUBCOMMANDS.items()}
    assert modules == {
        "fit": "vlfuse.commands.lightning", "validate": "vlfuse.commands.lightning", "test": "vlfuse.commands.lightning",
        "plot": "vlfuse.commands.plot", "predict": "vlfuse.commands.predict", "caption": "vlfuse.commands.caption",
        "explain": "vlfuse.commands.explain", "analyze": "vlfuse.commands.analyze", "prune": "vlfuse.commands.prune",
        "export": "vlfuse.commands.export", "cache-features": "vlfuse.commands.cache_features", "convert": "vlfuse.commands.convert",
        "card": "vlfuse.commands.card",
    }
    for module in set(modules.values()):
        assert callable(importlib.import_module(module).main), module


def test_misspelled_subcommand_is_one_line_listing_every_subcommand():
    result = run_command("analyse")
    assert result.returncode == 2
    assert result.stderr == (
        "vlfuse: error: unknown subcommand 'analyse' (did you mean 'analyze'?); "
        "the subcommands are fit, validate, test, plot, predict, caption, explain, analyze, prune, export, cache-features, convert, card (vlfuse --help)\n"
    )


def test_help_and_argument_errors_load_neither_torch_nor_lightning():
    code = (
        "import sys\nfrom vlfuse.cli import main\n"
        "codes = [main(['--help']), main(['fitt']), main([])]\n"
        "print(codes, [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-1] == "[0, 2, 2] []"


def test_fit_help_describes_fit_in_our_words(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(SUBCOMMANDS["fit"].description.split()) in out
    assert "--threads" in out


def test_fit_help_gives_one_usage_line_and_one_line_per_trainer_option(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("usage: ") and lines[1] == ""  # not a usage block listing every option again
    trainer = [i for i, line in enumerate(lines) if line.startswith("  --trainer.")]
    assert len(trainer) > 30 and "--trainer.max_epochs MAX_EPOCHS" in "\n".join(lines)
    assert not any(lines[i + 1].startswith("   ") for i in trainer)  # no paragraph under a trainer option
    lr = next(i for i, line in enumerate(lines) if line.startswith("  --model.lr "))
    assert "peak learning rate" in " ".join(lines[lr: lr + 2])  # vlfuse's own options keep their descriptions


def test_fit_threads_sets_torchs_thread_count(tmp_path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _fit(tmp_path, "--trainer.fast_dev_run=true", "--threads=1")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("tool", ["predict", "analyze", "prune"])
def test_tools_share_one_device_and_one_threads_option(tool):
    parser = {"predict": build_predict_parser, "analyze": build_analyze_parser, "prune": build_prune_parser}[tool]()
    options = {action.dest: action for action in parser._actions}
    assert options["device"].default == DEFAULT_DEVICE == "cpu"
    assert options["threads"].default == DEFAULT_THREADS
    assert "accelerator" not in options


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
    assert cli.model.model.fuser.stack.blocks[0].cross_attn.num_heads == 8
    datamodule = build_datamodule(REPO / "configs" / "easy_vqa.yaml", ["--data.init_args.limit_images=8"])
    expected = evaluate(model, load_batches(datamodule, model, "test"))
    assert abs(float(cli.trainer.callback_metrics["test/acc"]) - expected) < 1e-6


def test_a_pretrained_model_is_tested_on_its_own_answers_and_the_others_count_wrong(tmp_path, capsys):
    """easy-VQA's answers beyond a yes/no model's two cannot be given: they are counted wrong, with a warning."""
    from conftest import tiny_config

    VLFuseModel.from_config(tiny_config(), ["yes", "no"], ["is it?"]).save_pretrained(tmp_path / "other")
    code = main([
        "test", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_cli_args(tmp_path),
        f"--model.pretrained={tmp_path / 'other'}",
    ])
    assert code == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vlfuse: warning:")]
    assert len(warnings) == 1 and "have an answer outside the model's 2 ('" in warnings[0] and warnings[0].endswith("counted wrong")

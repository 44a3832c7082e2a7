"""Errors at the edges of training (issue 19): one line naming the problem and the fix, exit status 2.

Cases that need hardware or a network this machine lacks (a GPU, the Hugging Face hub, the
tensorboard package) are simulated with monkeypatch, so they hold on any machine.
"""

import signal
import socket

import pytest
import torch
from huggingface_hub import constants as hub_constants
from lightning.fabric.loggers import tensorboard as fabric_tensorboard
from lightning.pytorch.accelerators import CUDAAccelerator

from vlfuse.cli import main
from vlfuse.encoders import hub
from vlfuse.lit import VLFuseLitModule

from conftest import REPO, tiny_cli_args, tiny_overrides

EASY_VQA = str(REPO / "configs" / "easy_vqa.yaml")
VQA_V2 = str(REPO / "configs" / "vqa_v2.yaml")
SAVED = REPO / "tests" / "fixtures" / "format_v1" / "pool_gelu_leaky_relu"
"""A saved model (its answers are SHAPES', not easy-VQA's) and images to ask it about."""
VQA_V2_ON_CPU = [
    "--trainer.accelerator=cpu", "--trainer.strategy=auto", "--trainer.devices=1", "--trainer.precision=32-true",
]


def error_of(capsys, args: list[str]) -> str:
    """``vlfuse ARGS``' stderr, which must be one line after exit status 2 (besides the epoch lines of a fit
    that trained before it failed)."""
    assert main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("vlfuse: epoch ")]
    assert len(lines) == 1, lines
    return lines[0].strip()


def fit_args(root, *extra: str) -> list[str]:
    return ["fit", "--config", EASY_VQA, *tiny_cli_args(root), *extra]


@pytest.fixture
def hub_unreachable(monkeypatch, tmp_path):
    """No connection to the hub, offline mode off and an empty cache, as on a machine without network."""
    def refuse(*args, **kwargs):
        raise OSError("simulated: network unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *hub.PROXY_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # recorded, so the "1" that offline mode sets is undone after the test


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_limit_images_below_one_is_refused(tmp_path, capsys, limit):
    err = error_of(capsys, fit_args(tmp_path, f"--data.init_args.limit_images={limit}"))
    assert err == f"vlfuse: error: limit_images must be at least 1 (or null for every image), got {limit}"


def test_the_error_inside_a_union_dump_is_the_whole_line(tmp_path, capsys):
    err = error_of(capsys, fit_args(tmp_path, "--data.init_args.batch_size=0"))
    assert err == "vlfuse: error: batch_size must be at least 1, got 0"


def test_vlfuse_debug_shows_the_traceback_instead(tmp_path, monkeypatch):
    monkeypatch.setenv("VLFUSE_DEBUG", "1")
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        main(fit_args(tmp_path, "--data.init_args.batch_size=0"))


@pytest.mark.parametrize("subcommand", ["test", "validate"])
def test_evaluating_a_saved_model_without_data_says_which_to_give_and_writes_nothing(
    tmp_path, monkeypatch, capsys, subcommand
):
    monkeypatch.chdir(tmp_path)
    err = error_of(capsys, [subcommand, f"--model.pretrained={SAVED / 'model'}"])
    assert err == "vlfuse: error: no data given: give --config configs/easy_vqa.yaml (or any config in configs/)"
    assert list(tmp_path.iterdir()) == []


def test_the_base_datamodule_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = error_of(capsys, ["test", "--data=vlfuse.datamodules.VQADataModule", f"--model.pretrained={SAVED / 'model'}"])
    assert err.startswith("vlfuse: error: VQADataModule is the base class of the datamodules: give a dataset with --config")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "option, line",
    [
        ("--model.architecture.fusion_depth=1",
         "model.architecture.fusion_depth is an option of the model's parts now: model.architecture.fuser.depth"),
        ("--model.architecture.mlp_type=gelu",
         "model.architecture.mlp_type is an option of the model's parts now: model.architecture.fuser.mlp"),
        ("--model.architecture.readout=pool",
         "model.architecture.readout is an option of the model's parts now: model.architecture.head.type (pool: pooled; "
         "bilinear), or fuser.type map_program, cell_steps or cell_moves with head.type existence"),
    ],
    ids=["fusion_depth", "mlp_type", "readout"],
)
def test_a_flat_model_option_of_before_the_parts_says_where_it_went(tmp_path, capsys, option, line):
    err = error_of(capsys, fit_args(tmp_path, "--trainer.fast_dev_run=true", option))
    assert err == f"vlfuse: error: {line} (docs/training.md#the-models-options)"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "option, line",
    [
        ("--model.architecture.fuser.depth=0", "fuser.depth must be between 1 and 1024, got 0"),
        ('--model.architecture.fuser={"type": "nope"}',
         "fuser.type must be one of ['cell_moves', 'cell_steps', 'fusion_stack', 'map_program'], got 'nope'"),
    ],
    ids=["depth 0", "unknown type"],
)
def test_a_bad_part_option_is_one_line_naming_it(tmp_path, capsys, option, line):
    err = error_of(capsys, fit_args(tmp_path, "--trainer.fast_dev_run=true", option))
    assert err == f"vlfuse: error: {line}"


def test_a_missing_weights_file_is_named(tmp_path, capsys):
    err = error_of(capsys, fit_args(
        tmp_path, "--trainer.fast_dev_run=true", "--model.architecture.image.pretrained=true",
        "--model.architecture.image.weights_file=missing.safetensors",
    ))
    assert err == "vlfuse: error: model.architecture.image.weights_file: no such file 'missing.safetensors'"


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_a_gpu_accelerator_without_a_gpu_is_one_line(tmp_path, monkeypatch, capsys, accelerator):
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    err = error_of(capsys, fit_args(tmp_path, "--trainer.fast_dev_run=true", f"--trainer.accelerator={accelerator}"))
    assert err == (
        "vlfuse: error: --trainer.accelerator: no GPU on this machine (torch.cuda.is_available() is False); "
        "use --trainer.accelerator cpu (or auto)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_predict_on_cuda_without_a_gpu_is_one_line(capsys):
    args = ["predict", "--model", str(SAVED / "model"), "--image", str(SAVED / "image0.png"),
            "--question", "what shape is it?", "--device", "cuda"]
    err = error_of(capsys, args)
    assert err == "vlfuse: error: --device: no GPU on this machine (torch.cuda.is_available() is False); use --device cpu"


def test_an_unreachable_hub_turns_on_offline_mode(hub_unreachable):
    hub.use_cache_if_hub_unreachable()
    assert hub_constants.HF_HUB_OFFLINE


def test_behind_a_proxy_the_hub_is_not_judged_by_a_direct_connection(hub_unreachable, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    hub.use_cache_if_hub_unreachable()
    assert not hub_constants.HF_HUB_OFFLINE


@pytest.mark.parametrize(
    "option, name, local",
    [
        ("--model.architecture.text.name", "vlfuse-tests/no-such-encoder", "--model.architecture.text.name DIR"),
        ("--model.architecture.image.pretrained", "vit_tiny_r_s16_p8_224", "--model.architecture.image.weights_file FILE"),
    ],
    ids=["text", "image"],
)
def test_weights_the_hub_cannot_give_say_how_to_give_them_locally(tmp_path, capsys, hub_unreachable, option, name, local):
    value = "true" if option.endswith("pretrained") else name
    err = error_of(capsys, fit_args(tmp_path, "--trainer.fast_dev_run=true", f"{option}={value}"))
    assert err.startswith(
        f"vlfuse: error: {option[2:]}: could not fetch the pretrained weights of {name!r} from the Hugging Face hub "
        "(no connection, not in the cache); give them locally: " + local
    )
    assert "HF_HUB_OFFLINE=1" in err


def test_a_missing_tensorboard_says_which_extra_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fabric_tensorboard, "_TENSORBOARD_AVAILABLE", False)
    monkeypatch.setattr(fabric_tensorboard, "_TENSORBOARDX_AVAILABLE", False)
    args = ["fit", "--config", VQA_V2, *VQA_V2_ON_CPU, f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}"]
    err = error_of(capsys, args)
    assert err == (
        "vlfuse: error: TensorBoardLogger needs the tensorboard package, which is not installed: "
        "pip install 'vlfuse[tensorboard]' (or log to CSV: --trainer.logger lightning.pytorch.loggers.CSVLogger)"
    )


def test_missing_vqa_v2_data_says_which_data_dir_to_set(tmp_path, capsys):
    args = ["fit", "--config", VQA_V2, *VQA_V2_ON_CPU, "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}", f"--data.init_args.data_dir={tmp_path / 'vqa_v2'}"]
    err = error_of(capsys, args)
    assert err.startswith(f"vlfuse: error: VQA v2 file not found: {tmp_path / 'vqa_v2'}")
    assert "set --data.init_args.data_dir to the folder that holds VQA v2" in err


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor=val/accuracy"],
         "EarlyStopping monitor 'val/accuracy' is not a logged metric; the logged metrics are: "),
        (["--checkpoint.monitor=val/accuracy"],
         "ModelCheckpoint monitor 'val/accuracy' is not a logged metric; the logged metrics are: "),
    ],
    ids=["EarlyStopping", "ModelCheckpoint"],
)
def test_a_monitor_naming_no_logged_metric_lists_the_logged_ones(tmp_path, capsys, extra, line):
    err = error_of(capsys, fit_args(tmp_path, "--trainer.max_epochs=1", "--trainer.limit_train_batches=1", *extra))
    assert err.startswith("vlfuse: error: " + line)
    assert "val/acc" in err.split("the logged metrics are: ")[1].split(", ")


@pytest.fixture
def sigint_restored():
    """Lightning ignores SIGINT after a Ctrl-C (so that a second one cannot break its shutdown)."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def test_ctrl_c_during_fit_names_the_last_checkpoint_and_how_to_resume(tmp_path, monkeypatch, capsys, sigint_restored):
    train = VLFuseLitModule.training_step

    def interrupted_in_epoch_two(self, batch, batch_idx):
        if self.current_epoch == 1:
            raise KeyboardInterrupt
        return train(self, batch, batch_idx)

    monkeypatch.setattr(VLFuseLitModule, "training_step", interrupted_in_epoch_two)
    with pytest.raises(SystemExit) as stopped:
        main(fit_args(tmp_path, "--trainer.max_epochs=2", "--test_after_fit=false"))
    assert stopped.value.code != 0
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_file()
    steps = torch.load(last, weights_only=True)["global_step"]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vlfuse:")]
    assert lines[0].startswith("vlfuse: epoch 1/2: ")  # the epoch line of the epoch that finished
    assert lines[1:] == [
        f"vlfuse: interrupted (Ctrl-C) at step {steps}; the last checkpoint is {last}: resume with the same command "
        "and --ckpt_path last (docs/resume.md; kill -TERM <pid> instead of Ctrl-C saves one at the current step)"
    ]


def test_fast_dev_run_keeps_out_of_the_real_run_folder(tmp_path):
    args = ["fit", "--config", EASY_VQA, *tiny_overrides(), f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false", "--trainer.fast_dev_run=true"]
    assert main(args) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fast_dev_run"]
    assert (tmp_path / "fast_dev_run" / "latest" / "model" / "config.json").is_file()

"""bf16-mixed on the CPU: the autocast path of mixed-precision training, where CI can run it.

tests/test_gpu.py runs bf16-mixed and 16-mixed on a GPU and skips without one; Lightning also runs
``--trainer.precision bf16-mixed`` on a CPU (16-mixed it refuses there), with the same autocast
around every forward. So this module checks, on any machine, what a mixed-precision run needs of
vlfuse's code: every layer runs under bf16 autocast (masks, the bilinear readout, the loss), the
losses are finite, the last checkpoint resumes and tests, and the exported model keeps float32
weights and answers as the float32 model it is.
"""

import math

import easy_vqa
import pytest
import torch

from vlfuse.cli import run_lightning
from vlfuse.inference import Predictor
from vlfuse.model import VLFuseModel

from conftest import REPO, tiny_cli_args

CONFIG = str(REPO / "configs" / "easy_vqa.yaml")
PRECISION = "bf16-mixed"


def lightning(subcommand: str, root, *extra: str):
    """``vlfuse <subcommand>`` of the tiny easy-VQA model on the CPU in bf16-mixed, writing under ``root``."""
    args = [subcommand, "--config", CONFIG, *tiny_cli_args(root), "--trainer.accelerator=cpu",
            f"--trainer.precision={PRECISION}", *extra]
    return run_lightning(args + (["--test_after_fit=false"] if subcommand == "fit" else []))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, one_thread):
    """``(run folder, the fit's CLI)`` of one epoch of the tiny model in bf16-mixed."""
    root = tmp_path_factory.mktemp("bf16")
    return root, lightning("fit", root, "--trainer.max_epochs=1")


def test_a_bf16_mixed_fit_on_the_cpu_trains_with_finite_losses(fitted):
    _, cli = fitted
    assert cli.trainer.precision == PRECISION
    assert cli.trainer.global_step > 0
    for name in ("train/loss_epoch", "val/loss"):
        assert math.isfinite(float(cli.trainer.callback_metrics[name])), name


def test_its_checkpoint_resumes_and_tests(fitted):
    root, first = fitted
    last = root / "checkpoints" / "last.ckpt"
    steps = first.trainer.global_step
    resumed = lightning("fit", root, "--trainer.max_epochs=2", f"--ckpt_path={last}")
    assert resumed.trainer.global_step == 2 * steps
    assert math.isfinite(float(resumed.trainer.callback_metrics["train/loss_epoch"]))
    tested = lightning("test", root / "test", f"--ckpt_path={last}")
    assert math.isfinite(float(tested.trainer.callback_metrics["test/loss"]))
    assert 0 <= float(tested.trainer.callback_metrics["test/acc"]) <= 1


def test_its_exported_model_keeps_float32_weights_and_answers_under_autocast_as_in_float32(fitted):
    root, _ = fitted
    model = VLFuseModel.from_pretrained(root / "model")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    images = list(easy_vqa.get_train_image_paths().values())[:4]
    questions = ["what shape is in the image?", "what color is the shape?", "is there a red shape?", "is there a circle?"]
    predictor = Predictor(model, device="cpu")
    k = len(model.answers)
    in_float32 = predictor.predict(images, questions, top_k=k)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        in_bf16 = predictor.predict(images, questions, top_k=k)
    assert in_bf16 != in_float32  # autocast reached the model: bf16 rounds the scores
    for bf16, fp32 in zip(in_bf16, in_float32):
        scores = {entry["answer"]: entry["score"] for entry in bf16["top_k"]}
        assert set(scores) == {entry["answer"] for entry in fp32["top_k"]}
        for entry in fp32["top_k"]:
            assert abs(scores[entry["answer"]] - entry["score"]) <= 2e-2, entry["answer"]  # bf16 keeps 8 bits of mantissa

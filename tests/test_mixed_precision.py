"""Mixed precision: ``vlfuse fit`` in bf16-mixed and 16-mixed end to end, and the fusion stack in bf16.

A mixed-precision fit trains the tiny easy-VQA model; its loss is finite, its last checkpoint resumes
and tests, its exported folder keeps float32 weights, and the ``Predictor`` answers with it as in
float32. On a GPU: bf16-mixed and 16-mixed, answering on the GPU as on the CPU. On the CPU, where CI
runs it: bf16-mixed (16-mixed Lightning turns into bf16-mixed there), answering under bf16 autocast as without,
the same autocast that wraps every forward of a mixed-precision run. The GPU cases and the fusion
stack's bf16 tests need CUDA and are skipped without it; ``scripts/gpu_check.sh`` runs this module
on one GPU.
"""

import math
from contextlib import nullcontext

import easy_vqa
import pytest
import torch

from vlfuse.cli import run_lightning
from vlfuse.inference import Predictor
from vlfuse.layers import FusionStack
from vlfuse.model import VLFuseModel

from conftest import REPO, tiny_cli_args

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: mixed precision runs on GPUs (scripts/gpu_check.sh)"
)

CONFIG = str(REPO / "configs" / "easy_vqa.yaml")
RUNS = [
    pytest.param(("cpu", "bf16-mixed"), id="cpu-bf16-mixed"),
    pytest.param(("gpu", "bf16-mixed"), id="gpu-bf16-mixed", marks=needs_cuda),
    pytest.param(("gpu", "16-mixed"), id="gpu-16-mixed", marks=needs_cuda),
]
"""``(accelerator, precision)`` of each fit."""
SCORE_TOLERANCE = {"gpu": 1e-2, "cpu": 2e-2}
"""How far a score (softmax probability) may be from the CPU's in float32: on the GPU in float32, or on
the CPU under bf16 autocast (bf16 keeps 8 bits of mantissa)."""


def lightning(subcommand: str, root, accelerator: str, precision: str, *extra: str):
    """``vlfuse <subcommand>`` of the tiny easy-VQA model on one ``accelerator`` in ``precision``, writing under ``root``."""
    args = [subcommand, "--config", CONFIG, *tiny_cli_args(root), f"--trainer.accelerator={accelerator}", "--trainer.devices=1",
            f"--trainer.precision={precision}", *extra]
    return run_lightning(args + (["--test_after_fit=false"] if subcommand == "fit" else []))


@pytest.fixture(scope="module", params=RUNS)
def fitted(request, tmp_path_factory, one_thread):
    """``(accelerator, precision, run folder, the fit's CLI)`` of one epoch of the tiny model."""
    accelerator, precision = request.param
    root = tmp_path_factory.mktemp(f"{accelerator}-{precision}")
    return accelerator, precision, root, lightning("fit", root, accelerator, precision, "--trainer.max_epochs=1")


def test_a_mixed_precision_fit_trains_with_finite_losses(fitted):
    _, precision, _, cli = fitted
    assert cli.trainer.precision == precision
    assert cli.trainer.global_step > 0
    for name in ("train/loss_epoch", "val/loss"):
        assert math.isfinite(float(cli.trainer.callback_metrics[name])), name


def test_its_checkpoint_resumes_and_tests(fitted):
    accelerator, precision, root, first = fitted
    last = root / "checkpoints" / "last.ckpt"
    steps = first.trainer.global_step
    resumed = lightning("fit", root, accelerator, precision, "--trainer.max_epochs=2", f"--ckpt_path={last}")
    assert resumed.trainer.global_step == 2 * steps
    assert math.isfinite(float(resumed.trainer.callback_metrics["train/loss_epoch"]))
    tested = lightning("test", root / "test", accelerator, precision, f"--ckpt_path={last}")
    assert math.isfinite(float(tested.trainer.callback_metrics["test/loss"]))
    assert 0 <= float(tested.trainer.callback_metrics["test/acc"]) <= 1


def test_its_exported_model_keeps_float32_weights_and_answers_as_in_float32(fitted):
    accelerator, _, root, _ = fitted
    model = VLFuseModel.from_pretrained(root / "model")
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # mixed precision keeps float32 weights
    images = list(easy_vqa.get_train_image_paths().values())[:4]
    questions = ["what shape is in the image?", "what color is the shape?", "is there a red shape?", "is there a circle?"]
    k = len(model.answers)
    on_cpu = Predictor(model, device="cpu").predict(images, questions, top_k=k)
    if accelerator == "gpu":
        answered = Predictor.from_pretrained(root / "model", device="cuda").predict(images, questions, top_k=k)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            answered = Predictor(model, device="cpu").predict(images, questions, top_k=k)
        assert answered != on_cpu  # autocast reached the model: bf16 rounds the scores
    tolerance = SCORE_TOLERANCE[accelerator]
    for ours, cpu in zip(answered, on_cpu):
        scores = {entry["answer"]: entry["score"] for entry in ours["top_k"]}
        assert set(scores) == {entry["answer"] for entry in cpu["top_k"]}
        for entry in cpu["top_k"]:
            assert abs(scores[entry["answer"]] - entry["score"]) <= tolerance, entry["answer"]
        best, second = cpu["top_k"][:2]
        if best["score"] - second["score"] > 2 * tolerance:  # not a tie within the tolerance
            assert ours["answer"] == cpu["answer"]


def stack_inputs(device: str):
    """Text of 6 questions about 3 images (padded, one question sharing an image with another), as the model's."""
    g = torch.Generator().manual_seed(0)
    text, images = torch.randn(6, 20, 768, generator=g), torch.randn(3, 197, 768, generator=g)
    text_mask = torch.arange(20)[None, :] < torch.tensor([20, 12, 7, 16, 9, 3])[:, None]
    image_index = torch.tensor([0, 0, 1, 2, 2, 1])
    return [t.to(device) for t in (text, images, text_mask, image_index)]


def gradients(stack: FusionStack, device: str, autocast_dtype: torch.dtype | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stack's output and the gradients of its weights and both inputs, after a backward of a fixed output gradient."""
    text, images, text_mask, image_index = stack_inputs(device)
    dtype = next(stack.parameters()).dtype
    text, images = text.to(dtype).requires_grad_(), images.to(dtype).requires_grad_()
    stack.zero_grad(set_to_none=True)
    autocast = nullcontext() if autocast_dtype is None else torch.autocast(device, dtype=autocast_dtype)
    with autocast:
        out, _ = stack(text, images, text_mask=text_mask, image_index=image_index)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
    return out.detach().float(), [p.grad.float() for p in stack.parameters()] + [text.grad.float(), images.grad.float()]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@needs_cuda
@pytest.mark.parametrize("how", ["autocast", "bf16 weights"])
def test_the_fusion_stack_runs_forward_and_backward_in_bf16(how):
    """At a real width (768, 16 heads, 197 image tokens), under bf16 autocast (as bf16-mixed trains) or with
    its weights in bf16: finite gradients for every weight and input, close to float32's."""
    torch.manual_seed(0)
    stack = FusionStack(2, 768, 16, mlp_layer="swiglu", output_gate=True, self_attention=False, gated=False).cuda()
    out_fp32, expected = gradients(stack, "cuda", None)
    if how == "autocast":
        out, grads = gradients(stack, "cuda", torch.bfloat16)
        assert all(p.grad.dtype == torch.float32 for p in stack.parameters())
    else:
        out, grads = gradients(stack.to(torch.bfloat16), "cuda", None)
        assert all(p.grad.dtype == torch.bfloat16 for p in stack.parameters())
    assert all(torch.isfinite(g).all() for g in grads)
    assert relative_error(out, out_fp32) < 5e-2
    errors = [relative_error(g, e) for g, e in zip(grads, expected)]
    assert max(errors) < 1e-1, errors

"""Mixed precision on a GPU: ``vlfuse fit`` in bf16-mixed and 16-mixed end to end, the fusion stack in bf16.

Every test needs CUDA and is skipped without it (CI and the CPU machines have none);
``scripts/gpu_check.sh`` runs this module on one GPU. A mixed-precision fit trains the tiny easy-VQA
model on the GPU; its loss is finite, its last checkpoint resumes and tests, its exported folder
loads, and the ``Predictor`` answers with it on the GPU as on the CPU in float32.
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

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: mixed precision runs on GPUs (scripts/gpu_check.sh)"
)

CONFIG = str(REPO / "configs" / "easy_vqa.yaml")
PRECISIONS = ["bf16-mixed", "16-mixed"]
SCORE_TOLERANCE = 1e-2
"""How far a score (softmax probability) of the GPU may be from the CPU's."""


def lightning(subcommand: str, root, precision: str, *extra: str):
    """``vlfuse <subcommand>`` of the tiny easy-VQA model on one GPU in ``precision``, writing under ``root``."""
    args = [subcommand, "--config", CONFIG, *tiny_cli_args(root), "--trainer.accelerator=gpu", "--trainer.devices=1",
            f"--trainer.precision={precision}", *extra]
    return run_lightning(args + (["--test_after_fit=false"] if subcommand == "fit" else []))


@pytest.fixture(scope="module", params=PRECISIONS)
def fitted(request, tmp_path_factory):
    """``(precision, run folder, the fit's CLI)`` of one epoch of the tiny model."""
    root = tmp_path_factory.mktemp(request.param)
    return request.param, root, lightning("fit", root, request.param, "--trainer.max_epochs=1")


def test_a_mixed_precision_fit_trains_with_finite_losses(fitted):
    precision, _, cli = fitted
    assert cli.trainer.precision == precision
    assert cli.trainer.global_step > 0
    for name in ("train/loss_epoch", "val/loss"):
        assert math.isfinite(float(cli.trainer.callback_metrics[name])), name


def test_its_checkpoint_resumes_and_tests(fitted):
    precision, root, first = fitted
    last = root / "checkpoints" / "last.ckpt"
    steps = first.trainer.global_step
    resumed = lightning("fit", root, precision, "--trainer.max_epochs=2", f"--ckpt_path={last}")
    assert resumed.trainer.global_step == 2 * steps
    assert math.isfinite(float(resumed.trainer.callback_metrics["train/loss_epoch"]))
    tested = lightning("test", root / "test", precision, f"--ckpt_path={last}")
    assert math.isfinite(float(tested.trainer.callback_metrics["test/loss"]))
    assert 0 <= float(tested.trainer.callback_metrics["test/acc"]) <= 1


def test_its_exported_model_answers_on_the_gpu_as_on_the_cpu(fitted):
    _, root, _ = fitted
    model = VLFuseModel.from_pretrained(root / "model")
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # mixed precision keeps float32 weights
    images = list(easy_vqa.get_train_image_paths().values())[:4]
    questions = ["what shape is in the image?", "what color is the shape?", "is there a red shape?", "is there a circle?"]
    k = len(model.answers)
    on_gpu = Predictor.from_pretrained(root / "model", device="cuda").predict(images, questions, top_k=k)
    on_cpu = Predictor(model, device="cpu").predict(images, questions, top_k=k)
    for gpu, cpu in zip(on_gpu, on_cpu):
        scores = {entry["answer"]: entry["score"] for entry in gpu["top_k"]}
        for entry in cpu["top_k"]:
            assert abs(scores[entry["answer"]] - entry["score"]) <= SCORE_TOLERANCE, entry["answer"]
        best, second = cpu["top_k"][:2]
        if best["score"] - second["score"] > 2 * SCORE_TOLERANCE:  # not a tie within the tolerance
            assert gpu["answer"] == cpu["answer"]


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

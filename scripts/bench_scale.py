"""How a real-size training step's time and memory grow: image tokens, fusion depth and width, batch.

A training step here is what ``vlfuse fit`` runs: forward, cross-entropy, backward and a fused AdamW
step of a ``VLFuseModel`` built from a ``VLFuseConfig`` (no datamodule), on synthetic inputs of real
shapes: random pixels ``(B, 3, S, S)`` and one question per image of random words, tokenized by the
model's own processor (``--preset base``: 30 words, 32 tokens with [CLS] and [SEP]; 3,129 answers as
VQA v2's). The base point is the real-size preset of configs/base_224.yaml, written out here
(:data:`PRESETS`): ViT-B/16 at 224 px (197 image tokens), a 12-layer 768-wide BERT from scratch, 6
fusion blocks of 768 with 16 heads (self-attention, GELU MLP, dropout 0.1), the pooled head.

Parts (``--parts``, all by default):

    points         every point of the sweeps (``--sweep``: one factor at a time around the base point)
                   in each variant (``--variants``): plain, checkpointed (activation checkpointing on
                   every part, ``VLFuseModel.set_grad_checkpointing``), frozen (both encoders frozen),
                   frozen+checkpointed (frozen encoders, the fuser checkpointed). On a CPU each point
                   runs in a fresh process; on CUDA in this one.
    split          the base point (plain): forward+backward of each stage on its own (image encoder
                   with its projection, text encoder with its projection, the fuser with the image
                   keys/values, the head with the loss) and the AdamW step, timed round-robin
                   beside the whole step (the stages' inputs are computed once beforehand).
    fusion         the fusion stack alone, forward+backward (weights and both inputs get gradients),
                   B = --batch questions of 32 tokens over as many images: the preset's fuser at the
                   base point's tokens, and the cross-attention-only fuser (``self_attention:
                   false``) at every tokens value of the sweep (its growth exponent), round-robin
                   beside a bare matrix product.
    checkpointing  the base point in one process: each repetition runs forward+backward unchecked and
                   checkpointed from the same weights (order alternating), compares the gradients,
                   then takes one AdamW step; a variant's step time is its forward+backward plus
                   that AdamW step.

What is measured:

- step time: median and worst of ``--repeats`` steps after ``--warmup`` untimed ones (on CUDA, each
  timed call ends with a synchronisation);
- kept for backward: the bytes of the tensors autograd saves for backward during the step's
  forward (``torch.autograd.graph.saved_tensors_hooks``; each storage once; parameters left out):
  the activation memory, deterministic;
- weights + grads + AdamW: the bytes of the parameters, the trainable ones' gradients and AdamW's
  state, which checkpointing cannot shrink;
- peak memory. On a CPU, points: the whole process's peak resident memory (``ru_maxrss`` at the end
  of a fresh process), and that less the resident memory once the model, the optimizer state and
  the gradients are allocated (the AdamW state and gradients are made with one step on zero
  gradients, before any forward: a warm-up step's freed activations would stay in malloc's heap and
  hide in that baseline); checkpointing: the resident memory's high-water mark during each
  variant's forward+backward, reset before it (``malloc_trim``, then ``/proc/self/clear_refs``),
  and that less the resident memory at its start. On CUDA, ``torch.cuda.max_memory_allocated``
  less the memory allocated at the start. Gradients stay allocated between steps
  (``zero_grad(set_to_none=False)``) so that they are part of the baseline;
- page faults (checkpointing): the minor page faults of each variant's forward+backward and the CPU
  seconds it spent in the kernel (``getrusage``): memory that malloc handed back to the system
  between steps is faulted in, page by page, again;
- FLOP/s: floating-point operations counted by ``torch.utils.flop_counter.FlopCounterMode``
  (matrix products and attention, including the CPU's flash-attention kernels, which it does not
  know by itself: :data:`CPU_ATTENTION_FLOPS`), for a whole step at batch 1 times B (model FLOPs:
  checkpointing's recomputation is not counted), divided by the step's time, as a share of the
  FLOP/s of a bare matrix product of the preset's size (:attr:`Preset.matmul`, the fusion stack's
  key/value projection at the base point) timed round-robin with the same cases, in the same dtype
  (nanoGPT's ``estimate_mfu``, with a measured peak);
- growth exponents: the slope of a least-squares line through log time against log factor.

Prints markdown tables and the issue's targets (benchmark goals, not assertions); ``--out DIR``
writes each table as a CSV and a log-log plot, ``bench_scale.png``. Examples (real size: minutes
per step on 2 CPU cores)::

    .venv/bin/python scripts/bench_scale.py --parts fusion checkpointing --batch 32 --threads 2
    .venv/bin/python scripts/bench_scale.py --parts points --sweep tokens depth width batch --batch 8 --threads 2 --out runs/bench_scale
    .venv/bin/python scripts/bench_scale.py --preset tiny --out /tmp/bench_scale          # seconds: a smoke test
    .venv/bin/python scripts/bench_scale.py --device cuda --dtype bfloat16 --quick        # on a GPU, under a minute
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from vlfuse.runtime import prefer_passive_waits

prefer_passive_waits()  # as in vlfuse fit: waiting OpenMP threads sleep (read when torch loads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import add_threads_argument, set_threads  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count  # noqa: E402

from vlfuse.analysis.tables import markdown_table  # noqa: E402
from vlfuse.analysis.timing import Timings, time_interleaved  # noqa: E402
from vlfuse.fusers import FUSERS  # noqa: E402
from vlfuse.model import VLFuseConfig, VLFuseModel  # noqa: E402

FACTORS = ("tokens", "depth", "width", "batch")
"""What a point is made of: image tokens (CLS + patches), fusion depth, fusion width, batch (images = questions)."""
VARIANTS = ("plain", "checkpointed", "frozen", "frozen+checkpointed")
PARTS = ("points", "split", "fusion", "checkpointing")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REPLY = "bench_scale:"
"""Prefix of a point worker's answer on its standard output."""
MiB = 2**20


@dataclass(frozen=True)
class Point:
    """One model size and batch: image tokens, fusion depth, fusion width, batch."""

    tokens: int
    depth: int
    width: int
    batch: int


@dataclass(frozen=True)
class Preset:
    """Everything of a model but the factors of a :class:`Point`, the base point and the sweeps.

    Attributes:
        name: as ``--preset`` names it.
        image: ``ImageEncoderConfig`` fields (``image_size`` comes from the point's tokens).
        patch: the image encoder's patch side in pixels.
        text: ``TextEncoderConfig`` fields.
        fuser: the fuser's options (``depth`` comes from the point).
        head: the head's options.
        words: words per question (its tokens: these and [CLS], [SEP]).
        vocabulary: made-up words the tokenizer knows.
        answers: answer classes.
        base: the base point.
        sweeps: each factor's values.
        matmul: ``(M, K, N)`` of the reference matrix product ``(M, K) @ (K, N)``.
    """

    name: str
    image: dict
    patch: int
    text: dict
    fuser: dict
    head: dict
    words: int
    vocabulary: int
    answers: int
    base: Point
    sweeps: dict[str, tuple[int, ...]]
    matmul: tuple[int, int, int]


PRESETS = {
    "base": Preset(
        name="base",
        image=dict(name="vit_base_patch16_224", pretrained=False, patch_size=None, width=None, depth=None, num_heads=None),
        patch=16,
        text=dict(model_type="bert", width=768, depth=12, num_heads=12, max_length=32),
        fuser=dict(type="fusion_stack", heads=16, mlp_ratio=2.0, mlp="gelu", output_gate=False, dropout=0.1,
                   self_attention=True, gated=False),
        head=dict(type="pooled", dropout=0.1),
        words=30,
        vocabulary=5000,
        answers=3129,
        base=Point(tokens=197, depth=6, width=768, batch=32),
        sweeps=dict(tokens=(65, 197, 577), depth=(2, 6, 12), width=(256, 768), batch=(8, 32)),
        matmul=(32 * 197, 768, 2 * 768),
    ),
    "tiny": Preset(
        name="tiny",
        image=dict(name="vit_tiny_patch16_224", pretrained=False, patch_size=8, width=32, depth=1, num_heads=2),
        patch=8,
        text=dict(model_type="bert", width=32, depth=1, num_heads=2, max_length=8),
        fuser=dict(type="fusion_stack", heads=16, mlp_ratio=2.0, mlp="gelu", output_gate=False, dropout=0.1,
                   self_attention=True, gated=False),
        head=dict(type="pooled", dropout=0.1),
        words=6,
        vocabulary=50,
        answers=10,
        base=Point(tokens=17, depth=2, width=32, batch=4),
        sweeps=dict(tokens=(5, 17), depth=(1, 2), width=(16, 32), batch=(2, 4)),
        matmul=(4 * 17, 32, 64),
    ),
}
"""``base``: the real-size preset (configs/base_224.yaml's model); ``tiny``: seconds, for tests and smoke runs."""


# ------------------------------------------------------------------------------------------ models and batches
def image_size(tokens: int, patch: int) -> int:
    """The image side whose patch grid plus the CLS token makes ``tokens`` image tokens.

    Raises:
        ValueError: ``tokens`` is not a square number of patches plus one (naming ``--tokens``).
    """
    side = math.isqrt(max(tokens - 1, 0))
    if tokens < 2 or side * side != tokens - 1:
        raise ValueError(f"--tokens {tokens}: image tokens are a square grid of patches plus CLS (5, 17, 65, 197, 577, ...)")
    return side * patch


def architecture(preset: Preset, point: Point, variant: str) -> VLFuseConfig:
    """The config of ``point`` in ``variant`` (frozen variants freeze both encoders; nothing is cached)."""
    frozen = variant.startswith("frozen")
    image = dict(preset.image, image_size=image_size(point.tokens, preset.patch), freeze=frozen, cache_features=False)
    text = dict(preset.text, freeze=frozen, cache_features=False)
    fuser = dict(preset.fuser, depth=point.depth)
    return VLFuseConfig.from_dict(dict(image=image, text=text, fusion_dim=point.width, fuser=fuser, head=dict(preset.head)))


@dataclass
class Batch:
    """A training batch of real shapes: one question per image, all questions of the same length."""

    pixel_values: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def first(self, count: int) -> "Batch":
        """The first ``count`` images with their questions."""
        return Batch(*(t[:count] for t in (self.pixel_values, self.input_ids, self.attention_mask, self.labels)))


def words(preset: Preset) -> list[str]:
    """The made-up words of the preset's vocabulary."""
    return [f"w{i}" for i in range(preset.vocabulary)]


def build(preset: Preset, point: Point, variant: str, device: torch.device, seed: int = 0) -> tuple[VLFuseModel, Batch]:
    """The model of ``point`` in ``variant`` (seeded weights, training mode, on ``device``; checkpointing
    off: :func:`set_variant` switches it) and a random batch for it."""
    torch.manual_seed(seed)
    vocabulary = words(preset)
    model = VLFuseModel.from_config(architecture(preset, point, variant), [f"a{i}" for i in range(preset.answers)],
                                    [" ".join(vocabulary)])
    model.train().to(device)
    draw = random.Random(seed)
    questions = [" ".join(draw.choices(vocabulary, k=preset.words)) for _ in range(point.batch)]
    tokens = model.processor.tokenize(questions)
    side = model.config.image.image_size
    generator = torch.Generator().manual_seed(seed)
    batch = Batch(
        pixel_values=torch.rand(point.batch, 3, side, side, generator=generator),
        input_ids=tokens["input_ids"],
        attention_mask=tokens["attention_mask"],
        labels=torch.randint(0, preset.answers, (point.batch,), generator=generator),
    )
    return model, Batch(*(t.to(device) for t in vars(batch).values()))


def set_variant(model: VLFuseModel, variant: str) -> None:
    """Activation checkpointing as ``variant`` has it: every trainable part, or none.

    Raises:
        SystemExit: this vlfuse has no ``VLFuseModel.set_grad_checkpointing`` (naming ``--variants``).
    """
    if not hasattr(model, "set_grad_checkpointing"):
        raise SystemExit("error: --variants: this vlfuse has no VLFuseModel.set_grad_checkpointing (issue 32 item 1)")
    model.set_grad_checkpointing(variant.endswith("checkpointed"))


def autocast(device: torch.device, dtype: torch.dtype):
    """``torch.autocast`` to ``dtype`` on ``device``; nothing for float32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def loss_of(model: VLFuseModel, batch: Batch) -> torch.Tensor:
    """The training loss of ``batch``: cross-entropy of the answer scores (in float32)."""
    logits = model(batch.pixel_values, batch.input_ids, batch.attention_mask).logits
    return F.cross_entropy(logits.float(), batch.labels)


def new_optimizer(model: VLFuseModel) -> torch.optim.Optimizer:
    """Fused AdamW over the trainable weights, as ``vlfuse fit``'s optimizer, with its state and the
    gradients allocated: one step on zero gradients, before any forward."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.05, fused=True)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return optimizer


def train_step(model: VLFuseModel, optimizer: torch.optim.Optimizer, batch: Batch, dtype: torch.dtype) -> None:
    """Forward, loss, backward and the AdamW step; the gradients stay allocated, zeroed."""
    with autocast(batch.labels.device, dtype):
        loss = loss_of(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def static_bytes(model: VLFuseModel, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the weights, the trainable weights' gradients and the optimizer's state."""
    weights = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    return weights + grads + state


class KeptForBackward:
    """Bytes of the tensors autograd saves for backward while it is entered (each storage once; not
    the model's parameters): what a forward keeps alive until backward. A checkpointed block keeps
    its inputs, not what it computes (its recomputation, in backward, is outside)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "KeptForBackward":
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)


# ------------------------------------------------------------------------------------------ FLOPs, rates, fits
def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}
"""The CPU's scaled-dot-product attention kernels, counted as torch counts its CUDA ones (the two
products forward; the recomputed scores and four products backward)."""


def count_flops(run: Callable[[], object]) -> int:
    """Floating-point operations of ``run()`` (matrix products and attention; a multiply-add is 2)."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        run()
    return counter.get_total_flops()


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The slope of the least-squares line through ``(log x, log y)``: ``y ~ x ** slope``.

    Raises:
        ValueError: fewer than two distinct ``xs``, lengths that differ, or a value that is not positive.
    """
    if len(xs) != len(ys) or len(set(xs)) < 2 or min(*xs, *ys) <= 0:
        raise ValueError(f"an exponent needs two or more distinct positive x and positive y, got x={list(xs)}, y={list(ys)}")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def matmul_case(preset: Preset, device: torch.device, dtype: torch.dtype) -> tuple[Callable[[], object], int]:
    """The reference product ``(M, K) @ (K, N)`` of the preset, in ``dtype``, and its FLOPs ``2MKN``."""
    m, k, n = preset.matmul
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(m, k, generator=generator).to(device, dtype)
    b = torch.randn(k, n, generator=generator).to(device, dtype)
    return (lambda: torch.mm(a, b)), 2 * m * k * n


def clock_for(device: torch.device) -> Callable[[], float]:
    """Seconds; on CUDA after the device finished what it was given."""
    if device.type != "cuda":
        return time.perf_counter

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronized


def rate_shares(timings: Timings, case, flops: int, mm_flops: int) -> list[float]:
    """Per repetition: ``case``'s FLOP/s as a share of the reference product's in the same repetition."""
    return [(flops / t) / (mm_flops / m) for t, m in zip(timings.samples[case], timings.samples["matmul"])]


# ------------------------------------------------------------------------------------------ memory
def current_rss() -> int | None:
    """This process's resident memory in bytes (Linux), else ``None``."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * resource.getpagesize()


@dataclass(frozen=True)
class Faults:
    """This process's minor page faults and CPU seconds in the kernel so far (``getrusage``); subtract two.

    A step that allocates memory the allocator gave back to the system faults every page of it in again
    (on Linux the kernel zeroes each one): a cost of memory, not of arithmetic.
    """

    minor: int
    kernel_s: float

    @classmethod
    def now(cls) -> "Faults":
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return cls(usage.ru_minflt, usage.ru_stime)

    def __sub__(self, other: "Faults") -> "Faults":
        return Faults(self.minor - other.minor, self.kernel_s - other.kernel_s)


def max_rss() -> int:
    """The process's peak resident memory so far, in bytes (``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """The peak memory of a stretch of work in this process: ``start()``, the work, ``stop()``.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU (Linux): the resident memory's high-water mark
    (``VmHWM``), reset at ``start`` after malloc gave its free memory back (``malloc_trim``);
    elsewhere nothing (``None``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.at_start: int | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.at_start = torch.cuda.memory_allocated(self.device)
            return
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.at_start = None
            return
        self.at_start = current_rss()

    def stop(self) -> tuple[int | None, int | None]:
        """``(peak, peak above the start)`` in bytes since :meth:`start`; ``(None, None)`` unknown."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.at_start is None:
            return None, None
        else:
            status = Path("/proc/self/status").read_text()
            peak = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
        return peak, peak - self.at_start


# ------------------------------------------------------------------------------------------ the parts
@dataclass
class Settings:
    """What every part needs: the preset, where and how to run, how often."""

    preset: str
    device: str
    dtype: str
    repeats: int
    warmup: int
    threads: int | None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def measure_point(settings: Settings, point: Point, variant: str) -> dict:
    """One point in one variant: weights, memory, step times, FLOP/s (a row of the points table)."""
    preset, device, dtype = PRESETS[settings.preset], settings.torch_device, settings.torch_dtype
    model, batch = build(preset, point, variant, device)
    with autocast(device, dtype):  # model FLOPs, before any checkpointing, at batch 1
        flops_one = count_flops(lambda: loss_of(model, batch.first(1)).backward())
    model.zero_grad(set_to_none=True)
    optimizer = new_optimizer(model)
    set_variant(model, variant)
    static = static_bytes(model, optimizer)
    matmul, mm_flops = matmul_case(preset, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        baseline = current_rss()
    kept = KeptForBackward(model)

    def step() -> None:
        if not kept.storages:  # the first step's forward, warm-up or not, counts what it keeps
            with kept:
                with autocast(device, dtype):
                    loss = loss_of(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        else:
            train_step(model, optimizer, batch, dtype)

    timings = time_interleaved({"step": step, "matmul": matmul}, settings.repeats, settings.warmup, clock=clock_for(device))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else max_rss()
    flops = flops_one * point.batch
    shares = rate_shares(timings, "step", flops, mm_flops)
    steps = timings.samples["step"]
    return dict(
        **asdict(point), image_size=model.config.image.image_size, variant=variant,
        parameters=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        static_mib=static / MiB, kept_mib=kept.bytes / MiB,
        baseline_mib=None if baseline is None else baseline / MiB, peak_mib=peak / MiB,
        peak_above_baseline_mib=None if baseline is None else (peak - baseline) / MiB,
        step_s=statistics.median(steps), step_s_worst=max(steps), gflop_per_step=flops / 1e9,
        gflops=flops / statistics.median(steps) / 1e9, matmul_share=statistics.median(shares), matmul_share_worst=min(shares),
        samples_s=steps, error=None,
    )


def measure_split(settings: Settings, point: Point) -> list[dict]:
    """Forward+backward of each stage of the plain model on its own, and the AdamW step, beside the whole step."""
    preset, device, dtype = PRESETS[settings.preset], settings.torch_device, settings.torch_dtype
    model, batch = build(preset, point, "plain", device)
    optimizer = new_optimizer(model)
    mask = batch.attention_mask.bool()
    with torch.no_grad(), autocast(device, dtype):
        image_tokens = model.embed_images(batch.pixel_values)
        text = model.encode_questions(batch.input_ids, batch.attention_mask)
        fused = model.fuse(text, mask, model.image_context(image_tokens)).output
    image_tokens, text, fused = (t.float().requires_grad_() for t in (image_tokens, text, fused))

    def backward_of(run: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def call() -> None:
            with autocast(device, dtype):
                out = run()
            out.backward(torch.ones_like(out))
        return call

    def head() -> torch.Tensor:
        return F.cross_entropy(model.read_out(fused, mask).float(), batch.labels)

    cases = {
        "whole training step": lambda: train_step(model, optimizer, batch, dtype),
        "image encoder + projection": backward_of(lambda: model.embed_images(batch.pixel_values)),
        "text encoder + projection": backward_of(lambda: model.encode_questions(batch.input_ids, batch.attention_mask)),
        "fuser (image keys/values, blocks)": backward_of(lambda: model.fuse(text, mask, model.image_context(image_tokens)).output),
        "head + loss": backward_of(head),
        "AdamW step": optimizer.step,
    }
    timings = time_interleaved(cases, settings.repeats, settings.warmup, clock=clock_for(device))
    whole = timings.samples["whole training step"]
    parts = [name for name in cases if name != "whole training step"]
    sums = [sum(timings.samples[name][i] for name in parts) for i in range(len(whole))]
    rows = [dict(part=name, ms=1e3 * timings.median(name), ms_worst=1e3 * max(timings.samples[name]),
                 share=timings.ratio(name, "whole training step")) for name in cases]
    rows.append(dict(part="sum of the parts", ms=1e3 * statistics.median(sums), ms_worst=1e3 * max(sums),
                     share=statistics.median([s / w for s, w in zip(sums, whole)])))
    return rows


def measure_fusion(settings: Settings, point: Point, tokens_values: Sequence[int]) -> tuple[list[dict], dict]:
    """The fusion stack alone, forward+backward: the preset's fuser at the point's tokens, the
    cross-attention-only fuser at each of ``tokens_values``; FLOP/s as a share of the product's."""
    preset, device, dtype = PRESETS[settings.preset], settings.torch_device, settings.torch_dtype
    tokens_values = sorted(set(tokens_values))
    questions = preset.words + 2
    fusers = {"preset": dict(preset.fuser, depth=point.depth), "cross-attention only": dict(preset.fuser, depth=point.depth, self_attention=False)}
    plan = [("preset", point.tokens)] + [("cross-attention only", tokens) for tokens in tokens_values]
    cases, flops = {}, {}
    for name, tokens in plan:
        torch.manual_seed(0)
        grid = math.isqrt(tokens - 1)
        fuser = FUSERS.parse(fusers[name], "fuser").build(point.width, text_width=point.width, grid_size=(grid, grid))
        fuser.train().to(device)
        text = torch.randn(point.batch, questions, point.width, device=device, requires_grad=True)
        image = torch.randn(point.batch, tokens, point.width, device=device, requires_grad=True)
        mask = torch.ones(point.batch, questions, dtype=torch.bool, device=device)

        def run(fuser=fuser, text=text, image=image, mask=mask) -> None:
            with autocast(device, dtype):
                out = fuser(text, mask, fuser.image_context(image, 1)).output
            out.backward(torch.ones_like(out))

        flops[name, tokens] = count_flops(run)
        cases[name, tokens] = run
    matmul, mm_flops = matmul_case(preset, device, dtype)
    cases["matmul"] = matmul
    timings = time_interleaved(cases, settings.repeats, settings.warmup, clock=clock_for(device))
    rows = []
    for key in plan:
        shares = rate_shares(timings, key, flops[key], mm_flops)
        rows.append(dict(fuser=key[0], tokens=key[1], depth=point.depth, width=point.width, batch=point.batch,
                         gflop=flops[key] / 1e9, ms=1e3 * timings.median(key), ms_worst=1e3 * max(timings.samples[key]),
                         gflops=flops[key] / timings.median(key) / 1e9, matmul_share=statistics.median(shares),
                         matmul_share_worst=min(shares)))
    m, k, n = preset.matmul
    rows.append(dict(fuser=f"bare product ({m}, {k}) @ ({k}, {n})", tokens=None, depth=None, width=None, batch=None,
                     gflop=mm_flops / 1e9, ms=1e3 * timings.median("matmul"), ms_worst=1e3 * max(timings.samples["matmul"]),
                     gflops=mm_flops / timings.median("matmul") / 1e9, matmul_share=1.0, matmul_share_worst=1.0))
    growth = {}
    cross = [("cross-attention only", tokens) for tokens in tokens_values]
    if len(set(tokens_values)) >= 2:
        per_repetition = [fit_exponent(tokens_values, [timings.samples[key][i] for key in cross]) for i in range(settings.repeats)]
        medians = [timings.median(key) for key in cross]
        growth = dict(tokens=list(tokens_values), exponent=fit_exponent(tokens_values, medians),
                      exponent_median=statistics.median(per_repetition), exponent_worst=max(per_repetition),
                      local=[fit_exponent(tokens_values[i:i + 2], medians[i:i + 2]) for i in range(len(cross) - 1)])
    return rows, growth


def measure_checkpointing(settings: Settings, point: Point) -> tuple[list[dict], dict]:
    """Plain and checkpointed forward+backward side by side from the same weights, then one AdamW step,
    each repetition; the order alternates. The first variant's gradients are copied into a buffer
    allocated beforehand (so both variants start with the same memory) and compared with the second's."""
    preset, device, dtype = PRESETS[settings.preset], settings.torch_device, settings.torch_dtype
    model, batch = build(preset, point, "plain", device)
    optimizer = new_optimizer(model)
    static = static_bytes(model, optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    first = [torch.empty_like(p) for p in trainable]
    clock, memory = clock_for(device), PeakMemory(device)
    variants = ("plain", "checkpointed")
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    peaks: dict[str, list[tuple]] = {v: [] for v in variants}
    faults: dict[str, list[Faults]] = {v: [] for v in variants}
    kept, differences = {}, []
    for repetition in range(settings.warmup + settings.repeats):
        for turn, variant in enumerate(variants if repetition % 2 == 0 else variants[::-1]):
            set_variant(model, variant)
            optimizer.zero_grad(set_to_none=False)
            memory.start()
            torch.manual_seed(1)  # the same dropout masks in both
            before = Faults.now()
            start = clock()
            with KeptForBackward(model) as saved, autocast(device, dtype):
                loss = loss_of(model, batch)
            loss.backward()
            elapsed = clock() - start
            faulted = Faults.now() - before
            peak = memory.stop()
            del loss
            with torch.no_grad():
                if turn == 0:
                    torch._foreach_copy_(first, [p.grad for p in trainable])
                else:
                    differences.append(max((a - p.grad).abs().max().item() for a, p in zip(first, trainable)))
            if repetition >= settings.warmup:
                seconds[variant].append(elapsed)
                peaks[variant].append(peak)
                faults[variant].append(faulted)
                kept[variant] = saved.bytes
        start = clock()
        optimizer.step()
        step = clock() - start
        if repetition >= settings.warmup:
            for variant in variants:
                seconds[variant][-1] += step
    set_variant(model, "plain")
    rows = []
    for variant in variants:
        whole = [p for p, _ in peaks[variant] if p is not None]
        above = [a for _, a in peaks[variant] if a is not None]
        ratios = [c / p for c, p in zip(seconds["checkpointed"], seconds["plain"])]
        rows.append(dict(variant=variant, kept_mib=kept[variant] / MiB, static_mib=static / MiB,
                         peak_mib=max(whole) / MiB if whole else None, peak_above_start_mib=max(above) / MiB if above else None,
                         step_s=statistics.median(seconds[variant]), step_s_worst=max(seconds[variant]),
                         time_ratio=statistics.median(ratios) if variant == "checkpointed" else 1.0,
                         time_ratio_worst=max(ratios) if variant == "checkpointed" else 1.0,
                         page_faults=statistics.median(f.minor for f in faults[variant]),
                         kernel_s=statistics.median(f.kernel_s for f in faults[variant])))
    summary = dict(kept_ratio=kept["plain"] / kept["checkpointed"], time_ratio=rows[1]["time_ratio"],
                   paired_seconds=list(zip(seconds["plain"], seconds["checkpointed"])),
                   time_ratio_worst=rows[1]["time_ratio_worst"], max_grad_difference=max(differences),
                   float32=dtype == torch.float32, pairs=len(differences))
    return rows, summary


# ------------------------------------------------------------------------------------------ points in fresh processes
def points_of(base: Point, sweeps: dict[str, Sequence[int]]) -> list[Point]:
    """The base point, then each swept factor's other values, one factor at a time (no repeats)."""
    points = [base]
    for factor, values in sweeps.items():
        for value in values:
            point = replace(base, **{factor: value})
            if point not in points:
                points.append(point)
    return points


def run_point(settings: Settings, point: Point, variant: str) -> dict:
    """:func:`measure_point`: on a CPU in a fresh process (its peak resident memory is the point's
    alone), on CUDA in this one (the device's peak statistics are reset for it)."""
    if settings.torch_device.type == "cuda":
        try:
            return measure_point(settings, point, variant)
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    command = [sys.executable, str(Path(__file__).resolve()), "--worker",
               json.dumps(dict(settings=asdict(settings), point=asdict(point), variant=variant))]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(REPLY):
            return json.loads(line[len(REPLY):])
    return dict(**asdict(point), variant=variant, error=f"the worker stopped with exit status {done.returncode}")


def worker(spec: str) -> None:
    """``--worker SPEC``: measure one point in this (fresh) process and print the row as one line."""
    spec = json.loads(spec)
    settings = Settings(**spec["settings"])
    set_threads(settings.threads)
    row = measure_point(settings, Point(**spec["point"]), spec["variant"])
    print(REPLY + json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------------ reports
POINT_COLUMNS = {
    "tokens": "image tokens", "image_size": "px", "depth": "fusion depth", "width": "fusion width", "batch": "batch",
    "variant": "variant", "parameters": "parameters (M)", "static_mib": "weights+grads+AdamW MiB",
    "kept_mib": "kept for backward MiB", "peak_mib": "whole-process peak MiB", "peak_above_baseline_mib": "peak - baseline MiB",
    "step_s": "step s (median)", "step_s_worst": "step s (worst)", "gflop_per_step": "GFLOP/step",
    "matmul_share": "FLOP/s / product's", "error": "error",
}


def points_table(rows: list[dict], device: torch.device) -> str:
    """The points as a markdown table (parameters in millions)."""
    shown = [dict(row, parameters=row.get("parameters", 0) / 1e6 if row.get("parameters") else None) for row in rows]
    columns = dict(POINT_COLUMNS)
    if device.type == "cuda":
        columns.update(peak_mib="peak allocated MiB", peak_above_baseline_mib="peak - allocated at start MiB")
    shown = [{key: row.get(key) for key in columns} for row in shown]
    return markdown_table(columns, shown, formats=[None, None, None, None, None, None, "{:.1f}", "{:,.0f}", "{:,.0f}",
                                                   "{:,.0f}", "{:,.0f}", "{:.2f}", "{:.2f}", "{:,.1f}", "{:.0%}", None])


def exponents(rows: list[dict], base: Point, sweeps: dict[str, Sequence[int]]) -> list[dict]:
    """Per swept factor and variant: the fitted exponent of step time and of the bytes kept for backward."""
    fits = []
    for factor, values in sweeps.items():
        for variant in dict.fromkeys(row["variant"] for row in rows):
            line = sorted((row[factor], row) for row in rows if row["variant"] == variant and row.get("error") is None
                          and all(row[f] == getattr(base, f) for f in FACTORS if f != factor) and row[factor] in values)
            if len({x for x, _ in line}) < 2:
                continue
            xs = [x for x, _ in line]
            fits.append(dict(factor=factor, variant=variant, values=" ".join(map(str, xs)),
                             time_exponent=fit_exponent(xs, [r["step_s"] for _, r in line]),
                             kept_exponent=fit_exponent(xs, [r["kept_mib"] for _, r in line]) if all(r["kept_mib"] > 0 for _, r in line) else None))
    return fits


@dataclass
class Target:
    """One of the issue's goals as this run measured it."""

    description: str
    measured: float | None
    threshold: float
    at_most: bool = False

    @property
    def status(self) -> str:
        if self.measured is None:
            return "n/a"
        met = self.measured <= self.threshold if self.at_most else self.measured >= self.threshold
        return "PASS" if met else "FAIL"

    def line(self) -> str:
        need = f"need {'<=' if self.at_most else '>='} {self.threshold:g}"
        measured = "not measured" if self.measured is None else f"measured {self.measured:.3g}"
        return f"  {self.status}  {self.description}  ({measured}, {need})"


def targets(results: dict, settings: Settings, point: Point) -> list[Target]:
    """The issue's targets among what this run measured."""
    found = []
    if "checkpointing" in results:
        summary = results["checkpointing"][1]
        where = f"{settings.preset} preset, batch {point.batch}"
        found += [
            Target(f"{where}: activation memory (kept for backward) plain / checkpointed", summary["kept_ratio"], 3.0),
            Target(f"{where}: step time checkpointed / plain (median of paired ratios)", summary["time_ratio"], 1.4, at_most=True),
            Target(f"{where}: gradients equal, max |difference|", summary["max_grad_difference"] if summary["float32"] else None,
                   1e-6, at_most=True),
        ]
    if "fusion" in results:
        rows, growth = results["fusion"]
        preset_row = rows[0]
        kind = "bf16" if settings.dtype == "bfloat16" else "fp32"
        found.append(Target(f"fusion stack alone (preset fuser) at {preset_row['tokens']} tokens, fwd+bwd, {kind}: "
                            "FLOP/s / the product's (median)", preset_row["matmul_share"], 0.5))
        if growth:
            found.append(Target(f"cross-attention-only fusion stack: time exponent over image tokens {growth['tokens']} "
                                "(fit of the medians)", growth["exponent"], 1.1, at_most=True))
    return found


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` (mappings with the same keys) as a CSV file."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows({k: (" ".join(f"{x:.4f}" for x in v) if isinstance(v, list) else v) for k, v in row.items()} for row in rows)


def draw(path: Path, points: list[dict], base: Point, sweeps: dict[str, Sequence[int]], fusion: list[dict] | None) -> None:
    """Log-log panels: step time (top row) and bytes kept for backward (bottom row) against each swept
    factor, one line per variant; and the cross-attention-only fusion stack's time against image tokens."""
    from matplotlib.ticker import NullLocator

    from vlfuse.analysis.figures import new_figure

    swept = [factor for factor, values in sweeps.items() if len({row[factor] for row in points if row[factor] in values}) >= 2]
    cross = [row for row in fusion or [] if row["fuser"] == "cross-attention only"]
    columns, rows = len(swept) + (len(cross) >= 2), 2 if swept else 1
    if columns == 0:
        return
    figure = new_figure(3.0 * columns + 0.4, 2.8 * rows + 0.5)

    def panel(index: int, xs: Sequence[int], xlabel: str, ylabel: str):
        ax = figure.add_subplot(rows, columns, index)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7, which="both")
        return ax

    for c, factor in enumerate(swept):
        values = sorted({row[factor] for row in points if row[factor] in sweeps[factor]})
        top = panel(c + 1, values, factor, "step s")
        bottom = panel(columns + c + 1, values, factor, "kept for backward MiB")
        for variant in dict.fromkeys(row["variant"] for row in points):
            line = sorted((row[factor], row) for row in points if row["variant"] == variant and row.get("error") is None
                          and all(row[f] == getattr(base, f) for f in FACTORS if f != factor))
            if len(line) >= 2:
                top.plot([x for x, _ in line], [r["step_s"] for _, r in line], marker="o", label=variant)
                bottom.plot([x for x, _ in line], [max(r["kept_mib"], 1e-3) for _, r in line], marker="o", label=variant)
        top.legend(fontsize=6)
    if len(cross) >= 2:
        ax = panel(columns, [r["tokens"] for r in cross], "image tokens", "fwd+bwd s")
        ax.plot([r["tokens"] for r in cross], [r["ms"] / 1e3 for r in cross], marker="o", label="fusion stack alone,\ncross-attention only")
        ax.legend(fontsize=6)
    around = ", ".join(f"{f} {getattr(base, f)}" for f in FACTORS)
    figure.suptitle(f"a training step, one factor at a time around {around}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


# ------------------------------------------------------------------------------------------ command line
def parse_sweep(text: str) -> tuple[str, tuple[int, ...] | None]:
    """``FACTOR`` or ``FACTOR=v1,v2,...`` -> ``(factor, values or None: the preset's)``."""
    factor, _, values = text.partition("=")
    if factor not in FACTORS:
        raise argparse.ArgumentTypeError(f"unknown factor {factor!r}: one of {', '.join(FACTORS)}, optionally =v1,v2,...")
    try:
        parsed = tuple(int(v) for v in values.split(",")) if values else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the values are integers separated by commas") from None
    return factor, parsed


QUICK = dict(parts=["split", "fusion", "checkpointing"], sweep=[], repeats=3, warmup=1)
"""``--quick``: the base point plain and checkpointed side by side (gradients, memory, time), its
stage split, and the fusion stack's FLOP/s and growth: under a minute on a GPU."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base",
                        help="base: the real-size preset (configs/base_224.yaml); tiny: seconds, a smoke test (default base)")
    for factor, help_text in (("tokens", "image tokens, CLS + a square grid of patches (65, 197, 577 = 128, 224, 384 px)"),
                              ("depth", "fusion blocks"), ("width", "fusion width (16 heads)"), ("batch", "images, one question each")):
        parser.add_argument(f"--{factor}", type=int, default=None, metavar="N", help=f"the base point's {help_text} (default: the preset's)")
    parser.add_argument("--sweep", nargs="*", type=parse_sweep, default=None, metavar="FACTOR[=V,...]",
                        help=f"factors varied one at a time around the base point, among {', '.join(FACTORS)}, with the "
                             "preset's values or the ones given (default: all four; none: only the base point)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["plain", "checkpointed", "frozen"],
                        help="the variants of every point (default: plain checkpointed frozen)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to run (default: all)")
    parser.add_argument("--repeats", type=int, default=2, metavar="N", help="timed repetitions of every case (default 2)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed repetitions first (default 1)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 (default cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="float32, or bfloat16 under autocast (weights and AdamW stay float32)")
    parser.add_argument("--quick", action="store_true",
                        help="the base point only: --parts split fusion checkpointing, 3 repetitions after 1 warm-up (for a GPU)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="write the tables as CSV files and bench_scale.png here")
    add_threads_argument(parser)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one point, in a fresh process
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if args.worker is not None:
        return args
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be at least 1 and --warmup at least 0, got {args.repeats} and {args.warmup}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device")
    preset = PRESETS[args.preset]
    args.point = Point(**{f: getattr(args, f) or getattr(preset.base, f) for f in FACTORS})
    chosen = [(f, None) for f in FACTORS] if args.sweep is None else args.sweep
    args.sweeps = {factor: values or preset.sweeps[factor] for factor, values in chosen}
    try:
        for tokens in {args.point.tokens, *args.sweeps.get("tokens", ()), *preset.sweeps["tokens"]}:
            image_size(tokens, preset.patch)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the parts, print the tables and targets, write ``--out``; return what was measured."""
    args = parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return {}
    set_threads(args.threads)
    settings = Settings(args.preset, args.device, args.dtype, args.repeats, args.warmup, args.threads)
    device, point = settings.torch_device, args.point
    print(f"torch {torch.__version__}, {args.device}, {args.dtype}, {torch.get_num_threads()} threads; preset {args.preset}, "
          f"base point {asdict(point)}; {args.warmup} warm-up + {args.repeats} timed repetitions", flush=True)
    results: dict = {}
    started = time.perf_counter()
    if "points" in args.parts:
        rows = []
        for p in points_of(point, args.sweeps):
            for variant in args.variants:
                rows.append(run_point(settings, p, variant))
                print(f"  point {asdict(p)} {variant}: {rows[-1].get('error') or '%.2f s a step' % rows[-1]['step_s']} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
        results["points"] = rows
        results["exponents"] = exponents(rows, point, args.sweeps)
    if "split" in args.parts:
        results["split"] = measure_split(settings, point)
    tokens_values = args.sweeps.get("tokens") or PRESETS[args.preset].sweeps["tokens"]
    if "fusion" in args.parts:
        results["fusion"] = measure_fusion(settings, point, tokens_values)
    if "checkpointing" in args.parts:
        results["checkpointing"] = measure_checkpointing(settings, point)
    print(f"measured in {time.perf_counter() - started:.0f} s\n")
    report(results, settings, point, args)
    return results


def report(results: dict, settings: Settings, point: Point, args: argparse.Namespace) -> None:
    """Print every table and the targets; with ``--out``, write the CSV files and the plot."""
    device = settings.torch_device
    tables = {}
    if "points" in results:
        print("Training steps (one factor at a time around the base point):\n")
        print(points_table(results["points"], device) + "\n")
        tables["points"] = results["points"]
        if results["exponents"]:
            print("Fitted exponents (log-log least squares): time ~ factor^a, kept for backward ~ factor^b\n")
            print(markdown_table({"factor": "factor", "variant": "variant", "values": "values", "time_exponent": "time a",
                                  "kept_exponent": "kept b"}, results["exponents"], formats=[None, None, None, "{:.2f}", "{:.2f}"]) + "\n")
            tables["exponents"] = results["exponents"]
    if "split" in results:
        print(f"Where the time of a step goes ({asdict(point)}, plain; each part forward+backward on its own):\n")
        print(markdown_table({"part": "part", "ms": "ms (median)", "ms_worst": "ms (worst)", "share": "share of the whole step"},
                             results["split"], formats=[None, "{:,.0f}", "{:,.0f}", "{:.0%}"]) + "\n")
        tables["split"] = results["split"]
    if "fusion" in results:
        rows, growth = results["fusion"]
        print(f"The fusion stack alone, forward+backward (batch {point.batch}, {PRESETS[settings.preset].words + 2} text tokens, "
              f"depth {point.depth}, width {point.width}, 16 heads):\n")
        print(markdown_table({"fuser": "fuser", "tokens": "image tokens", "gflop": "GFLOP", "ms": "ms (median)", "ms_worst": "ms (worst)",
                              "gflops": "GFLOP/s", "matmul_share": "FLOP/s / product's (median)",
                              "matmul_share_worst": "(worst)"}, rows,
                             formats=[None, None, "{:,.1f}", "{:,.1f}", "{:,.1f}", "{:,.1f}", "{:.0%}", "{:.0%}"]) + "\n")
        if growth:
            steps = ", ".join(f"{a}->{b}: {e:.2f}" for a, b, e in zip(growth["tokens"], growth["tokens"][1:], growth["local"]))
            print(f"cross-attention-only fusion: time ~ tokens^{growth['exponent']:.3f} (fit of the medians); per repetition "
                  f"median {growth['exponent_median']:.3f}, worst {growth['exponent_worst']:.3f}; between neighbours {steps}\n")
        tables["fusion"] = rows
    if "checkpointing" in results:
        rows, summary = results["checkpointing"]
        peak = "peak allocated" if device.type == "cuda" else "whole-process peak RSS"
        print(f"Activation checkpointing on every part ({asdict(point)}), side by side from the same weights:\n")
        print(markdown_table({"variant": "variant", "static_mib": "weights+grads+AdamW MiB", "kept_mib": "kept for backward MiB",
                              "peak_above_start_mib": "peak - start of the step MiB", "peak_mib": f"{peak} MiB",
                              "step_s": "step s (median)", "step_s_worst": "step s (worst)", "time_ratio": "time / plain (median)",
                              "time_ratio_worst": "(worst)", "page_faults": "page faults (median)",
                              "kernel_s": "CPU s in the kernel (median)"}, rows,
                             formats=[None, "{:,.0f}", "{:,.0f}", "{:,.0f}", "{:,.0f}", "{:.2f}", "{:.2f}", "{:.2f}", "{:.2f}",
                                      "{:,.0f}", "{:.1f}"]))
        print(f"\nkept for backward: plain / checkpointed = {summary['kept_ratio']:.2f}x; gradients: max |difference| "
              f"{summary['max_grad_difference']:.3g} over {summary['pairs']} pair(s) of steps, warm-up included")
        pairs = "; ".join(f"{p:.2f} s, {c:.2f} s: {c / p:.2f}x" for p, c in summary["paired_seconds"])
        print(f"each repetition (plain, checkpointed: ratio): {pairs}\n")
        tables["checkpointing"] = rows
    found = targets(results, settings, point)
    if found:
        print("Targets (benchmark goals, not assertions):")
        for target in found:
            print(target.line())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, rows in tables.items():
            write_csv(args.out / f"{name}.csv", rows)
        draw(args.out / "bench_scale.png", results.get("points", []), point, args.sweeps,
             results.get("fusion", ([], {}))[0])
        print(f"\nwrote {', '.join(f'{name}.csv' for name in tables)} and bench_scale.png in {args.out}")


if __name__ == "__main__":
    main()

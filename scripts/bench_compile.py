"""``torch.compile`` against eager: the fusion stack alone and the whole training step, side by side.

Three cases at each of two sizes. In each, the module as it is (eager) and ``torch.compile(module)``
with each of ``--backends`` share their weights and inputs:

    stack fwd        the fusion stack (every block's keys/values, then the blocks), forward, no gradients
    stack fwd+bwd    the same, forward and backward (gradients for the weights and both inputs)
    training step    the model's forward (the compiled module), cross-entropy, backward and a fused AdamW
                     step (eager in both), as in training; the questions are tokenized beforehand

    default  the easy-VQA model (configs/easy_vqa.yaml, ``VLFuseConfig()``): fusion 64 wide, 2 blocks of
             16 heads, 65 image tokens; the first 4 batches of easy-VQA's training split (32 images,
             about 300 questions of up to 12 tokens each: the shapes change from batch to batch)
    real     fusion 768 wide, 16 heads, 197 image tokens, 32 images with one question each (padded to 20
             tokens, real lengths 6-20 at random; one shape): the stack alone has 6 blocks; the training
             step's model has 2, after encoders as wide as ViT-B/16 (768, 12 heads, 224 px) and
             BERT-base, of one block each

The backends: ``inductor`` (torch.compile's default, C++/OpenMP kernels on a CPU) and ``aot_eager``
(the same captured graphs, forward and backward, run by eager kernels). Compiled and eager calls
run the same layers, not the same layout: eager calls pack the real question tokens and group them
by image (docs/attention.md), compiled ones run the padded layout, every position of every question
a token and each question reading its own copy of its image's keys and values. aot_eager against
eager is the cost of that layout; inductor against aot_eager, what inductor's kernels give.

Each case compiles from nothing (``torch._dynamo.reset()``, and a fresh inductor cache for the run
unless ``--warm-cache``): the compiled module is called on each of its batches, twice round, and
"compile s" is the time of those calls less as many steady calls (a batch of a new shape compiles
again, with dynamic sizes, as in a training run). Then eager and the compiled modules are timed
side by side (:func:`vlfuse.analysis.timing.time_interleaved`): one sample is one call on each
batch, and the speed-up is the median and the worst of the paired ratios eager/compiled. Before
that, ``torch._dynamo.explain`` counts the graphs and graph breaks of each compiled module.
OpenMP's waiting threads sleep (``OMP_WAIT_POLICY=PASSIVE`` unless set), as in ``vlfuse fit``.

    flock /tmp/vlfuse_heavy.lock .venv/bin/python scripts/bench_compile.py --threads 2

On a GPU, ``--device cuda`` (each sample ends with a synchronisation). ``--quick``: both sizes
become one tiny model, one repetition: a smoke test.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from vlfuse.runtime import prefer_passive_waits

prefer_passive_waits()  # as in vlfuse fit: waiting OpenMP threads sleep (read when torch loads; inductor's kernels too)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import DEFAULT_CONFIG, add_threads_argument, add_timing_arguments, load_datamodule, set_threads, untrained_model  # noqa: E402
from torch import nn  # noqa: E402

from vlfuse.analysis.tables import markdown_table  # noqa: E402
from vlfuse.analysis.timing import paired_ratio, time_interleaved  # noqa: E402
from vlfuse.data import IGNORE_INDEX  # noqa: E402
from vlfuse.encoders import ImageEncoderConfig, TextEncoderConfig  # noqa: E402
from vlfuse.fusers.fusion_stack import FusionStackConfig  # noqa: E402
from vlfuse.model import VLFuseConfig, VLFuseModel  # noqa: E402

SIZES = ("default", "real")
CASES = ("stack fwd", "stack fwd+bwd", "training step")
DEFAULT_BATCHES = 4
"""easy-VQA training batches of the default size."""


@dataclass(frozen=True)
class Setting:
    """The real-width size (or ``--quick``'s): what is built, and the batches of random inputs.

    Attributes:
        dim, heads: fusion width and heads.
        stack_depth: blocks of the stack timed alone.
        step_depth: blocks of the training step's model.
        images: images per batch, one question each.
        lengths: the padded question length of each batch.
        shortest: the shortest question, in tokens.
        image: the training step's image encoder; its image tokens are the stack's keys.
        text: the training step's text encoder.
    """

    dim: int
    heads: int
    stack_depth: int
    step_depth: int
    images: int
    lengths: tuple[int, ...]
    shortest: int
    image: ImageEncoderConfig
    text: TextEncoderConfig


REAL = Setting(
    dim=768, heads=16, stack_depth=6, step_depth=2, images=32, lengths=(20,), shortest=6,
    image=ImageEncoderConfig(name="vit_base_patch16_224", image_size=224, patch_size=16, width=768, depth=1, num_heads=12),
    text=TextEncoderConfig(model_type="bert", width=768, depth=1, num_heads=12, max_length=32),
)
QUICK = Setting(
    dim=64, heads=16, stack_depth=2, step_depth=2, images=4, lengths=(6, 5), shortest=2,
    image=ImageEncoderConfig(image_size=16, patch_size=4, width=32, depth=1, num_heads=2),
    text=TextEncoderConfig(width=32, depth=1, num_heads=2, max_length=16),
)


@dataclass
class Case:
    """One thing timed eager and compiled.

    Attributes:
        size, name: which size and which case (:data:`SIZES`, :data:`CASES`).
        module: what is compiled.
        batches: ``(args, kwargs)`` of each call of ``module``.
        finish: what follows each call, given the call's output and batch number (backward, a loss...).
        grad: whether the calls record gradients.
    """

    size: str
    name: str
    module: nn.Module
    batches: list[tuple[tuple, dict]]
    finish: Callable[[object, int], None]
    grad: bool

    def runner(self, module: Callable, device: torch.device) -> Callable[[], None]:
        """One sample: ``module`` called on every batch in turn, each call finished."""

        def run() -> None:
            with torch.set_grad_enabled(self.grad):
                for i, (args, kwargs) in enumerate(self.batches):
                    self.finish(module(*args, **kwargs), i)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return run


@dataclass
class Result:
    """One compiled module against eager, for one case."""

    case: Case
    backend: str
    eager_ms: float
    compiled_ms: float
    speedup: float
    worst: float
    compile_s: float
    graphs: int
    late_graphs: int


# ------------------------------------------------------------------------------ the models and inputs
def default_size(device: torch.device) -> tuple[VLFuseModel, nn.Module, list[dict]]:
    """The easy-VQA model, its fusion stack, and the first easy-VQA training batches as its inputs."""
    datamodule = load_datamodule(DEFAULT_CONFIG)
    model = untrained_model(DEFAULT_CONFIG, datamodule).train().to(device)
    batches = []
    for batch in itertools.islice(iter(datamodule.train_dataloader()), DEFAULT_BATCHES):
        inputs = dict(model.processor.batch(batch, device))
        inputs.pop("image_keys")  # no frozen encoder: no cache to name the images for
        batches.append({"inputs": inputs, "labels": batch["labels"].to(device)})
    return model, model.fuser.stack, batches


def real_size(setting: Setting, device: torch.device) -> tuple[VLFuseModel, nn.Module, list[dict]]:
    """The setting's model and stack, and batches of random images and questions (token ids from
    the model's vocabulary, random answers)."""
    config = VLFuseConfig(image=setting.image, text=setting.text, fusion_dim=setting.dim,
                          fuser={"type": "fusion_stack", "depth": setting.step_depth, "heads": setting.heads})
    torch.manual_seed(0)
    questions = ["what shape is in the image", "what color is the shape", "is there a red circle", "is it not blue"]
    model = VLFuseModel.from_config(config, [f"answer {i}" for i in range(100)], questions).train().to(device)
    fuser = FusionStackConfig(depth=setting.stack_depth, heads=setting.heads)
    stack = fuser.build(setting.dim, text_width=setting.dim, grid_size=model.image_encoder.grid_size).stack
    g = torch.Generator().manual_seed(0)
    size, images = setting.image.image_size, setting.images
    batches = []
    for padded in setting.lengths:
        lengths = torch.randint(setting.shortest, padded + 1, (images,), generator=g)
        lengths[0] = padded
        mask = torch.arange(padded)[None, :] < lengths[:, None]  # (images, padded)
        inputs = {
            "pixel_values": torch.rand(images, 3, size, size, generator=g),
            "input_ids": torch.randint(len(model.tokenizer), (images, padded), generator=g) * mask,
            "attention_mask": mask.long(),
        }
        labels = torch.randint(len(model.answers), (images,), generator=g)
        batches.append({"inputs": {k: v.to(device) for k, v in inputs.items()}, "labels": labels.to(device)})
    return model, stack.train().to(device), batches


def stack_batches(width: int, image_tokens: int, model_batches: list[dict]) -> list[tuple[tuple, dict]]:
    """Stack inputs shaped as the model's: random question and image tokens, the batches' masks and image index."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for batch in model_batches:
        mask = batch["inputs"]["attention_mask"].bool()
        images = len(batch["inputs"]["pixel_values"])
        text = torch.randn(*mask.shape, width, generator=g).to(mask.device)
        context = torch.randn(images, image_tokens, width, generator=g).to(mask.device)
        batches.append(((text, context), {"text_mask": mask, "image_index": batch["inputs"].get("image_index")}))
    return batches


# ------------------------------------------------------------------------------ the cases
def cases_of(size: str, model: VLFuseModel, stack: nn.Module, batches: list[dict], image_tokens: int) -> list[Case]:
    """The three cases of one size: ``stack`` alone, then ``model``'s training step."""
    forward = stack_batches(model.config.fusion_dim, image_tokens, batches)
    with_grad = [((t.clone().requires_grad_(), c.clone().requires_grad_()), kw) for (t, c), kw in forward]
    out_grads = [torch.randn_like(t) for (t, _), _ in forward]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # fused, as vlfuse fit's optimizer

    def backward(output, i: int) -> None:
        stack.zero_grad(set_to_none=True)
        for tensor in with_grad[i][0]:
            tensor.grad = None
        output[0].backward(out_grads[i])

    def step(output, i: int) -> None:
        F.cross_entropy(output.logits, batches[i]["labels"], ignore_index=IGNORE_INDEX).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    calls = [((), b["inputs"]) for b in batches]
    return [
        Case(size, "stack fwd", stack, forward, lambda output, i: None, grad=False),
        Case(size, "stack fwd+bwd", stack, with_grad, backward, grad=True),
        Case(size, "training step", model, calls, step, grad=True),
    ]


def explain(case: Case) -> tuple[int, int, list[str]]:
    """``torch._dynamo.explain`` of the module's first call: graphs, graph breaks, and each break's
    reason with the last line of vlfuse's (or the script's) code under it."""
    args, kwargs = case.batches[0]
    with torch.set_grad_enabled(case.grad):
        found = torch._dynamo.explain(case.module)(*args, **kwargs)
    torch._dynamo.reset()
    reasons = []
    for broken in found.break_reasons:
        ours = [frame for frame in broken.user_stack if "vlfuse" in frame.filename or "scripts" in frame.filename]
        where = f" ({os.path.relpath(ours[-1].filename)}:{ours[-1].lineno})" if ours else ""
        reasons.append(f"{broken.reason}{where}")
    return found.graph_count, found.graph_break_count, reasons


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def measure(case: Case, backends: list[str], repeats: int, warmup: int, device: torch.device) -> list[Result]:
    """Compile ``case``'s module with each backend, then time eager and every compiled module side by side."""
    torch._dynamo.reset()  # each case compiles from nothing: its own compile time, no other case's graphs
    runs = {None: case.runner(case.module, device)}  # None: not compiled (a backend may be called "eager")
    compiling = {}
    for backend in backends:
        runs[backend] = case.runner(torch.compile(case.module, backend=backend), device)
        before = graphs_compiled()
        start = time.perf_counter()
        for _ in range(2):  # a batch of a new shape compiles again (dynamic sizes); a second round in case of more
            runs[backend]()
        compiling[backend] = (time.perf_counter() - start, graphs_compiled() - before)
    before = graphs_compiled()
    timings = time_interleaved(runs, repeats, warmup)
    late = graphs_compiled() - before
    calls, eager = len(case.batches), timings.samples[None]
    results = []
    for backend, (first_calls, graphs) in compiling.items():
        samples = timings.samples[backend]
        results.append(Result(
            case, backend, 1e3 * timings.median(None) / calls, 1e3 * timings.median(backend) / calls,
            paired_ratio(eager, samples), min(e / c for e, c in zip(eager, samples)),
            first_calls - 2 * timings.median(backend), graphs, late,
        ))
    return results


def describe(size: str, model: VLFuseModel, stack: nn.Module, batches: list[dict], image_tokens: int) -> str:
    """One line: the size's widths, depths and batches."""
    fuser = model.config.fuser
    questions = [len(b["labels"]) for b in batches]
    lengths = [b["inputs"]["input_ids"].shape[1] for b in batches]
    return (f"{size}: fusion {model.config.fusion_dim} wide, {fuser.heads} heads, {image_tokens} image tokens; the stack "
            f"alone {len(stack)} blocks, the model {fuser.depth} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
            f"parameters); {len(batches)} batches of {len(batches[0]['inputs']['pixel_values'])} images, {questions} "
            f"questions, padded to {lengths} tokens")


def run(args: argparse.Namespace, device: torch.device) -> None:
    """Every case of every size asked for, then the tables."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, backends {', '.join(args.backends)}; {args.repeats} repetitions after "
          f"{args.warmup} warm-up; load average {os.getloadavg()[0]:.1f}", flush=True)
    results, breaks = [], []
    for size in args.sizes:
        if args.quick or size == "real":
            model, stack, batches = real_size(QUICK if args.quick else REAL, device)
        else:
            model, stack, batches = default_size(device)
        with torch.no_grad():
            image_tokens = model.embed_images(batches[0]["inputs"]["pixel_values"][:1]).shape[1]
        print(describe(size, model, stack, batches, image_tokens), flush=True)
        explained = set()
        for case in cases_of(size, model, stack, batches, image_tokens):
            if case.name not in args.cases:
                continue
            if id(case.module) not in explained:
                explained.add(id(case.module))
                graphs, count, reasons = explain(case)
                what = "the fusion stack" if case.module is stack else "the model (VLFuseModel.forward)"
                breaks.append([size, what, graphs, count, "; ".join(reasons) or "none"])
            for r in measure(case, args.backends, args.repeats, args.warmup, device):
                results.append(r)
                print(f"  {case.name}, {r.backend}: eager {r.eager_ms:.1f} ms, compiled {r.compiled_ms:.1f} ms, "
                      f"{r.speedup:.2f}x (worst {r.worst:.2f}x), compile {r.compile_s:.0f} s", flush=True)
    print()
    rows = [[r.case.size, r.case.name, r.backend, r.eager_ms, r.compiled_ms, r.speedup, r.worst, r.compile_s,
             r.graphs if not r.late_graphs else f"{r.graphs} (+{r.late_graphs} while timed)"] for r in results]
    print(markdown_table(["size", "case", "backend", "eager ms", "compiled ms", "speed-up (median)", "(worst)",
                          "compile s", "graphs compiled"], rows,
                         formats=[None, None, None, "{:.1f}", "{:.1f}", "{:.2f}x", "{:.2f}x", "{:.0f}", None]))
    print("\nms: per call (per batch), median of the repetitions; speed-up: eager / compiled, paired per repetition; "
          "graphs compiled: by the first calls (while timed: recompilations, none expected)")
    print("\nGraph breaks (torch._dynamo.explain):\n")
    print(markdown_table(["size", "compiled", "graphs", "graph breaks", "reasons"], breaks))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES), help="sizes to run (default: both)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="cases to run (default: all)")
    parser.add_argument("--backends", nargs="+", default=["inductor", "aot_eager"],
                        help="torch.compile backends, each timed against eager (default: inductor aot_eager)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    add_timing_arguments(parser, repeats=5, warmup=1)
    add_threads_argument(parser)
    parser.add_argument("--warm-cache", action="store_true",
                        help="use inductor's usual on-disk cache, where earlier runs left their kernels (default: a "
                             "fresh one, so that compile times are those of a first run)")
    parser.add_argument("--quick", action="store_true", help="one tiny model, one repetition: a smoke test, not a benchmark")
    args = parser.parse_args()
    set_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device")
    if args.quick:
        args.repeats, args.warmup = 1, 1
    if args.warm_cache:
        run(args, device)
        return
    with tempfile.TemporaryDirectory(prefix="bench_compile_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read at each compile
        run(args, device)


if __name__ == "__main__":
    main()

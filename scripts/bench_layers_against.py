"""This tree's CrossAttention and FusionStack against those of an earlier commit, side by side in one process.

The earlier commit's ``vlfuse/layers/`` (its attention, packing, local-attention and fusion
modules) is read with ``git show`` into a temporary package, ``vlfuse_then``, so that both versions
run in the same process, on the same inputs and with the same weights: the outputs must be equal
(it stops if they are not), and the time ratio then : now is the median of repetitions timed side
by side in a rotating order (:func:`vlfuse.analysis.timing.time_interleaved`)::

    .venv/bin/python scripts/bench_layers_against.py --against 9496edb --threads 2

Cases: ``CrossAttention`` forward (B=32, Lq=32, D=768, 16 heads, Lk=197 and 577) and the default
model's fusion stack (2 blocks of width 64 with 16 heads, SwiGLU, output gate; 320 questions of up
to 12 tokens on 32 images of 65 tokens). A ratio above 1 means this tree is faster.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _common import REPO, add_threads_argument, add_timing_arguments, set_threads

from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import paired_ratio, time_interleaved
from vlfuse.layers import CrossAttention, FusionStack

LAYER_FILES = ("attention", "packing", "local_attention", "fusion")


def import_layers_of(commit: str, into: Path):
    """``vlfuse/layers/`` of ``commit`` as the package ``vlfuse_then.layers`` (only the modules of :data:`LAYER_FILES`)."""
    package = into / "vlfuse_then" / "layers"
    package.mkdir(parents=True)
    (into / "vlfuse_then" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for name in LAYER_FILES:
        try:
            text = subprocess.run(["git", "show", f"{commit}:vlfuse/layers/{name}.py"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout
        except subprocess.CalledProcessError as err:
            raise SystemExit(f"error: --against {commit}: {err.stderr.strip()}") from None
        (package / f"{name}.py").write_text(text.replace("vlfuse.layers.", "vlfuse_then.layers."))
    sys.path.insert(0, str(into))
    from vlfuse_then.layers import attention, fusion

    return attention.CrossAttention, fusion.FusionStack


def cases(then_cross, then_stack) -> dict[str, tuple]:
    """``{name: (then's call, now's call)}``, each pair checked to give equal outputs."""
    pairs = {}
    for lk in (197, 577):
        torch.manual_seed(0)
        now = CrossAttention(768, 16).eval()
        then = then_cross(768, 16).eval()
        then.load_state_dict(now.state_dict())
        x, context = torch.randn(32, 32, 768), torch.randn(32, lk, 768)
        pairs[f"CrossAttention forward, Lk={lk}"] = (lambda m=then, x=x, c=context: m(x, c),
                                                      lambda m=now, x=x, c=context: m(x, c))
    torch.manual_seed(0)
    options = dict(mlp_ratio=2.0, self_attention=False, gated=False, output_gate=True)
    now = FusionStack(2, 64, 16, mlp_layer="swiglu", **options).eval()
    then = then_stack(2, 64, 16, mlp_type="swiglu", **options).eval()
    then.load_state_dict(now.state_dict())
    text, image = torch.randn(320, 12, 64), torch.randn(32, 65, 64)
    mask = torch.arange(12)[None] < torch.randint(6, 13, (320, 1))
    index = torch.arange(320) // 10
    pairs["default fusion stack forward"] = tuple(
        (lambda m=m: m(text, image, text_mask=mask, image_index=index)[0]) for m in (then, now)
    )
    for name, (then_call, now_call) in pairs.items():
        if not torch.equal(then_call(), now_call()):
            raise SystemExit(f"error: {name}: the two versions give different outputs")
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="9496edb", help="the earlier commit (default 9496edb, before issue 30)")
    add_timing_arguments(parser, repeats=15, warmup=2)
    add_threads_argument(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        pairs = cases(*import_layers_of(args.against, Path(tmp)))
        timed = {(name, version): call for name, calls in pairs.items() for version, call in zip(("then", "now"), calls)}
        timings = time_interleaved(timed, args.repeats, args.warmup)
    rows = []
    for name in pairs:
        then, now = timings.samples[name, "then"], timings.samples[name, "now"]
        ratios = sorted(t / n for t, n in zip(then, now))
        rows.append([name, timings.median((name, "then")) * 1e3, timings.median((name, "now")) * 1e3,
                     paired_ratio(then, now), f"{ratios[0]:.2f}-{ratios[-1]:.2f}"])
    print(f"this tree against {args.against}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.repeats} repetitions side by side; outputs equal")
    print(markdown_table(["case", f"{args.against} ms", "now ms", "then / now (median)", "range"], rows,
                         formats=[None, "{:.1f}", "{:.1f}", "{:.3f}", None]))


if __name__ == "__main__":
    main()

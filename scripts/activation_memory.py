"""The memory a training forward leaves allocated for backward (the activations), per part checkpointed.

Builds a config's model (default: the real-size preset, configs/base_224.yaml, from scratch) and runs a
training forward on a batch of random images with a few questions each, with activation
checkpointing off, on each part alone and on every part. What the forward leaves allocated (glibc's
``mallinfo2``: every tensor on the CPU, before the forward and after it) is what backward keeps:
checkpointing shrinks it; the weights, gradients and optimiser state it cannot shrink are not in it.
The rows ``..., keys/values outside`` have the fusion blocks checkpointed but their keys/values
projected before the blocks, as ``VLFuseModel.encode_images`` does outside training: the design that
vlfuse does not use, measured beside it. No timing: the cost of checkpointing is about one more
forward of the parts checkpointed (scripts/bench_scale.py times it).

    .venv/bin/python scripts/activation_memory.py --images 2 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes

import torch
import torch.nn.functional as F

from _common import REPO, add_threads_argument, set_threads
from vlfuse.analysis.data import read_config
from vlfuse.model import VLFuseConfig, VLFuseModel

QUESTIONS = ["what colour is the large object on the left of the table?", "how many people are in the picture?"]
"""Questions of VQA v2's typical length (12-14 tokens)."""


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def allocated_bytes() -> int:
    """Bytes the process has allocated with malloc (every arena's blocks in use, and mmapped blocks)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def settings(model: VLFuseModel) -> list[tuple[str, list[str] | None, bool]]:
    """The rows: (name, the parts to checkpoint, keys/values projected outside the checkpoints): none,
    each trainable part alone, every part; with a fusion stack, its rows again with the keys/values outside."""
    parts = [part for part in ("image", "text", "fuser") if model.set_grad_checkpointing(True, [part])]
    model.set_grad_checkpointing(False)
    rows = [("none", [], False), *((part, [part], False) for part in parts), ("all", None, False)]
    if "fuser" in parts and hasattr(model.fuser, "stack"):
        rows[-1:-1] = [("fuser, keys/values outside", ["fuser"], True)]
        rows.append(("all, keys/values outside", None, True))
    return rows


def kept_bytes(model: VLFuseModel, inputs: dict, labels: torch.Tensor) -> int:
    """The bytes a training forward leaves allocated, in the second of two steps (first calls allocate for good)."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        before = allocated_bytes()
        loss = F.cross_entropy(model(**inputs).logits, labels)
        kept = allocated_bytes() - before
        loss.backward()
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "base_224.yaml"), help="a vlfuse fit config (default: %(default)s)")
    parser.add_argument("--images", type=int, default=2, help="images in the batch (default %(default)s)")
    parser.add_argument("--frozen", action="store_true", help="freeze both encoders")
    add_threads_argument(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    config = VLFuseConfig.from_dict(read_config(args.config)["model"]["architecture"])
    config.image.freeze = config.text.freeze = args.frozen
    torch.manual_seed(0)
    model = VLFuseModel.from_config(config, ["no", "yes"], QUESTIONS).train()
    size = config.image.image_size
    questions = QUESTIONS * args.images
    inputs = model.processor.tokenize(questions) | {
        "pixel_values": torch.rand(args.images, 3, size, size),
        "image_index": torch.arange(args.images).repeat_interleave(len(QUESTIONS)),  # (Bq,): each image's questions
    }
    labels = torch.arange(len(questions)) % 2
    print(f"{args.config}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, {args.images} images x "
          f"{len(QUESTIONS)} questions, {torch.get_num_threads()} threads{', frozen encoders' if args.frozen else ''}\n")
    print("| checkpointed | kept for backward | per image | vs none |")
    print("|:---|---:|---:|---:|")
    fuser, baseline = model.fuser, None
    for name, parts, outside in settings(model):
        model.set_grad_checkpointing(False)
        if parts != []:
            model.set_grad_checkpointing(True, parts)
        if outside:  # every block's keys/values projected before the blocks
            fuser.image_context = lambda tokens, prefix: fuser.stack.project_context(tokens)
        kept = kept_bytes(model, inputs, labels) / 2**20
        vars(fuser).pop("image_context", None)
        baseline = baseline or kept
        print(f"| {name} | {kept:,.1f} MiB | {kept / args.images:,.1f} MiB | {kept / baseline:.3f} |")


if __name__ == "__main__":
    main()

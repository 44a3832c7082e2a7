"""Training throughput of a config's model, and where the time of a training step goes.

Times, round-robin on the same real batches, (1) a whole training step (forward, backward,
AdamW), and forward+backward of each stage of the model on its own: (2) the image encoder and
its projection (``embed_images``), (3) the text encoder and its projection (``encode_questions``),
(4) the image keys/values, the fusion blocks and the readout (``image_context``, ``fuse``,
``read_out``). Prints questions/s
and images/s of the whole step and each part's share of it.

    .venv/bin/python scripts/bench_training.py --config configs/easy_vqa.yaml
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import load_datamodule, untrained_model

from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import time_interleaved
from vlfuse.data import IGNORE_INDEX


def load_model_and_batches(config_path: Path, n_batches: int, batch_size: int | None):
    datamodule = load_datamodule(config_path, [f"--data.init_args.batch_size={batch_size}"] if batch_size else [])
    model = untrained_model(config_path, datamodule).train()
    loader = iter(datamodule.train_dataloader())
    batches = []
    for _ in range(n_batches):
        batch = next(loader)
        batch.update(model.tokenize(batch["questions"]))
        batches.append(batch)
    return model, batches


def train_step(model, optimizer, batch) -> None:
    logits = model(
        batch["pixel_values"], batch["input_ids"], batch["attention_mask"], image_index=batch["image_index"]
    ).logits
    F.cross_entropy(logits, batch["labels"], ignore_index=IGNORE_INDEX).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def deterministic_train_step(model, optimizer, batch) -> None:
    """:func:`train_step` under ``torch.use_deterministic_algorithms`` (what ``--trainer.deterministic true`` sets)."""
    torch.use_deterministic_algorithms(True)
    try:
        train_step(model, optimizer, batch)
    finally:
        torch.use_deterministic_algorithms(False)


def image_part(model, batch) -> None:
    tokens = model.embed_images(batch["pixel_values"])
    tokens.backward(torch.ones_like(tokens))


def text_part(model, batch) -> None:
    text = model.encode_questions(batch["input_ids"], batch["attention_mask"])
    text.backward(torch.ones_like(text))


def fusion_part(model, batch, image_tokens, text) -> None:
    """Image keys/values, fusion blocks and readout, on cached outputs of the two encoder stages."""
    context = model.image_context(image_tokens)
    mask, index = batch["attention_mask"].bool(), batch["image_index"]
    fused = model.fuse(text, mask, context, index)
    logits = model.read_out(fused.tokens, mask, context, index)
    F.cross_entropy(logits, batch["labels"], ignore_index=IGNORE_INDEX).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/easy_vqa.yaml"))
    parser.add_argument("--batches", type=int, default=4, help="distinct real batches, cycled")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None, help="images per batch (default: the config's)")
    parser.add_argument("--deterministic", action="store_true",
                        help="also time the whole step with torch's deterministic algorithms, in the same round-robin")
    args = parser.parse_args()

    model, batches = load_model_and_batches(args.config, args.batches, args.batch_size)
    if not model.has_fusion_heads:
        parser.error(f"{args.config} builds a model without fusion blocks (readout {model.config.readout!r}): nothing to split")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with torch.no_grad():
        cached = [
            (model.embed_images(b["pixel_values"]), model.encode_questions(b["input_ids"], b["attention_mask"]))
            for b in batches
        ]
    # Each part on its own; the text encoder sees each distinct question of a batch once, as in training.
    parts = {
        "whole training step": lambda i: train_step(model, optimizer, batches[i]),
        "image encoder": lambda i: image_part(model, batches[i]),
        "text encoder": lambda i: text_part(model, batches[i]),
        "fusion stack + readout": lambda i: fusion_part(model, batches[i], *cached[i]),
    }
    if args.deterministic:
        parts["whole step, deterministic algorithms"] = lambda i: deterministic_train_step(model, optimizer, batches[i])
    def in_turn(part):
        """``part`` as one timed call: its k-th call runs on batch k mod n, from cleared gradients."""
        batch_index = itertools.cycle(range(len(batches)))

        def run() -> None:
            model.zero_grad(set_to_none=True)
            part(next(batch_index))

        return run

    timings = time_interleaved({name: in_turn(part) for name, part in parts.items()}, args.repeats, args.warmup)
    step = timings.median("whole training step")
    questions = statistics.mean(len(b["labels"]) for b in batches)
    images = statistics.mean(len(b["pixel_values"]) for b in batches)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.config}; "
          f"{images:.0f} images / {questions:.0f} questions per batch; medians of {args.repeats} round-robin runs\n")
    rows = [[name, timings.median(name) * 1e3, timings.ratio(name, "whole training step")] for name in parts]
    print(markdown_table(["part (forward + backward)", "ms per batch", "share of the whole step"], rows,
                         formats=[None, "{:.1f}", "{:.0%}"]))
    print(f"\nthroughput: {questions / step:.0f} questions/s, {images / step:.1f} images/s (training, whole step)")


if __name__ == "__main__":
    main()

"""Training throughput of a config's model, and where the time of a training step goes.

Times, round-robin on the same real batches, (1) a whole training step (forward, backward,
fused AdamW, as in training), and forward+backward of each stage of the model on its own: (2) the image encoder and
its projection (``embed_images``), (3) the text encoder and its projection (``encode_questions``),
(4) the image keys/values, the fuser and the head (``image_context``, ``fuse``,
``read_out``). Prints questions/s
and images/s of the whole step and each part's share of it.

    .venv/bin/python scripts/bench_training.py --config configs/easy_vqa.yaml --threads 2

With ``--against REV``, times instead the whole training step of this tree's package and of the
package at git revision REV side by side: REV is exported to a temporary folder, each package
runs in a worker process of its own (the same measurement, this script's), and the timed
repetitions alternate between the two. Prints every repetition's throughput and the median of
the paired ratios (see :mod:`vlfuse.analysis.timing`).

    .venv/bin/python scripts/bench_training.py --config configs/easy_vqa.yaml --threads 2 --against 5628651
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import REPO, add_threads_argument, add_timing_arguments, load_datamodule, set_threads, untrained_model

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
        batch.update(tokenize(model, batch["questions"]))
        batches.append(batch)
    return model, batches


def tokenize(model, questions: list[str]) -> dict:
    """The model's processor's tokens; a model of a tree before issue 30 (``--against``) tokenizes itself."""
    processor = getattr(model, "processor", None)
    return model.tokenize(questions) if processor is None else processor.tokenize(questions)


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
    """Image keys/values, the fuser and the head, on cached outputs of the two encoder stages."""
    context = model.image_context(image_tokens)
    mask, index = batch["attention_mask"].bool(), batch["image_index"]
    logits = model.read_out(model.fuse(text, mask, context, index).output, mask)
    F.cross_entropy(logits, batch["labels"], ignore_index=IGNORE_INDEX).backward()


def break_down(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The whole training step and each part of it, side by side, on this tree's package."""
    model, batches = load_model_and_batches(args.config, args.batches, args.batch_size)
    if not model.has_fusion_heads:
        parser.error(f"{args.config} builds a model without attention heads (fuser {model.config.fuser.type!r}): nothing to split")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # fused, as vlfuse fit's optimizer
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
        "fuser + head": lambda i: fusion_part(model, batches[i], *cached[i]),
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


# --------------------------------------------------------------------- --against: two revisions side by side
REPLY = "bench_training:"
"""Prefix of a worker's replies on its standard output (anything else it prints is passed over)."""


def serve(args: argparse.Namespace) -> None:
    """Worker: load the model and batches, say so, then run one training step per batch at each ``steps`` line."""
    import vlfuse

    model, batches = load_model_and_batches(args.config, args.batches, args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # fused, as vlfuse fit's optimizer
    questions = [len(b["labels"]) for b in batches]
    _reply({"package": str(Path(vlfuse.__file__).resolve().parent), "questions": questions,
            "images": [len(b["pixel_values"]) for b in batches]})
    for line in sys.stdin:
        if line.strip() != "steps":
            break
        for batch in batches:
            train_step(model, optimizer, batch)
        _reply({"done": True})


def _reply(message: dict) -> None:
    print(REPLY + json.dumps(message), flush=True)


class Worker:
    """A process that times nothing itself: it runs training steps with the vlfuse package of ``tree`` on request.

    Args:
        tree: a source tree holding the ``vlfuse`` package, put first on the worker's ``PYTHONPATH``.
        name: how to name the tree in messages.
        args: this script's arguments (batches, batch size, threads).
        config: the config the worker builds its model and batches from.
    """

    def __init__(self, tree: Path, name: str, args: argparse.Namespace, config: Path) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", "--config", str(config),
                   "--batches", str(args.batches), "--threads", str(args.threads)]
        if args.batch_size:
            command += ["--batch-size", str(args.batch_size)]
        path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
        self.name = name
        self.process = subprocess.Popen(command, cwd=tree, env={**os.environ, "PYTHONPATH": path},
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._read()
        if not Path(ready["package"]).is_relative_to(tree.resolve()):
            raise SystemExit(f"error: --against: the worker for {name} imported vlfuse from {ready['package']}, not from {tree}")
        self.questions, self.images = ready["questions"], ready["images"]

    def run(self) -> None:
        """One training step on each batch."""
        self.process.stdin.write("steps\n")
        self.process.stdin.flush()
        self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait()

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise SystemExit(f"error: --against: the worker for {self.name} stopped (exit status {self.process.wait()})")


def export_revision(revision: str, into: Path) -> str:
    """Write the files of git ``revision`` of this repository into ``into``; return its short commit id."""
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"error: --against {revision}: not a commit of the repository at {REPO}")
    commit = found.stdout.strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return commit[:7]


def config_in_tree(config: Path, tree: Path) -> Path:
    """``config`` as the exported ``tree`` has it, when it is a file of this repository (so that REV's
    default is timed with REV's default config); any other config as it is."""
    config = config.resolve()
    if config.is_relative_to(REPO) and (tree / config.relative_to(REPO)).exists():
        return tree / config.relative_to(REPO)
    return config


def compare_revisions(args: argparse.Namespace) -> None:
    """The whole training step of this tree and of ``args.against``, timed in turn, side by side."""
    with tempfile.TemporaryDirectory(prefix="bench_training_") as folder:
        other = export_revision(args.against, Path(folder))
        workers = {}
        try:
            workers = {
                "this tree": Worker(REPO, "this tree", args, args.config.resolve()),
                other: Worker(Path(folder), other, args, config_in_tree(args.config, Path(folder))),
            }
            mine, theirs = workers.values()
            if (mine.questions, mine.images) != (theirs.questions, theirs.images):
                raise SystemExit(f"error: --against {args.against}: the two trees made different batches "
                                 f"({mine.questions} against {theirs.questions} questions)")
            timings = time_interleaved({name: worker.run for name, worker in workers.items()}, args.repeats, args.warmup)
        finally:
            for worker in workers.values():
                worker.close()
    questions, images = sum(mine.questions), sum(mine.images)
    print(f"torch {torch.__version__}, {args.threads} threads; {args.config}; each sample: one training step on each "
          f"of {len(mine.questions)} batches ({images} images, {questions} questions); {args.repeats} repetitions, "
          f"alternating\n")
    samples = zip(timings.samples["this tree"], timings.samples[other])
    rows = [[i, questions / this, questions / that, that / this] for i, (this, that) in enumerate(samples)]
    print(markdown_table(["repetition", "this tree (questions/s)", f"{other} (questions/s)", "ratio"], rows,
                         formats=[None, "{:.0f}", "{:.0f}", "{:.2f}x"]))
    print(f"\nmedian throughput: this tree {questions / timings.median('this tree'):.0f} questions/s, "
          f"{other} {questions / timings.median(other):.0f} questions/s; "
          f"median of paired ratios: {timings.ratio(other, 'this tree'):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/easy_vqa.yaml"))
    parser.add_argument("--batches", type=int, default=4, help="distinct real batches, cycled")
    add_timing_arguments(parser, repeats=10, warmup=2)
    parser.add_argument("--batch-size", type=int, default=None, help="images per batch (default: the config's)")
    add_threads_argument(parser)
    parser.add_argument("--against", metavar="REV",
                        help="time the whole training step against the package at git revision REV, side by side; "
                             "each tree with its own version of --config (REV's default as it was)")
    parser.add_argument("--deterministic", action="store_true",
                        help="also time the whole step with torch's deterministic algorithms, in the same round-robin")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a worker of --against
    args = parser.parse_args()
    set_threads(args.threads)
    if args.serve:
        serve(args)
    elif args.against:
        compare_revisions(args)
    else:
        break_down(args, parser)


if __name__ == "__main__":
    main()

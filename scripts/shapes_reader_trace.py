"""Follow a SHAPES cell reader (``fuser: cell_steps`` or ``cell_moves``) while it trains: every N
training steps, the probes of scripts/shapes_reader_probe.py that explained the stalls of issue 38,
written as one JSON line each, so that a stall can be watched as it forms and compared with a run that
took off (docs/results.md#composition-on-every-seed-issue-38):

- ``finds``: the AUC of each colour and shape word's find (its best head) against the cells holding it;
- ``circle_square``: how far the find keys put a circle from a square of the same colour (squared
  Mahalanobis distance; the median and the largest over the heads), and the least cosine, over the
  heads, of the circle's and the square's find queries;
- ``shifts`` (``cell_moves`` only): the two moves each relation word weights most, as read in
  "is a red shape ... a green shape".

The probes read 400 scenes generated once from the training questions (``seed=1``, the probe script's
scenes); they run in eval mode without gradients, and the random generators' states are saved and
restored around them, so a traced run follows the same trajectory as one not traced. Add it to any fit
of a cell reader, then print the trace::

    PYTHONPATH=scripts .venv/bin/vlfuse fit --config configs/shapes_fusion.yaml --seed_everything 6 \\
        '--trainer.callbacks+=shapes_reader_trace.ReaderTrace'
    .venv/bin/python scripts/shapes_reader_trace.py runs/shapes_fusion/latest/reader_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import lightning as L
import numpy as np
import torch

from shapes_reader_probe import find_aucs, generated_scenes, key_separation, patches_of, query_cosines, relation_shifts
from vlfuse.fusers import CellMovesFuser, CellStepsFuser

TRACE_FILE = "reader_trace.jsonl"
"""The trace's name in the run's folder (``trainer.log_dir``) when no ``path`` is given."""


class ReaderTrace(L.Callback):
    """Probes a cell reader every ``every_n_steps`` optimizer steps and appends one JSON line.

    Args:
        every_n_steps: probe after every this many optimizer steps (and after the first).
        path: the JSON-lines file; default ``reader_trace.jsonl`` in the run's folder. Lines are
            appended, so a resumed run continues its trace.
        scenes: generated scenes the probes read.
    """

    def __init__(self, every_n_steps: int = 53, path: str | None = None, scenes: int = 400) -> None:
        if every_n_steps < 1:
            raise ValueError(f"ReaderTrace: every_n_steps must be at least 1, got {every_n_steps}")
        if scenes < 30:
            raise ValueError(f"ReaderTrace: scenes must be at least 30 (a circle and a square of each colour), got {scenes}")
        self.every_n_steps, self.path, self.scenes = every_n_steps, path, scenes
        self._data = None
        self._last_step = -1

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fuser = pl_module.model.fuser
        if not isinstance(fuser, CellStepsFuser):
            raise ValueError(f"ReaderTrace follows a cell_steps or cell_moves fuser; this model's is "
                             f"{pl_module.model.config.fuser.type!r}")
        if self.path is None:
            self.path = str(Path(trainer.log_dir or trainer.default_root_dir) / TRACE_FILE)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and step != self._last_step and (step == 1 or step % self.every_n_steps == 0):
            self._last_step = step
            with preserved_random_state(), torch.no_grad():
                row = self.probe(pl_module.model)
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as trace:
                trace.write(json.dumps({"step": step, "epoch": trainer.current_epoch, **row}) + "\n")

    def probe(self, model) -> dict:
        """One row of the trace (without step and epoch), the model in eval mode meanwhile."""
        if self._data is None:
            self._data = generated_scenes(self.scenes)
        scenes, images = self._data
        training = model.training
        model.eval()
        try:
            patches = patches_of(model, images)
            separations = key_separation(model, patches, scenes)
            row = {
                "finds": {word: round(auc, 3) for word, (auc, _) in find_aucs(model, patches, scenes).items()},
                "circle_square": {"median": round(float(np.nanmedian(separations)), 2),
                                  "max": round(float(np.nanmax(separations)), 2),
                                  "least_query_cosine": round(min(query_cosines(model)), 3)},
            }
            if isinstance(model.fuser, CellMovesFuser):
                row["shifts"] = {
                    f"{relation} {word}": [[list(step), round(weight, 3)] for step, weight in moves[:2]]
                    for relation, words in relation_shifts(model).items() for word, moves, _ in words
                }
        finally:
            model.train(training)
        return row


class preserved_random_state:
    """Restores Python's, NumPy's and torch's random generators (the CPU's and each GPU's) on exit."""

    def __enter__(self) -> None:
        self.states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                       torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)

    def __exit__(self, *exc) -> None:
        python, numpy, torch_cpu, cuda = self.states
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(torch_cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def read_trace(path: Path) -> list[dict]:
    """The rows of a trace file; a clear error names the file and line of a row that is not JSON."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise SystemExit(f"{path}:{number}: not a trace row ({error.msg})") from None
    return rows


MOVES = ("left_of left", "right_of right", "left_of of", "right_of of")
"""The words whose moves the printed trace shows: "left", "right", "of" after "left", "of" after "right"."""


def format_row(row: dict) -> str:
    """One line of the printed trace (:func:`header`'s columns)."""
    finds = row["finds"]
    line = (f"{row['step']:6d} {row['epoch']:5d}  {finds['circle']:6.2f} {finds['square']:6.2f} {finds['triangle']:8.2f}"
            f"  {row['circle_square']['median']:6.1f} {row['circle_square']['max']:7.1f}"
            f" {row['circle_square'].get('least_query_cosine', float('nan')):8.2f}")
    for name in MOVES:
        if name in row.get("shifts", {}):
            line += "  " + " ".join(f"{tuple(step)} {weight:.2f}" for step, weight in row["shifts"][name]).ljust(24)
    return line


def header(moves: bool) -> str:
    """The column names of :func:`format_row`."""
    line = "  step epoch  circle square triangle  median     max  queries"
    if moves:
        line += "  " + "  ".join(name.ljust(24) for name in ("left", "right", "of (after left)", "of (after right)"))
    return " " * 14 + "finds (AUC)".ljust(24) + "circle/square keys\n" + line.rstrip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a reader_trace.jsonl")
    args = parser.parse_args()
    if not args.trace.is_file():
        raise SystemExit(f"trace: no such file: {args.trace}")
    rows = read_trace(args.trace)
    print(header(any("shifts" in row for row in rows)))
    for row in rows:
        print(format_row(row))


if __name__ == "__main__":
    main()

"""How closely the package's SHAPES renderer matches the released images, and how well their scenes read back.

1. The scene reader (:func:`vlfuse.data.shapes.read_scenes`) on each released split with images:
   every released question evaluated on the scene read from its image against the released
   answer, and how many readings are ambiguous (smallest cell margin below 0.5).
2. Per-shape statistics of the objects of the released training images (train.small, whose first
   64 images are train.tiny; scenes read from the pixels) and of as many objects drawn by
   :func:`vlfuse.data.shapes.render_scenes`: the mean mask of each shape (the object's channel over
   a 10x10 cell, in [0, 1]) and how far the two means differ, the covered area (the mask's sum
   over its brightest value) at a few quantiles, and the share of objects at full brightness.
3. A classifier that tries to tell the two apart: an MLP on the 10x10x3 pixels of one object's
   cell, trained on half the images of each source and scored on the other half (50%: it cannot
   tell them apart).

The released val images are not used for 2 and 3 (they measure captions, see caption_errors.py).

    .venv/bin/python scripts/shapes_renderer_match.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from _common import add_threads_argument, set_threads

from vlfuse.analysis.tables import markdown_table
from vlfuse.data.shapes import (
    CELL,
    GRID,
    SHAPES,
    evaluator_agreement,
    load_released_split,
    read_scenes,
    render_scenes,
    sample_scenes,
)
from vlfuse.datamodules.shapes import find_shapes_dir

READER_SPLITS = ("train.tiny", "train.small", "val")
TRAINING_SPLIT = "train.small"
"""The released training images compared (train.tiny is its first 64)."""


def object_cells(images: np.ndarray, scenes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every object of the scenes: its cell's pixels (n, 10, 10, 3) in [0, 1], shape index, and image index."""
    cells, shapes, owners = [], [], []
    for n, (image, scene) in enumerate(zip(images, scenes)):
        for row in range(GRID):
            for col in range(GRID):
                if scene[row][col] is not None:
                    cells.append(image[row * CELL : (row + 1) * CELL, col * CELL : (col + 1) * CELL] / 255.0)
                    shapes.append(SHAPES.index(scene[row][col].shape))
                    owners.append(n)
    return np.array(cells), np.array(shapes), np.array(owners)


def object_masks(cells: np.ndarray) -> np.ndarray:
    """Each object's dominant channel (the one with the largest sum): (n, 10, 10)."""
    channel = cells.sum(axis=(1, 2)).argmax(axis=-1)
    return cells[np.arange(len(cells)), :, :, channel]


def shape_statistics(released: np.ndarray, released_shapes: np.ndarray, rendered: np.ndarray,
                     rendered_shapes: np.ndarray) -> str:
    """A table per shape: mean-mask difference, covered area quantiles, share at full brightness."""
    rows = []
    for index, shape in enumerate(SHAPES):
        masks = {"released": object_masks(released[released_shapes == index]),
                 "package": object_masks(rendered[rendered_shapes == index])}
        difference = np.abs(masks["released"].mean(axis=0) - masks["package"].mean(axis=0))
        for source, mask in masks.items():
            peak = mask.max(axis=(1, 2))
            area = mask.sum(axis=(1, 2)) / peak
            rows.append([shape, source, len(mask), *np.quantile(area, [0.05, 0.5, 0.95]), float((peak >= 254.5 / 255).mean()),
                         float(difference.max()), float(difference.mean())])
    header = ["shape", "source", "objects", "area q05 (px)", "area median", "area q95", "full brightness",
              "mean masks: max |diff|", "mean |diff|"]
    return markdown_table(header, rows, formats=[None, None, None, "{:.2f}", "{:.2f}", "{:.2f}", "{:.1%}", "{:.4f}", "{:.5f}"])


def classifier_accuracy(released: np.ndarray, released_owner: np.ndarray, rendered: np.ndarray,
                        rendered_owner: np.ndarray, shapes: np.ndarray, *, steps: int, seed: int) -> tuple[float, list[float]]:
    """Held-out accuracy of an MLP telling released cells (label 1) from rendered ones (label 0).

    Cells of even-numbered images train it, cells of odd-numbered images score it, so no image
    lends objects to both halves. Returns the accuracy over all held-out cells and per shape.
    """
    torch.manual_seed(seed)
    x = torch.tensor(np.concatenate([released, rendered]).reshape(len(released) + len(rendered), -1), dtype=torch.float32)
    y = torch.cat([torch.ones(len(released)), torch.zeros(len(rendered))])
    held_out = torch.tensor(np.concatenate([released_owner, rendered_owner]) % 2 == 1)
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    fit_x, fit_y = x[~held_out], y[~held_out]
    for _ in range(steps):
        batch = torch.randint(len(fit_x), (256,))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(fit_x[batch])[:, 0], fit_y[batch])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        right = ((model(x[held_out])[:, 0] > 0).float() == y[held_out]).numpy()
    held_shapes = shapes[held_out.numpy()]
    return float(right.mean()), [float(right[held_shapes == s].mean()) for s in range(len(SHAPES))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes-dir", type=Path, metavar="DIR",
                        help="the released SHAPES files (default $VLFUSE_SHAPES_DIR, then ../shared/data/shapes)")
    parser.add_argument("--steps", type=int, default=3000, help="training steps of the classifier (batches of 256 cells)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated scenes and of the classifier")
    add_threads_argument(parser, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    try:
        shapes_dir = find_shapes_dir(args.shapes_dir)
        splits = {split: load_released_split(shapes_dir, split) for split in READER_SPLITS}
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: --shapes-dir: {err}") from None

    rows = []
    for split, data in splits.items():
        agreement = evaluator_agreement(data)
        margins = [reading.margin for reading in read_scenes(data.images)]
        rows.append([split, agreement.total, len(np.unique(data.images.reshape(len(data), -1), axis=0)),
                     agreement.agree, agreement.rate, agreement.mismatches[:5] or None, len(agreement.ambiguous), min(margins)])
    print("The scene reader against the released answers:\n")
    print(markdown_table(["split", "rows", "distinct images", "answers agree", "agreement", "first rows that disagree",
                          "ambiguous readings", "smallest scene margin"], rows,
                         formats=[None, None, None, None, "{:.2%}", None, None, "{:.3f}"]))

    released_images = np.unique(splits[TRAINING_SPLIT].images, axis=0)
    released, released_shapes, released_owner = object_cells(released_images, [r.scene for r in read_scenes(released_images)])
    rng = np.random.default_rng(args.seed)
    scenes = sample_scenes(len(released_images), rng)
    rendered, rendered_shapes, rendered_owner = object_cells(render_scenes(scenes, rng), scenes)
    print(f"\nObjects of the {len(released_images)} released {TRAINING_SPLIT} images and of {len(scenes)} rendered scenes:\n")
    print(shape_statistics(released, released_shapes, rendered, rendered_shapes))
    accuracy, by_shape = classifier_accuracy(released, released_owner, rendered, rendered_owner,
                                             np.concatenate([released_shapes, rendered_shapes]), steps=args.steps, seed=args.seed)
    print(f"\nClassifier released vs package (held-out cells; 50% = indistinguishable): {accuracy:.2%} "
          f"({', '.join(f'{shape} {a:.2%}' for shape, a in zip(SHAPES, by_shape))})")


if __name__ == "__main__":
    main()

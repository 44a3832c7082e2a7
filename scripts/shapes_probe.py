"""Linear probes: do a SHAPES model's patch tokens tell each grid cell's colour and shape?

Takes generated training scenes (their objects are known), runs the model's image side
(``VLFuseModel.embed_images``: image encoder and projection) and fits one logistic regression per
attribute on the patch tokens (a cell's patches averaged, when the grid is not 3x3) of 70% of the cells, scored on the other 30%. Classes: empty, or
one of the three colours (shapes). ``--untrained`` probes a freshly initialised model of the same
config instead, the floor that training starts from.

    .venv/bin/python scripts/shapes_probe.py --model runs/shapes_fusion/latest/model
    .venv/bin/python scripts/shapes_probe.py --model runs/shapes_fusion/latest/model --untrained
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from vlfuse.data.shapes import COLOURS, SHAPES, distinct_queries, generate_training_set, read_questions
from vlfuse.data.transforms import preprocess_image
from vlfuse.datamodules.shapes import TRAINING_QUESTIONS_SPLIT, find_shapes_dir
from vlfuse.model import VLFuseModel


def cell_labels(scenes) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell, row by row: colour and shape classes (0 empty, 1-3 as COLOURS / SHAPES)."""
    colours, shapes = [], []
    for scene in scenes:
        for row in scene:
            for cell in row:
                colours.append(0 if cell is None else 1 + COLOURS.index(cell.colour))
                shapes.append(0 if cell is None else 1 + SHAPES.index(cell.shape))
    return torch.tensor(colours), torch.tensor(shapes)


def cell_features(tokens: torch.Tensor, grid: tuple[int, int], cells: int = 3) -> torch.Tensor:
    """Patch tokens ``(B, rows * cols, d)`` -> one feature per scene cell ``(B * cells * cells, d)``,
    the mean of the patches whose centre lies in that cell (a 3x3 patch grid: the tokens themselves)."""
    rows, cols = grid
    cell_of_row = ((torch.arange(rows) + 0.5) * cells / rows).long()  # scene row of each patch row
    cell_of_col = ((torch.arange(cols) + 0.5) * cells / cols).long()
    cell = (cell_of_row[:, None] * cells + cell_of_col[None, :]).flatten()  # (rows * cols,)
    assign = torch.nn.functional.one_hot(cell, cells * cells).to(tokens.dtype)  # (rows * cols, cells^2)
    means = torch.einsum("bpd,pc->bcd", tokens, assign / assign.sum(0))  # (B, cells^2, d)
    return means.reshape(-1, tokens.shape[-1])


def probe_accuracy(features: torch.Tensor, labels: torch.Tensor, train_fraction: float = 0.7) -> float:
    """Held-out accuracy of a logistic regression (L-BFGS, small L2) on standardised ``features``."""
    x = (features - features.mean(0)) / (features.std(0) + 1e-5)
    n = int(train_fraction * len(x))
    classes = int(labels.max()) + 1
    weight = torch.zeros(x.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=300)

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(x[:n] @ weight + bias, labels[:n]) + 1e-4 * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return ((x[n:] @ weight + bias).argmax(-1) == labels[n:]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a saved vlfuse SHAPES model")
    parser.add_argument("--untrained", action="store_true", help="probe a new model of the same config")
    parser.add_argument("--scenes", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = VLFuseModel.from_pretrained(args.model)
    if args.untrained:
        model = VLFuseModel(model.config, model.answers, model.tokenizer,
                            text_hf_config=model.text_encoder.model.config, load_pretrained=False)
    model.eval()
    queries = distinct_queries(read_questions(find_shapes_dir(), TRAINING_QUESTIONS_SPLIT).queries)
    data = generate_training_set(queries, seed=1, images_per_question=-(-args.scenes // len(queries)))
    images, scenes = data.images[: args.scenes], data.scenes[: args.scenes]
    size = model.config.image.image_size
    features = []
    with torch.no_grad():
        for start in range(0, len(images), 250):
            pixels = torch.stack([preprocess_image(image, size) for image in images[start : start + 250]])
            tokens = model.embed_images(pixels)[:, model.image_encoder.num_prefix_tokens :]  # (B, cells, d)
            features.append(cell_features(tokens, tuple(model.image_encoder.grid_size)))
    features = torch.cat(features)
    colours, shapes = cell_labels(scenes)
    which = "untrained" if args.untrained else "trained"
    for name, labels in (("colour", colours), ("shape", shapes)):
        accuracy = probe_accuracy(features, labels)
        print(f"{args.model} ({which}): {name} of a cell from its patch token: {accuracy:.1%} held out "
              f"({len(labels)} cells; empty cells {(labels == 0).float().mean():.1%})")


if __name__ == "__main__":
    main()

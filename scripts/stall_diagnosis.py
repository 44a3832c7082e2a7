"""Why a group of easy-VQA questions sits at its answer prior: the run's checkpoints, epoch by epoch.

For each epoch's checkpoint of a run saved once per epoch (``vlfuse fit ... --checkpoint.save_top_k -1``),
on the easy-VQA test questions, by kind of question ("what shape", "yes/no shape negated", ...):

- the accuracy;
- for each fusion layer, the share of the cross-attention weights on the object's cells (the mean
  over heads and question tokens; weights spread evenly would give the object's area, printed
  beside it).

With ``--refit-epoch E``, the readout is put to the test on its own: a fresh head of the model's
head type, fitted on the fused tokens of the training questions as the frozen model at epoch ``E``
makes them, then scored on the test questions by kind. If the fresh head also stays at a group's
prior, what the fusion reads does not carry the answer, and the stall is upstream of the head.

    .venv/bin/vlfuse fit --config configs/easy_vqa.yaml --seed_everything 4 --checkpoint.save_top_k -1 \\
        --trainer.default_root_dir runs/stall_s4 --trainer.logger.init_args.save_dir runs/stall_s4
    .venv/bin/python scripts/stall_diagnosis.py --run runs/stall_s4/version_0 --refit-epoch 4
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import torch
from _common import load_model

from vlfuse.analysis.head_stats import object_cells, object_mass
from vlfuse.analysis.tables import markdown_table
from vlfuse.data.easy_vqa import question_kind
from vlfuse.datamodules import EasyVQADataModule
from vlfuse.model import VLFuseModel

CHECKPOINT_NAME = re.compile(r"epoch=(\d+)-step=\d+\.ckpt")


def epoch_checkpoints(run: Path) -> dict[int, Path]:
    """``{epoch: checkpoint}`` of ``run/checkpoints/epoch=E-step=S.ckpt``.

    Raises:
        SystemExit: the run has none (one line naming ``--run`` and what was looked for).
    """
    found = {}
    for path in (run / "checkpoints").glob("epoch=*.ckpt"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match:
            found[int(match.group(1))] = path
    if not found:
        raise SystemExit(
            f"error: --run {run}: no checkpoints/epoch=E-step=S.ckpt; train with --checkpoint.save_top_k -1 to keep one per epoch"
        )
    return dict(sorted(found.items()))


def load_epoch(model: VLFuseModel, checkpoint: Path) -> None:
    """Put the weights of a ``vlfuse fit`` checkpoint into ``model`` (read with ``weights_only``: no code runs)."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    model.load_state_dict({name.removeprefix("model."): value for name, value in state.items() if name.startswith("model.")})


def count_answers(correct: dict, total: dict, kinds: list[str], scores: torch.Tensor, labels: torch.Tensor) -> None:
    """Add each question's right or wrong answer (``scores`` ``(Bq, answers)`` against ``labels``) to its kind's counts."""
    for kind, guess, label in zip(kinds, scores.argmax(-1).tolist(), labels.tolist()):
        total[kind] += 1
        correct[kind] += guess == label


def attention_and_accuracy(model: VLFuseModel, batches) -> tuple[dict, dict, float]:
    """``(accuracy[kind], object_share[layer][kind], object_area)`` over ``batches``."""
    grid, prefix = tuple(model.image_encoder.grid_size), model.attention_prefix_tokens
    layers = list(range(len(model.attention_layers)))
    correct, total = defaultdict(int), defaultdict(int)
    share_sum = defaultdict(lambda: defaultdict(float))
    area_sum = images = 0
    with torch.inference_mode():
        for batch in batches:
            inputs = model.processor.batch(batch, "cpu")
            out = model(**inputs, weights_from=layers)
            kinds = [question_kind(question) for question in batch["questions"]]
            count_answers(correct, total, kinds, out.logits, batch["labels"])
            objects = object_cells(inputs.pixel_values, grid)  # (Bi, cells)
            area_sum += objects.float().mean(-1).sum().item()
            images += len(objects)
            mask = out.text_mask.float()  # (Bq, Lt)
            for layer in layers:
                weights = out.attentions[layer]  # (Bq, H, Lt, Li)
                bq, heads, lt, li = weights.shape
                rows = weights.permute(0, 2, 1, 3).reshape(bq * lt, heads, li)  # (Bq * Lt, H, Li)
                row_objects = objects[inputs.image_index].repeat_interleave(lt, dim=0)  # (Bq * Lt, cells)
                on_object = object_mass(rows, row_objects, prefix).mean(-1).view(bq, lt)  # (Bq, Lt)
                per_question = (on_object * mask).sum(-1) / mask.sum(-1)  # (Bq,)
                for kind, share in zip(kinds, per_question.tolist()):
                    share_sum[layer][kind] += share
    accuracy = {kind: correct[kind] / total[kind] for kind in total}
    shares = {layer: {kind: s / total[kind] for kind, s in by_kind.items()} for layer, by_kind in share_sum.items()}
    return accuracy, shares, area_sum / images


def fused_tokens(model: VLFuseModel, batches) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]]:
    """``(fused, text_mask, labels, kinds)`` per batch: what the model's head reads, frozen."""
    captured = []
    hook = model.head.register_forward_pre_hook(lambda module, args: captured.append(args))
    out = []
    try:
        with torch.no_grad():  # not inference_mode: the fresh head's fit backpropagates through these tensors
            for batch in batches:
                model(**model.processor.batch(batch, "cpu"))
                fused, text_mask = captured.pop()
                kinds = [question_kind(question) for question in batch["questions"]]
                out.append((fused, text_mask, batch["labels"], kinds))
    finally:
        hook.remove()
    return out


def refit_head(model: VLFuseModel, train, test, *, epochs: int, lr: float, seed: int) -> dict[int, dict[str, float]]:
    """A fresh head of the model's type fitted on ``train``'s fused tokens (AdamW at ``lr``);
    ``{epoch: accuracy[kind] on test}`` after each epoch."""
    torch.manual_seed(seed)
    head = model.config.head.build(model.config.fusion_dim, model.answers)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.05)
    scores = {}
    for epoch in range(1, epochs + 1):
        head.train()
        for index in torch.randperm(len(train)).tolist():
            fused, text_mask, labels, _ = train[index]
            loss = torch.nn.functional.cross_entropy(head(fused, text_mask), labels, ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        head.eval()
        correct, total = defaultdict(int), defaultdict(int)
        with torch.no_grad():
            for fused, text_mask, labels, kinds in test:
                count_answers(correct, total, kinds, head(fused, text_mask), labels)
        scores[epoch] = {kind: correct[kind] / total[kind] for kind in total}
    return scores


def kind_table(first: str, rows: dict, kinds: list[str]) -> str:
    """One row per key of ``rows`` (``{key: {kind: fraction}}``), one column per kind, as percentages."""
    body = [[key, *(values.get(kind, float("nan")) for kind in kinds)] for key, values in rows.items()]
    return markdown_table([first, *kinds], body, formats=[None, *["{:.1%}"] * len(kinds)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, metavar="DIR",
                        help="a run folder: its model/ (the architecture) and checkpoints/epoch=E-step=S.ckpt")
    parser.add_argument("--limit-images", type=int, default=None, help="only the first N test images (and training images for --refit-epoch)")
    parser.add_argument("--refit-epoch", type=int, default=None, metavar="E", help="fit a fresh head on the frozen model of epoch E")
    parser.add_argument("--refit-epochs", type=int, default=8, help="epochs of the fresh head's fit (default 8)")
    parser.add_argument("--refit-lr", type=float, default=2e-3, help="its learning rate (default 2e-3, the default config's)")
    parser.add_argument("--seed", type=int, default=0, help="the fresh head's initial weights and the training order (default 0)")
    args = parser.parse_args()

    checkpoints = epoch_checkpoints(args.run)
    if args.refit_epoch is not None and args.refit_epoch not in checkpoints:
        raise SystemExit(f"error: --refit-epoch {args.refit_epoch}: the run has checkpoints of epochs {sorted(checkpoints)}")
    model = load_model(args.run / "model")
    data = EasyVQADataModule(image_size=model.config.image.image_size, batch_size=32, limit_images=args.limit_images)

    accuracy, shares, area = {}, defaultdict(dict), 0.0
    for epoch, checkpoint in checkpoints.items():
        load_epoch(model, checkpoint)
        accuracy[epoch], by_layer, area = attention_and_accuracy(model, data.test_dataloader())
        for layer, by_kind in by_layer.items():
            shares[layer][epoch] = by_kind
    kinds = sorted({kind for by_kind in accuracy.values() for kind in by_kind})
    print(f"Test accuracy by kind of question ({args.run}):\n")
    print(kind_table("epoch", accuracy, kinds))
    for layer, by_epoch in sorted(shares.items()):
        print(f"\nFusion layer {layer}: share of the cross-attention on the object's cells "
              f"(even weights would give the object's area, {area:.1%}):\n")
        print(kind_table("epoch", by_epoch, kinds))

    if args.refit_epoch is not None:
        load_epoch(model, checkpoints[args.refit_epoch])
        train = fused_tokens(model, data.train_dataloader())
        test = fused_tokens(model, data.test_dataloader())
        refit = refit_head(model, train, test, epochs=args.refit_epochs, lr=args.refit_lr, seed=args.seed)
        print(f"\nA fresh {model.config.head.type} head fitted on the frozen model of epoch {args.refit_epoch} "
              f"(lr {args.refit_lr:g}, seed {args.seed}), test accuracy after each of its epochs:\n")
        print(kind_table("head epoch", {"the model's own head": accuracy[args.refit_epoch], **refit}, kinds))


if __name__ == "__main__":
    main()

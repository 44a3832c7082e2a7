"""The subcommands of ``vlfuse``: where each one's ``main(argv) -> int`` lives, and what it does.

This package holds one module per subcommand (imported only when it runs) and, here, only their
names and descriptions, which the dispatcher (:mod:`vlfuse.cli`) and each command's own help read:
it imports nothing, so ``vlfuse --help`` loads neither torch nor Lightning.
"""

from __future__ import annotations

from typing import NamedTuple


class Subcommand(NamedTuple):
    """Where a subcommand's ``main(argv) -> int`` lives, and what it does."""

    module: str
    description: str


SUBCOMMANDS = {
    "fit": Subcommand(
        "vlfuse.commands.lightning",
        "Train a model on a config's data (vlfuse fit --config configs/easy_vqa.yaml); export the best "
        "checkpoint's model to its run folder, <trainer.default_root_dir>/version_N/model (latest/model), and, "
        "with test_after_fit, print its test accuracy.",
    ),
    "validate": Subcommand(
        "vlfuse.commands.lightning",
        "Evaluate a checkpoint (--ckpt_path) or a saved model (--model.pretrained DIR) on the validation split.",
    ),
    "test": Subcommand(
        "vlfuse.commands.lightning",
        "Evaluate a checkpoint (--ckpt_path) or a saved model (--model.pretrained DIR) on the test split and "
        "print its accuracy.",
    ),
    "plot": Subcommand(
        "vlfuse.commands.plot",
        "Draw a run's training curves (losses per step and per epoch, accuracies, caption scores) from its "
        "metrics.csv logs into a PNG, RUN/curves.png (vlfuse plot runs/easy_vqa/latest).",
    ),
    "predict": Subcommand(
        "vlfuse.commands.predict",
        "Answer questions about images with a saved model: one pair (--image, --question) or a JSONL file "
        "(--input); optionally draw attention maps.",
    ),
    "caption": Subcommand(
        "vlfuse.commands.caption",
        "Describe images with a saved caption model: one image (--image) or a JSONL file (--input); greedy or "
        "beam search; optionally draw each head's attention for every generated word.",
    ),
    "explain": Subcommand(
        "vlfuse.commands.explain",
        "Show where a saved model looked to answer one question (--image, --question): raw attention, attention x "
        "gradient (Grad-CAM), rollout and input-gradient maps over the image, for the whole question and each word; "
        "for a caption model, each word of its caption.",
    ),
    "analyze": Subcommand(
        "vlfuse.commands.analyze",
        "Report what each attention head of a saved model does: statistics, dead heads, roles, importance "
        "scores and pruning curves, as OUT/report.md with figures.",
    ),
    "prune": Subcommand(
        "vlfuse.commands.prune",
        "Score the attention heads of a saved model, remove the lowest-scored ones for real, optionally "
        "fine-tune, and save the smaller model.",
    ),
    "export": Subcommand(
        "vlfuse.commands.export",
        "Write a saved answering model as an ONNX folder (model.onnx, tokenizer, answers) that onnxruntime runs "
        "without vlfuse's model code, optionally quantized to int8; checked against PyTorch before it is written.",
    ),
    "cache-features": Subcommand(
        "vlfuse.commands.cache_features",
        "Run a config's frozen image encoder once over every image of its data and write the features to "
        "safetensors shards with an index (--out DIR; --dtype float16 halves them), resuming an interrupted run; "
        "vlfuse fit --model.feature_store DIR then reads them instead of running the encoder.",
    ),
    "convert": Subcommand(
        "vlfuse.commands.convert",
        "Write a config's VQA data (--config C, or an imagefolder, --data-dir DATA) as streaming shards with "
        "litdata.optimize (--out DIR: one item per image, its encoded bytes and its questions, per split, and an "
        "index), which vlfuse.datamodules.StreamingDataModule trains from, locally or from object storage.",
    ),
    "card": Subcommand(
        "vlfuse.commands.card",
        "Print a saved model's card (its README.md: architecture, parameters, training data, metrics with the "
        "command that measured them, versions, intended use), written from the folder's config.json; --write "
        "rewrites README.md.",
    ),
}
LIGHTNING = ("fit", "validate", "test")
"""The subcommands whose ``main`` takes the whole command line (Lightning parses the subcommand itself)."""

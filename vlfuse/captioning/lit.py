"""CaptionLitModule: trains a :class:`~vlfuse.captioning.CaptionModel` with teacher forcing.

Selected in a ``vlfuse fit`` config by ``model: class_path: vlfuse.captioning.lit.CaptionLitModule``
(see ``configs/shapes_captions.yaml``); the best model is exported to ``<root>/model`` as for the
answering models, and loads with :meth:`CaptionModel.from_pretrained` / ``vlfuse caption``.
"""

from __future__ import annotations

import copy
from dataclasses import asdict

import lightning as L
import torch
import torch.nn.functional as F

from vlfuse.captioning.generate import greedy
from vlfuse.captioning.metrics import CaptionScores, SceneCaptionScores
from vlfuse.captioning.model import CHECKPOINTED_PARTS, CaptionConfig, CaptionModel
from vlfuse.data import IGNORE_INDEX
from vlfuse.lit import adamw_warmup_cosine, agree_image_transform

EVAL_STAGES = ("val", "test")


def training_captions(datamodule: L.LightningDataModule) -> list[str]:
    """Every caption of the training split (``datamodule.train_captions``), for the word-level tokenizer."""
    if not hasattr(datamodule, "train_captions"):
        raise ValueError(
            f"CaptionLitModule needs a caption datamodule (data: class_path: vlfuse.datamodules.captions...), "
            f"got {type(datamodule).__name__}, which has no train_captions"
        )
    return list(datamodule.train_captions)


class CaptionLitModule(L.LightningModule):
    """Trains a caption model: cross-entropy of each next word (padding ignored) given the image and
    the words before it; validation and test write captions greedily and score them.

    Logged: ``{stage}/loss``; in validation and test also ``bleu4`` and ``cider`` (against every
    reference caption of each image) and, for data with scenes (SHAPES), ``fact_precision`` and
    ``object_recall`` (:mod:`vlfuse.captioning.metrics`), and ``images`` (how many were captioned).

    The model is built in :meth:`setup`, once the datamodule can give the training captions (for the
    word-level tokenizer) and the image size.

    Args:
        caption_model: the model to build.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay (not on biases, norms, gates).
        warmup_ratio: share of the training steps spent warming the learning rate up.
        min_lr_ratio: the learning rate at the end of the cosine decay, relative to ``lr``.
        label_smoothing: label smoothing of the cross-entropy.
        pretrained: a directory written by :meth:`CaptionModel.save_pretrained`: use that model
            (to test it, or to fine-tune it) instead of building one from ``architecture``.
        activation_checkpointing: recompute activations in backward instead of keeping them
            (:meth:`CaptionModel.set_grad_checkpointing`): ``True`` for both parts, or a list among
            ``image``, ``decoder``. A training setting: a saved model folder does not hold it.
    """

    def __init__(
        self,
        caption_model: CaptionConfig = CaptionConfig(),
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        warmup_ratio: float = 0.05,
        min_lr_ratio: float = 0.01,
        label_smoothing: float = 0.0,
        pretrained: str | None = None,
        activation_checkpointing: bool | list[str] = False,
    ) -> None:
        super().__init__()
        if not (isinstance(activation_checkpointing, bool) or set(activation_checkpointing) <= set(CHECKPOINTED_PARTS)):
            raise ValueError(
                f"model.activation_checkpointing must be true, false or a list of parts among "
                f"{list(CHECKPOINTED_PARTS)}, got {activation_checkpointing!r}"
            )
        self.architecture = copy.deepcopy(caption_model)  # the default instance is shared
        self.save_hyperparameters(ignore=["caption_model"])
        # Plain types only, so that checkpoints load with torch.load(weights_only=True).
        self.hparams["caption_model"] = asdict(self.architecture)
        self.model: CaptionModel | None = None
        self.caption_scores = torch.nn.ModuleDict({stage: CaptionScores() for stage in EVAL_STAGES})
        self.scene_scores = torch.nn.ModuleDict({stage: SceneCaptionScores() for stage in EVAL_STAGES})

    # ------------------------------------------------------------------------------ building
    def setup(self, stage: str) -> None:
        self.configure_model()

    def configure_model(self) -> None:
        """Build the model once: from ``pretrained``, or from the architecture and the training captions."""
        if self.model is not None:
            return
        datamodule = self.trainer.datamodule
        if self.hparams.pretrained:
            self.model = CaptionModel.from_pretrained(self.hparams.pretrained).train()
            self.architecture = copy.deepcopy(self.model.config)
            self.hparams["caption_model"] = asdict(self.architecture)  # checkpoints describe the model in use
        agree_image_transform(datamodule, self.architecture.image)
        if self.model is None:
            self.model = CaptionModel.from_config(self.architecture, training_captions(datamodule))
        parts = self.hparams.activation_checkpointing
        if parts:
            self.model.set_grad_checkpointing(True, None if parts is True else parts)

    # ------------------------------------------------------------------------------ steps
    def _loss(self, batch: dict) -> torch.Tensor:
        """Teacher forcing: the cross-entropy of every next token, padding ignored."""
        ids = self.model.tokenize(batch["captions"]).to(self.device)  # (B, L): BOS words EOS pad...
        logits = self.model(batch["pixel_values"], ids[:, :-1])  # (B, L - 1, vocab)
        targets = ids[:, 1:].masked_fill(ids[:, 1:] == self.model.pad_id, IGNORE_INDEX)  # (B, L - 1)
        return F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
            label_smoothing=self.hparams.label_smoothing,
        )

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["captions"]), on_step=True, on_epoch=True)
        return loss

    def _evaluate(self, batch: dict, stage: str) -> None:
        """The teacher-forced loss, then greedy captions scored against the references (and scenes)."""
        size = len(batch["captions"])
        self.log(f"{stage}/loss", self._loss(batch), batch_size=size, on_epoch=True, sync_dist=True)
        generated = [c.text for c in greedy(self.model, self.model.encode_images(batch["pixel_values"]))]
        self.caption_scores[stage].update(generated, batch["references"])
        if batch.get("scenes") is not None:
            self.scene_scores[stage].update(generated, batch["scenes"])
        images = torch.tensor(float(size), device=self.device)
        self.log(f"{stage}/images", images, reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)

    def _log_scores(self, stage: str) -> None:
        """Log and reset the epoch's caption scores (the scene scores only when scenes were seen)."""
        metrics = [self.caption_scores[stage]] + ([self.scene_scores[stage]] if self.scene_scores[stage].update_called else [])
        for metric in metrics:
            self.log_dict({f"{stage}/{name}": value for name, value in metric.compute().items()}, prog_bar=True)
            metric.reset()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._log_scores("val")

    def on_test_epoch_end(self) -> None:
        self._log_scores("test")

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.model)

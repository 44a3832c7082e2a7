"""The Lightning module of the answering model (:class:`VLFuseLitModule`), its optimiser and the export of
the best model. The caption model's module is :mod:`vlfuse.captioning.lit`, built on the same optimiser."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Literal, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics.classification import MulticlassAccuracy

from vlfuse import model_card, model_io
from vlfuse.data import IGNORE_INDEX, AnswerVocab, GroupedVQADataset
from vlfuse.data.answers import quoted
from vlfuse.datamodules import VQADataModule
from vlfuse.encoders import ImageEncoderConfig
from vlfuse.encoders.feature_store import DiskFeatureStore
from vlfuse.metrics import VQASoftAccuracy
from vlfuse.model import CHECKPOINTED_PARTS, VLFuseConfig, VLFuseModel, VLFuseOutput
from vlfuse.runtime import lightning_accelerator


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine decay to ``min_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class VLFuseLitModule(L.LightningModule):
    """Trains a :class:`VLFuseModel` to classify answers.

    The model is built in :meth:`setup`, once the datamodule has told the answer vocabulary and
    the training questions (for a word-level tokenizer).

    Args:
        architecture: the model to build.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay (not applied to biases, norms, gates and embeddings
            of positions and class tokens).
        warmup_ratio: share of the training steps spent warming the learning rate up.
        min_lr_ratio: the learning rate at the end of the cosine decay, relative to ``lr``.
        label_smoothing: label smoothing of the cross-entropy loss.
        lr_ratios: learning rates relative to ``lr`` for the parameters of named submodules of the
            model, e.g. ``{"text_encoder": 0.025}`` to fine-tune a pretrained text encoder gently
            while the layers trained from scratch learn at ``lr``.
        pretrained: a directory written by :meth:`VLFuseModel.save_pretrained` (e.g. by ``vlfuse
            prune``): use that model, its architecture and tokenizer, instead of building one from
            ``architecture`` (to test it, or to fine-tune it). The data is labelled with its answers,
            by name (:meth:`VQADataModule.use_answers`): a question whose answer the model lacks
            counts as wrong, with a warning.
        new_answers: what fine-tuning ``pretrained`` (``fit``) does with training answers the model
            lacks: ``refuse`` (stop, naming them) or ``extend`` (append them to its answers, the
            head growing a new row for each).
        activation_checkpointing: recompute activations in backward instead of keeping them
            (:meth:`VLFuseModel.set_grad_checkpointing`): ``True`` for every part that keeps some,
            or a list of parts among ``image``, ``text``, ``fuser``. A training setting: the
            checkpoints' hyperparameters hold it, a saved model folder does not.
        feature_store: a folder written by ``vlfuse cache-features`` for this model's frozen image
            encoder: its features are read from disk instead of computed, in training and evaluation,
            and the images it holds are not decoded (:meth:`ImageEncoder.use_feature_store
            <vlfuse.encoders.ImageEncoder.use_feature_store>`). A training setting, as
            ``activation_checkpointing``.
    """

    def __init__(
        self,
        architecture: VLFuseConfig = VLFuseConfig(),
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        warmup_ratio: float = 0.05,
        min_lr_ratio: float = 0.01,
        label_smoothing: float = 0.0,
        lr_ratios: dict[str, float] | None = None,
        pretrained: str | None = None,
        new_answers: Literal["refuse", "extend"] = "refuse",
        activation_checkpointing: bool | list[str] = False,
        feature_store: str | None = None,
    ) -> None:
        super().__init__()
        if new_answers not in ("refuse", "extend"):
            raise ValueError(f"new_answers must be 'refuse' or 'extend', got {new_answers!r}")
        activation_checkpointing = checkpointed_parts(activation_checkpointing)
        self.architecture = copy.deepcopy(architecture)  # the default instance is shared
        # Plain types only, so that checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters(
            {
                "architecture": self.architecture.to_dict(),
                "lr": lr,
                "weight_decay": weight_decay,
                "warmup_ratio": warmup_ratio,
                "min_lr_ratio": min_lr_ratio,
                "label_smoothing": label_smoothing,
                "lr_ratios": dict(lr_ratios or {}),
                "pretrained": pretrained,
                "new_answers": new_answers,
                "activation_checkpointing": activation_checkpointing,
                "feature_store": feature_store,
            }
        )
        self.model: VLFuseModel | None = None

    # ------------------------------------------------------------------------------ building
    def setup(self, stage: str) -> None:
        self.configure_model()

    def configure_model(self) -> None:
        """Build the model once (Lightning's weight-averaging callbacks call this before ``setup``)."""
        if self.model is not None:
            return
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if not isinstance(datamodule, VQADataModule):
            raise ValueError("VLFuseLitModule needs a VQADataModule (data: class_path: vlfuse.datamodules...)")
        if self.hparams.pretrained:
            self.use_pretrained(self.hparams.pretrained, datamodule)
        self.configure_datamodule(datamodule)
        if self.model is None:
            self.build_model(datamodule.answers, datamodule.train_questions)
        datamodule.stored_features = self.model.image_encoder.store

    def use_pretrained(self, directory: str, datamodule: VQADataModule) -> None:
        """Use the model saved in ``directory`` and label ``datamodule``'s questions with its answers;
        to fine-tune, first give it the training answers it lacks (see ``new_answers``)."""
        model = VLFuseModel.from_pretrained(directory)
        new = self._new_training_answers(model.answers, datamodule)
        if new and self.hparams.new_answers != "extend":
            raise ValueError(
                f"model.pretrained {directory} lacks {len(new)} of the training data's answers ({quoted(new)}): "
                "--model.new_answers extend adds them to the model, or train on data with its answers"
            )
        if new:
            rank_zero_info(f"vlfuse: added {len(new)} answers to the model's {len(model.answers)}: {quoted(new)}")
            model.add_answers(new)
        datamodule.use_answers(model.answers)
        self.architecture = copy.deepcopy(model.config)
        self.hparams["architecture"] = self.architecture.to_dict()  # checkpoints describe the model in use
        self.use_model(model.train())

    def _new_training_answers(self, answers: Sequence[str], datamodule: VQADataModule) -> list[str]:
        """In ``fit``, the data's answer classes (:attr:`VQADataModule.data_vocab`) not in ``answers``; else none."""
        if self.trainer.state.fn != TrainerFn.FITTING:
            return []
        return AnswerVocab(answers).unknown(datamodule.data_vocab.answers)

    def configure_datamodule(self, datamodule: VQADataModule) -> None:
        """Give the datamodule the model's image size (or check that they agree)."""
        agree_image_transform(datamodule, self.architecture.image)

    def build_model(self, answers: list[str], questions: list[str]) -> None:
        self.use_model(VLFuseModel.from_config(self.architecture, answers, questions))

    def use_model(self, model: VLFuseModel) -> None:
        """Train ``model`` (e.g. a pruned one): set it, its activation checkpointing and the accuracy
        metrics over its answers."""
        self.model = model
        parts = self.hparams.get("activation_checkpointing", False)
        if parts:
            model.set_grad_checkpointing(True, None if parts is True else parts)
        if self.hparams.get("feature_store"):
            model.image_encoder.use_feature_store(DiskFeatureStore(self.hparams.feature_store))
        num_classes = len(model.answers) + 1  # the last: every answer the model lacks (see _step)
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)
        self.test_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)
        # VQA's soft accuracy, for batches that carry every annotator's answers (human_labels)
        self.soft_acc = torch.nn.ModuleDict({"val": VQASoftAccuracy(), "test": VQASoftAccuracy()})

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["vlfuse_answers"] = list(self.model.answers)
        checkpoint["vlfuse_format"] = model_io.FORMAT_VERSION

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A checkpoint over other answers rebuilds the model over them (:meth:`use_checkpoint_answers`);
        one of an earlier version (no ``vlfuse_format``) gets its weights renamed."""
        if "vlfuse_format" not in checkpoint:
            old = checkpoint.get("hyper_parameters", {}).get("architecture", {})
            prefixes = model_io.format_3_keys(old.get("readout", model_io.FORMAT_2_DEFAULTS["readout"]))
            checkpoint["state_dict"] = model_io.rename(checkpoint["state_dict"], {f"model.{a}": f"model.{b}" for a, b in prefixes.items()})
        saved = checkpoint.get("vlfuse_answers")
        if self.model is not None and saved is not None and saved != self.model.answers:
            self.use_checkpoint_answers(saved)

    def use_checkpoint_answers(self, answers: list[str]) -> None:
        """Rebuild the model over a checkpoint's ``answers`` before its weights are loaded, and label
        the data with them; a run is not resumed on training answers the checkpoint lacks."""
        if self.hparams.pretrained:
            raise ValueError(
                f"the checkpoint was trained on {len(answers)} answers {answers[:5]}..., but model.pretrained gives "
                f"{len(self.model.answers)} answers {self.model.answers[:5]}...: the answer vocabularies differ"
            )
        datamodule = self.trainer.datamodule
        new = self._new_training_answers(answers, datamodule)
        if new:
            raise ValueError(
                f"the checkpoint lacks {len(new)} of the training data's answers ({quoted(new)}): to fine-tune on "
                "them, give its model folder as --model.pretrained with --model.new_answers extend"
            )
        datamodule.use_answers(answers)
        self.build_model(answers, datamodule.train_questions)

    # ------------------------------------------------------------------------------ steps
    def forward(self, batch: dict) -> torch.Tensor:
        """Answer logits for a batch from :func:`vlfuse.data.collate_grouped`."""
        return self._model_output(batch).logits

    def _model_output(self, batch: dict) -> VLFuseOutput:
        # in training each distinct question is tokenized once (the processor's token cache)
        return self.model(**self.model.processor.batch(batch, self.device, cache=self.model.training))

    def _step(self, batch: dict, stage: str, accuracy: MulticlassAccuracy) -> torch.Tensor:
        """The cross-entropy (logged as ``{stage}/loss``), plus the weighted head-diversity penalty
        (logged as ``train/head_diversity``) when the model returns one (training, weight > 0).

        Under DDP every epoch value is reduced over the ranks: ``{stage}/acc`` by torchmetrics
        (summed counts), the means by Lightning (``sync_dist``: summed ``value * batch_size`` over
        summed batch sizes), and ``val/questions`` / ``test/questions`` (the questions scored, a
        sum) show that no question was counted twice.
        """
        output = self._model_output(batch)
        logits, labels = output.logits, batch["labels"]
        known = logits.shape[-1]  # labels past the model's answers: answers it lacks (VQADataModule.use_answers)
        loss = F.cross_entropy(
            logits, labels.masked_fill(labels >= known, IGNORE_INDEX), ignore_index=IGNORE_INDEX,
            label_smoothing=self.hparams.label_smoothing,
        )
        accuracy(logits.argmax(-1), labels.clamp(max=known))  # the class `known` is never predicted: wrong
        n = len(labels)
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=n, on_step=on_step, on_epoch=True, sync_dist=True)
        self.log(f"{stage}/acc", accuracy, prog_bar=True, batch_size=n, on_step=False, on_epoch=True)
        if stage != "train":
            scored = (labels != IGNORE_INDEX).sum().float()
            self.log(f"{stage}/questions", scored, reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)
        if stage in self.soft_acc and "human_labels" in batch:
            self.soft_acc[stage](logits, batch["human_labels"])
            self.log(f"{stage}/soft_acc", self.soft_acc[stage], batch_size=n, on_step=False, on_epoch=True)
        if output.head_diversity is not None:
            diversity = output.head_diversity
            self.log(f"{stage}/head_diversity", diversity, batch_size=n, on_step=True, on_epoch=True, sync_dist=True)
        if output.auxiliary_loss is not None:
            loss = loss + output.auxiliary_loss
        return loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train", self.train_acc)

    def on_train_epoch_end(self) -> None:
        """Once a frozen image encoder has cached (or stored) every training image, the loader stops decoding them."""
        dataset = getattr(self.trainer.train_dataloader, "dataset", None)
        held = self.model.image_encoder.held_features()
        if held is not None and isinstance(dataset, GroupedVQADataset):
            dataset.decode_only_uncached(held)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val", self.val_acc)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "test", self.test_acc)

    # ------------------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.model, self.hparams.get("lr_ratios"))


def checkpointed_parts(value: bool | list[str]) -> bool | list[str]:
    """``activation_checkpointing`` checked: a bool, or a list of parts of
    :data:`~vlfuse.model.CHECKPOINTED_PARTS` (a ValueError names the option and the parts)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and all(part in CHECKPOINTED_PARTS for part in value):
        return list(value)
    raise ValueError(
        f"model.activation_checkpointing must be true, false or a list of parts among {list(CHECKPOINTED_PARTS)}, got {value!r}"
    )


def agree_image_transform(datamodule: L.LightningDataModule, image: ImageEncoderConfig) -> None:
    """Give ``datamodule`` the image encoder's interpolation, and its image size when the datamodule's
    ``image_size`` is ``None`` (else check that they agree)."""
    datamodule.interpolation = image.interpolation
    size = image.image_size
    if datamodule.image_size is None:
        datamodule.image_size = size
    elif datamodule.image_size != size:
        raise ValueError(
            f"data.image_size ({datamodule.image_size}) differs from the model's "
            f"architecture.image.image_size ({size}); set one of them (or leave data.image_size out)"
        )


def adamw_warmup_cosine(
    module: L.LightningModule, model: torch.nn.Module, lr_ratios: dict[str, float] | None = None
) -> dict:
    """``configure_optimizers`` of a module whose hyperparameters hold ``lr``, ``weight_decay``,
    ``warmup_ratio`` and ``min_lr_ratio``: AdamW over ``model``'s trainable parameters (no decay on
    biases, norms, gates, position and class tokens), the learning rate following :func:`warmup_cosine`
    step by step. ``lr_ratios`` maps names of ``model``'s submodules (e.g. ``"text_encoder"``) to a
    learning rate relative to ``lr`` for their parameters; where names nest, the longest one
    that holds a parameter sets its rate."""
    lr_ratios = lr_ratios or {}
    unknown = sorted(set(lr_ratios) - {name for name, _ in model.named_modules() if name})
    if unknown:
        children = sorted(name for name, _ in model.named_children())
        raise ValueError(f"lr_ratios names no submodule of the model: {unknown}; its parts are {children}")
    hparams = module.hparams
    most_specific_first = sorted(lr_ratios, key=len, reverse=True)
    groups: dict[tuple[float, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        ratio = next((lr_ratios[part] for part in most_specific_first if name.startswith(part + ".")), 1.0)
        decays = not (param.ndim <= 1 or name.endswith(("pos_embed", "cls_token", "reg_token")))
        groups.setdefault((ratio, decays), []).append(param)
    optimizer = torch.optim.AdamW(  # fused: one kernel for all parameters (CPU: 3 ms a step, not 12)
        [
            {"params": params, "lr": hparams.lr * ratio, "weight_decay": hparams.weight_decay if decays else 0.0}
            for (ratio, decays), params in groups.items()
        ],
        lr=hparams.lr,
        fused=True,
    )
    total = max(1, int(module.trainer.estimated_stepping_batches))
    warmup = max(1, int(total * hparams.warmup_ratio))
    min_ratio = hparams.min_lr_ratio
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps=warmup, total_steps=total, min_ratio=min_ratio)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ExportBestModel(Callback):
    """At the end of ``fit``, save the best checkpoint's model with ``save_pretrained``.

    Under DDP every rank loads the best weights (so that what follows, e.g. a test, uses them),
    rank 0 alone writes the directory, and every rank waits at a barrier until it is written. The
    folder is written atomically (a kill leaves the old model or the new one), and a folder that
    is not a vlfuse model is never replaced (:func:`vlfuse.model_io.write_model_folder`). Its model card
    records the run (:func:`vlfuse.model_card.fit_record`, from :attr:`run` where ``vlfuse fit`` sets it).

    Args:
        dirpath: where to write the model; default ``<trainer.default_root_dir>/model``. ``vlfuse fit``
            sets the run folder's ``model/`` (for ``configs/easy_vqa.yaml``, ``runs/easy_vqa/version_N/model``,
            also reached as ``runs/easy_vqa/latest/model``; a fit that continues a run replaces that
            run's model), see :mod:`vlfuse.runs`.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.exported_to: Path | None = None
        self.run: model_card.RunRecord | None = None  # vlfuse fit's command, config and seed, for the model card

    def on_fit_end(self, trainer: L.Trainer, pl_module: VLFuseLitModule) -> None:
        checkpoint = trainer.checkpoint_callback
        best = getattr(checkpoint, "best_model_path", "") if isinstance(checkpoint, ModelCheckpoint) else ""
        if best:
            state = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
            pl_module.load_state_dict(state)
        target = Path(self.dirpath or Path(trainer.default_root_dir) / "model")
        if trainer.is_global_zero:
            pl_module.model.save_pretrained(target, run=model_card.fit_record(trainer, self.run))
            source = f"best checkpoint {best}" if best else "final weights"
            rank_zero_info(f"vlfuse: saved the model ({source}) to {target}")
        trainer.strategy.barrier("ExportBestModel")
        self.exported_to = target


# ------------------------------------------------------------------------------ fine-tuning a given model
def lit_module_for(model: VLFuseModel, config: dict, config_path: Path, lr: float | None) -> VLFuseLitModule:
    """A :class:`VLFuseLitModule` that trains ``model`` itself, with the config's ``model:`` options.

    ``lr`` replaces the config's ``model.lr`` (default: a tenth of it, as the model is trained).
    """
    options = {k: v for k, v in (config.get("model") or {}).items() if k != "architecture"}
    try:
        lit = VLFuseLitModule(architecture=model.config, **options)
    except TypeError as err:
        raise ValueError(f"{config_path}: bad model options {sorted(options)}: {err}") from err
    lit.hparams.lr = lr if lr is not None else lit.hparams.lr / 10  # configure_optimizers reads it
    lit.use_model(model)  # instead of building one in setup
    return lit


def finetune(lit: VLFuseLitModule, datamodule: VQADataModule, epochs: int, device: str, root: Path) -> None:
    """Train ``lit.model`` for ``epochs`` epochs on ``device`` on the training split (no validation, no checkpoints).

    The datamodule labels the questions with the model's answers (:meth:`VQADataModule.use_answers`).
    """
    datamodule.use_answers(lit.model.answers)
    lit.configure_datamodule(datamodule)  # the model's image size
    accelerator, devices = lightning_accelerator(device)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator=accelerator,
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=sys.stderr.isatty(),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    lit.model.train()  # from_pretrained models come in eval mode, which Lightning keeps
    trainer.fit(lit, datamodule=datamodule)
    lit.model.cpu().eval()

"""VLFuseModel: image encoder + text encoder + a fuser + an answer head, in four public stages."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from vlfuse import hub, model_card, model_io
from vlfuse.encoders import (
    ImageEncoder, ImageEncoderConfig, TextEncoder, TextEncoderConfig, build_word_tokenizer, load_saved_tokenizer, load_tokenizer,
    saved_text_config, scratch_config,
)
from vlfuse.encoders.adapters import merged
from vlfuse.errors import MOVED_OPTIONS
from vlfuse.fusers import FUSERS, FuserConfig
from vlfuse.heads import HEADS, HeadConfig
from vlfuse.layers import CrossAttention
from vlfuse.parts import MAX_WIDTH, check_range, check_type
from vlfuse.processor import VLFuseProcessor


CHECKPOINTED_PARTS = ("image", "text", "fuser")
"""The parts :meth:`VLFuseModel.set_grad_checkpointing` can checkpoint, in model order."""


def default_image_encoder() -> ImageEncoderConfig:
    """The default model's image encoder: timm's hybrid ViT (a ResNet stem, whose convolutions learn
    shapes far faster than patches) with 1 block of width 128, an 8x8 grid of 32 px images."""
    return ImageEncoderConfig(name="vit_tiny_r_s16_p8_224", image_size=32, patch_size=1, width=128, depth=1, num_heads=4)


def default_text_encoder() -> TextEncoderConfig:
    """The default model's text encoder: a 1-layer BERT of width 128, from scratch."""
    return TextEncoderConfig(model_type="bert", width=128, depth=1, num_heads=4, max_length=32)


@dataclass
class VLFuseConfig:
    """Architecture of a :class:`VLFuseModel`: two encoders, a fuser and a head.

    ``VLFuseConfig()`` is the default model, the one ``configs/easy_vqa.yaml`` trains: 2 fusion blocks
    of 16 output-gated cross-attention heads (4 dimensions each) with SwiGLU MLPs over a 1-block
    hybrid ViT and a 1-layer BERT, read out by the bilinear head. A config file overrides parts.

    Attributes:
        image: the image encoder.
        text: the text encoder.
        fusion_dim: the width both encoders are projected to, which the fuser and the head work in.
        fuser: what reads the question with the image: a mapping with ``type`` (one of
            :data:`vlfuse.fusers.FUSERS`: ``fusion_stack``, ``cell_steps``, ``cell_moves``, ``map_program``) and that
            part's options (e.g. ``depth: 2``); a :class:`~vlfuse.fusers.FuserConfig` once built.
        head: what turns the fuser's output into answer scores: ``type`` (one of
            :data:`vlfuse.heads.HEADS`: ``bilinear``, ``pooled``, ``existence``) and its options.
        pruned_heads: ``{layer: [original head ids]}`` removed from each of the fuser's
            cross-attention layers (filled by pruning; layers as strings for JSON).
    """

    image: ImageEncoderConfig = field(default_factory=default_image_encoder)
    text: TextEncoderConfig = field(default_factory=default_text_encoder)
    fusion_dim: int = 64
    # A config file gives each part as a mapping (its type and options: what jsonargparse reads, and
    # what `--model.architecture.fuser.depth 3` sets a key of); __post_init__ makes it the part's config.
    fuser: dict[str, Any] = field(default_factory=lambda: {"type": "fusion_stack"})
    head: dict[str, Any] = field(default_factory=lambda: {"type": "bilinear"})
    pruned_heads: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_type("fusion_dim", self.fusion_dim, int)
        check_range("fusion_dim", self.fusion_dim, 1, MAX_WIDTH)
        check_type("pruned_heads", self.pruned_heads, dict[str, list[int]])
        bad = [layer for layer in self.pruned_heads if not (str(layer).isascii() and str(layer).isdecimal())]
        if bad:
            raise ValueError(f"pruned_heads maps layer numbers to head ids, got the keys {bad}")
        self.fuser: FuserConfig = FUSERS.parse(self.fuser, "fuser")
        self.head: HeadConfig = HEADS.parse(self.head, "head")
        if self.head.reads != self.fuser.gives:
            readers = [name for name, part in HEADS.configs.items() if part.reads == self.fuser.gives]
            raise ValueError(
                f"head {self.head.type!r} reads {self.head.reads}, but fuser {self.fuser.type!r} gives "
                f"{self.fuser.gives}: use a head of type {' or '.join(map(repr, readers))}"
            )
        if self.fuser.reads_words and self.text.name is None and self.text.depth != 0:
            raise ValueError(
                f"fuser {self.fuser.type!r} reads the question's word embeddings, not the encoder's layers: "
                f"set text.depth to 0 for a from-scratch text encoder (got {self.text.depth})"
            )

    @classmethod
    def from_dict(cls, data: dict) -> "VLFuseConfig":
        """The config of a ``config.json`` or a config file's ``architecture``; unknown keys are errors."""
        data = dict(data)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            moved = [f"{name} -> {MOVED_OPTIONS[name]}" for name in unknown if name in MOVED_OPTIONS]
            hint = f" (options of the parts now: {'; '.join(moved)})" if moved else ""
            raise ValueError(f"unknown model config keys: {unknown}{hint}")
        image = ImageEncoderConfig(**data.pop("image", {}))
        text = TextEncoderConfig(**data.pop("text", {}))
        return cls(image=image, text=text, **data)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (``config.json``, checkpoints, config files)."""
        return dataclasses.asdict(self)

    def check(self, answers: Sequence[str]) -> None:
        """Raise a ``ValueError`` naming what of ``answers`` the parts cannot work with."""
        if len(answers) < 2:
            raise ValueError(f"need at least 2 answers, got {len(answers)}")
        self.head.check(answers)


@dataclass
class ImageContext:
    """What a batch of images gives the rest of a model, computed once per image (:meth:`VLFuseModel.encode_images`).

    Attributes:
        features: what the fuser (or a caption decoder) reads of the images, batch first: e.g. every
            fusion block's keys/values ``[(Bi, H, Li, hd), ...]``.
    """

    features: Any

    def select(self, index: slice | torch.Tensor) -> "ImageContext":
        """The images ``index`` (a slice gives views, no copy)."""
        return _combine([self], lambda tensors: tensors[0][index])

    def contiguous(self) -> "ImageContext":
        """The same features, each tensor laid out in its own shape's order (e.g. keys ``(Bi, H, Li, hd)``
        head by head instead of the projection's token by token): a copy where the layout differs."""
        return _combine([self], lambda tensors: tensors[0].contiguous())

    @staticmethod
    def cat(contexts: Sequence["ImageContext"]) -> "ImageContext":
        """One context of all the images of ``contexts``, in order."""
        return _combine(list(contexts), torch.cat)


def _combine(parts: list, merge: Callable[[list[torch.Tensor]], torch.Tensor]):
    """Walk parallel structures (dataclasses, lists, tuples, tensors, None) and ``merge`` their tensors, batch first."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return merge(parts)
    if isinstance(first, (list, tuple)):
        items = [_combine(list(column), merge) for column in zip(*parts, strict=True)]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)  # a NamedTuple, or not
    if dataclasses.is_dataclass(first):
        changes = {f.name: _combine([getattr(p, f.name) for p in parts], merge) for f in dataclasses.fields(first)}
        return dataclasses.replace(first, **changes)
    return first  # None, or a value every image shares


@dataclass
class VLFuseOutput:
    """What :meth:`VLFuseModel.forward` returns.

    Attributes:
        logits: ``(Bq, num_answers)`` answer scores.
        attentions: ``{layer: (Bq, H, Lt, Li)}`` cross-attention weights of the layers asked for.
        text_mask: ``(Bq, Lt)`` True for real (non-padding) question tokens.
        head_diversity: in training with a fusion stack's ``diversity_weight > 0``, the
            head-diversity penalty (scalar, differentiable; see :func:`vlfuse.layers.head_diversity`).
        auxiliary_loss: what the fuser adds to the training loss (the weighted penalty), else ``None``.
    """

    logits: torch.Tensor
    attentions: dict[int, torch.Tensor]
    text_mask: torch.Tensor
    head_diversity: torch.Tensor | None = None
    auxiliary_loss: torch.Tensor | None = None


class VLFuseModel(nn.Module, hub.HubMixin, **model_card.hub_metadata(model_io.MODEL_TYPE)):
    """A vision-language fusion model for answer classification.

    Image tokens (timm ViT) and question tokens (transformers encoder) are projected to
    ``fusion_dim``; a fuser (:mod:`vlfuse.fusers`, e.g. a stack of fusion blocks in which each
    question token attends to the image) reads them together, and a head (:mod:`vlfuse.heads`)
    turns the result into scores over ``answers``. The four stages are public and :meth:`forward`
    is their composition:

    - :meth:`encode_images`: pixels -> an :class:`ImageContext`, reusable for many questions;
    - :meth:`encode_questions`: token ids -> question tokens ``(Bq, Lt, fusion_dim)``;
    - :meth:`fuse`: question tokens x image context -> what the head reads (with an optional head mask);
    - :meth:`read_out`: the fuser's output -> answer scores.

    Its :attr:`processor` (tokenizer and image transform) turns images and questions into its
    inputs: ``model(**model.processor(images, questions))``.

    It saves and loads through huggingface_hub's mixin (:class:`vlfuse.hub.HubMixin`):
    :meth:`save_pretrained` writes a folder with a model card, ``from_pretrained`` reads a folder or
    a Hub repository, ``push_to_hub`` uploads. :attr:`run_record` is the
    :class:`~vlfuse.model_card.RunRecord` of the folder it was loaded from (``None`` for a new model).

    Args:
        config: the architecture.
        answers: the answer vocabulary (one score each).
        processor: the tokenizer and image transform (:class:`~vlfuse.processor.VLFuseProcessor`);
            :meth:`from_config` builds one.
        text_hf_config: the transformers config of the text encoder to build without loading
            weights (used by :meth:`from_pretrained`); ``None`` builds from ``config.text``.
        load_pretrained: load pretrained encoder weights where the config names them.
    """

    def __init__(
        self,
        config: VLFuseConfig,
        answers: Sequence[str],
        processor: VLFuseProcessor,
        *,
        text_hf_config=None,
        load_pretrained: bool = True,
    ) -> None:
        super().__init__()
        config.check(answers)
        self.config = config
        self.run_record: model_card.RunRecord | None = None
        self.answers = list(answers)
        self.processor = processor
        tokenizer = processor.tokenizer
        if text_hf_config is None and config.text.name is None:
            text_hf_config = scratch_config(config.text, len(tokenizer), tokenizer.pad_token_id)
        self.image_encoder = ImageEncoder(config.image, load_weights=load_pretrained)
        self.text_encoder = TextEncoder(config.text, text_hf_config)
        d = config.fusion_dim
        self.image_proj = nn.Linear(self.image_encoder.width, d)
        self.text_proj = nn.Linear(self.text_encoder.width, d)
        grid_size = tuple(self.image_encoder.grid_size)
        self.fuser = config.fuser.build(d, text_width=self.text_encoder.width, grid_size=grid_size)
        self.head = config.head.build(d, self.answers)
        layers = self.fuser.attention_layers
        for layer, heads in config.pruned_heads.items():
            if not 0 <= int(layer) < len(layers):
                raise ValueError(f"pruned_heads names layer {layer}, but fuser {config.fuser.type!r} has {len(layers)} attention layers")
            layers[int(layer)].prune_heads(heads)

    @classmethod
    def from_config(cls, config: VLFuseConfig, answers: Sequence[str], questions: Iterable[str] = ()) -> "VLFuseModel":
        """Build a new model; a from-scratch text encoder gets a word tokenizer made from ``questions``."""
        if config.text.name is None:
            tokenizer = build_word_tokenizer(questions, config.text.max_length)
        else:
            tokenizer = load_tokenizer(config.text.name)
        return cls(config, answers, processor_for(config, tokenizer))

    @property
    def tokenizer(self):
        """The processor's tokenizer."""
        return self.processor.tokenizer

    # ----------------------------------------------------------------------------- the stages
    def encode_images(
        self, pixel_values: torch.Tensor | None, image_keys: Sequence[str | None] | None = None
    ) -> ImageContext:
        """Images ``(Bi, 3, S, S)`` in [0, 1] -> their :class:`ImageContext`, reusable for many questions:
        what the fuser needs of them. The same as ``image_context(embed_images(pixel_values, image_keys))``."""
        return self.image_context(self.embed_images(pixel_values, image_keys))

    def embed_images(
        self, pixel_values: torch.Tensor | None, image_keys: Sequence[str | None] | None = None
    ) -> torch.Tensor:
        """Images ``(Bi, 3, S, S)`` -> image tokens ``(Bi, Li, fusion_dim)``: the image encoder, projected.
        ``image_keys`` name the images for a frozen encoder's cache (see :meth:`ImageEncoder.forward`)."""
        return self.image_proj(self.image_encoder(pixel_values, image_keys))

    def image_context(self, image_tokens: torch.Tensor) -> ImageContext:
        """Image tokens from :meth:`embed_images` -> what the fuser reads of them (e.g. every block's keys/values)."""
        return ImageContext(self.fuser.image_context(image_tokens, self.image_encoder.num_prefix_tokens))

    def encode_questions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(Bq, Lt)`` tokenized questions -> question tokens ``(Bq, Lt, fusion_dim)``: what the fuser
        reads of the question (the text encoder's states, each distinct question encoded once; or the
        word embeddings, for the SHAPES readers), projected by ``text_proj``."""
        return self.text_proj(self.fuser.question_features(self.text_encoder, input_ids, attention_mask))

    def fuse(
        self,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: ImageContext,
        image_index: torch.Tensor | None = None,
        *,
        head_mask: torch.Tensor | None = None,
        weights_from: Iterable[int] = (),
    ):
        """Run the fuser: question tokens read their images. Returns a :class:`~vlfuse.fusers.Fused`.

        Args:
            text: ``(Bq, Lt, fusion_dim)`` from :meth:`encode_questions`.
            text_mask: ``(Bq, Lt)`` bool, True for real (non-padding) tokens.
            image_context: from :meth:`encode_images`.
            image_index: ``(Bq,)`` the image of each question (default: question i, image i).
            head_mask: ``(L, H0)`` or ``(Bq, L, H0)`` factors on each cross-attention head's output,
                indexed by ORIGINAL head id (``H0`` the heads each layer was built with; entries of
                pruned heads are ignored, e.g. NaN): 0 gives the logits of the model with that head
                pruned, 1 leaves it; differentiable.
            weights_from: attention layers whose cross-attention weights to return.

        A fuser without attention heads (``map_program``) refuses a head mask or attention weights.
        """
        wanted = sorted(set(weights_from))
        if wanted or head_mask is not None:
            self.require_fusion_heads("mask or draw")
            bad = [layer for layer in wanted if not 0 <= layer < self.num_fusion_layers]
            if bad:
                raise ValueError(f"attention layers {bad} out of range: the model has layers 0..{self.num_fusion_layers - 1}")
        head_masks = None if head_mask is None else self._layer_head_masks(head_mask)
        return self.fuser(text, text_mask, image_context.features, image_index, head_masks=head_masks, weights_from=wanted)

    def read_out(self, fused: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """The fuser's output (``Fused.output``) -> answer scores ``(Bq, num_answers)``."""
        return self.head(fused, text_mask)

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        image_index: torch.Tensor | None = None,
        image_keys: Sequence[str | None] | None = None,
        image_context: ImageContext | None = None,
        head_mask: torch.Tensor | None = None,
        weights_from: Iterable[int] = (),
    ) -> VLFuseOutput:
        """Answer scores for each question: the four stages in turn (``model(**processor(...))``).

        Args:
            pixel_values: ``(Bi, 3, S, S)`` images in [0, 1], or ``None`` with ``image_context``
                (or with ``image_keys`` that a frozen encoder's cache holds).
            input_ids, attention_mask: ``(Bq, Lt)`` tokenized questions.
            image_index: ``(Bq,)`` the image of each question when images are shared
                (default: question i is about image i).
            image_keys: a name per image, for a frozen image encoder's cache.
            image_context: from :meth:`encode_images`, instead of ``pixel_values``.
            head_mask: per-head factors, see :meth:`fuse`.
            weights_from: attention layers whose cross-attention weights to return.
        """
        if input_ids is None or attention_mask is None:
            raise ValueError("forward needs input_ids and attention_mask (model.processor tokenizes questions)")
        if image_context is None:
            image_context = self.encode_images(pixel_values, image_keys)
        text_mask = attention_mask.bool()
        text = self.encode_questions(input_ids, attention_mask)
        fused = self.fuse(text, text_mask, image_context, image_index, head_mask=head_mask, weights_from=weights_from)
        logits = self.read_out(fused.output, text_mask)
        return VLFuseOutput(logits, fused.attentions, text_mask, fused.head_diversity, fused.auxiliary_loss)

    # ----------------------------------------------------------------------------- training memory
    def set_grad_checkpointing(self, enable: bool = True, parts: Iterable[str] | None = None) -> list[str]:
        """Activation (gradient) checkpointing of the parts ``parts`` (of :data:`CHECKPOINTED_PARTS`:
        ``"image"``, ``"text"``, ``"fuser"``): in training, each block of those parts keeps only its
        inputs for backward and recomputes the rest there. The gradients are the same; a step costs
        about one more forward of those parts. Not saved with the model.

        ``parts=None`` means every part that keeps activations for backward and can be checkpointed:
        a fuser without blocks (``map_program``) is then left out, and named in ``parts`` it is a
        ValueError. A frozen encoder (``freeze: true``) keeps no activations for backward, so it is
        always left out, named or not. Returns the parts it set, in order.
        """
        names = list(CHECKPOINTED_PARTS if parts is None else [parts] if isinstance(parts, str) else parts)
        unknown = [name for name in names if name not in CHECKPOINTED_PARTS]
        if unknown:
            raise ValueError(f"activation checkpointing: unknown parts {unknown}; the parts are {list(CHECKPOINTED_PARTS)}")
        modules = {"image": self.image_encoder, "text": self.text_encoder, "fuser": self.fuser}
        frozen = {"image": self.config.image.freeze, "text": self.config.text.freeze, "fuser": False}
        chosen = []
        for name in CHECKPOINTED_PARTS:
            if name not in names or (enable and frozen[name]):
                continue
            if name == "fuser" and enable and not self.fuser.supports_grad_checkpointing:
                if parts is None:
                    continue
                raise ValueError(
                    f"activation checkpointing: fuser {self.config.fuser.type!r} has no blocks to checkpoint "
                    "(fusion_stack, cell_steps and cell_moves have): leave fuser out of the parts"
                )
            modules[name].set_grad_checkpointing(enable)
            chosen.append(name)
        return chosen

    # ----------------------------------------------------------------------------- attention heads
    @property
    def attention_layers(self) -> list[CrossAttention]:
        """The fuser's cross-attention layers: the heads to mask, draw, score and prune."""
        return self.fuser.attention_layers

    @property
    def attention_prefix_tokens(self) -> int:
        """How many prefix tokens (CLS, registers) begin the keys of the attention layers: the image
        tokens their weights ``(..., Li)`` cover are these, then the patch grid."""
        return self.fuser.attended_prefix_tokens(self.image_encoder.num_prefix_tokens)

    @property
    def has_fusion_heads(self) -> bool:
        """Whether the fuser has cross-attention heads to draw, score or prune."""
        return bool(self.attention_layers)

    @property
    def num_fusion_layers(self) -> int:
        """Number of the fuser's cross-attention layers (0 for ``map_program``)."""
        return len(self.attention_layers)

    @property
    def num_heads_built(self) -> int:
        """H0: the heads each attention layer was built with, before any pruning (0 without layers)."""
        layers = self.attention_layers
        return layers[0].dim // layers[0].head_dim if layers else 0

    def require_fusion_heads(self, purpose: str, name: str = "this model") -> None:
        """Raise a one-line ``ValueError`` saying why there is nothing to ``purpose`` when the model has no heads.

        Args:
            purpose: what the caller wanted to do with the heads, e.g. ``"prune"``.
            name: how to name the model in the message, e.g. its directory.
        """
        if not self.has_fusion_heads:
            raise ValueError(
                f"{name} has no attention heads to {purpose}: its fuser {self.config.fuser.type!r} "
                "scores the image without cross-attention"
            )

    @property
    def fusion_head_ids(self) -> list[list[int]]:
        """Per attention layer, the original ids of the cross-attention heads still present."""
        return [list(layer.head_ids) for layer in self.attention_layers]

    def _layer_head_masks(self, head_mask: torch.Tensor) -> list[torch.Tensor]:
        """``(L, H0)`` or ``(Bq, L, H0)`` over original ids -> per layer ``(H,)`` or ``(Bq, H)`` over the heads present."""
        expected = (self.num_fusion_layers, self.num_heads_built)
        if head_mask.dim() not in (2, 3) or tuple(head_mask.shape[-2:]) != expected:
            raise ValueError(f"head_mask must be (layers, heads) {expected} or (questions, *{expected}), got {tuple(head_mask.shape)}")
        return [head_mask[..., layer, ids] for layer, ids in enumerate(self.fusion_head_ids)]

    def prune_heads(self, heads: dict[int, Iterable[int]]) -> None:
        """Remove cross-attention heads for real: ``{layer: original head ids}``; recorded in the config."""
        self.require_fusion_heads("prune")
        layers = self.attention_layers
        for layer, ids in heads.items():
            layers[int(layer)].prune_heads(ids)
        self.config.pruned_heads = {str(i): sorted(layer.pruned_heads) for i, layer in enumerate(layers) if layer.pruned_heads}

    def add_answers(self, answers: Sequence[str]) -> None:
        """Append ``answers`` (none of them known yet) to :attr:`answers`: the head grows a score for
        each (:meth:`~vlfuse.heads.Head.extend_answers`), the scores of the others unchanged."""
        known = set(self.answers).intersection(answers)
        if known or len(set(answers)) != len(answers):
            raise ValueError(f"answers to add must be new and distinct; already known: {sorted(known)}")
        self.head.extend_answers(len(answers))
        self.answers.extend(answers)

    # ------------------------------------------------------------------------- save and load
    def _save_pretrained(
        self, save_directory: Path, *, run: model_card.RunRecord | None = None, card_text: dict[str, str] | None = None
    ) -> None:
        """The mixin's hook (:meth:`~vlfuse.hub.HubMixin.save_pretrained` calls it): write weights
        (safetensors), config and answers (JSON), the tokenizer and the model card to
        ``save_directory``, atomically (see :func:`vlfuse.model_io.write_model_folder`): a kill leaves
        the old folder or the new one. A folder that vlfuse did not write is not replaced (``ValueError``)."""
        plain = merged(self)  # each encoder's adapter folded into its weights: the folder needs no peft
        if plain is not self:
            plain._save_pretrained(save_directory, run=run, card_text=card_text)
            return
        meta = {
            "format_version": model_io.FORMAT_VERSION,
            "model_type": model_io.MODEL_TYPE,
            "config": self.config.to_dict(),
            "text_encoder_config": self.text_encoder.model.config.to_dict(),
        }

        def write_files(folder: Path) -> None:
            model_io.save_weights(self, folder)
            model_io.write_json(folder / model_io.ANSWERS_FILE, self.answers, indent=1)
            self.tokenizer.save_pretrained(folder / model_io.TOKENIZER_DIR)

        hub.write_folder(self, Path(save_directory), meta, write_files, run=run, card_text=card_text)

    @classmethod
    def _load_folder(cls, directory: Path, map_location: str | torch.device = "cpu") -> "VLFuseModel":
        """Rebuild a model from a folder :meth:`save_pretrained` wrote, of this format or an earlier one
        (:mod:`vlfuse.model_io`), checked as untrusted data (see :meth:`from_pretrained`)."""
        files = (model_io.WEIGHTS_FILE, model_io.CONFIG_FILE, model_io.ANSWERS_FILE, model_io.TOKENIZER_DIR)
        model_io.require_files(directory, files, "a saved vlfuse model")
        meta = model_io.read_meta(directory, model_io.MODEL_TYPE, model_io.READABLE_FORMATS)
        model_io.verify_files(directory, meta)
        config_file = directory / model_io.CONFIG_FILE
        header = model_io.read_header(directory)  # its errors name the weights file
        architecture, shapes = model_io.parse_config(
            config_file, lambda: model_io.upgrade_answering_model(meta["format_version"], meta["config"], header)
        )
        config = model_io.parse_config(config_file, lambda: VLFuseConfig.from_dict(model_io.with_recorded_interpolation(architecture)))
        text_hf_config = model_io.parse_config(config_file, lambda: saved_text_config(meta["text_encoder_config"]))
        run = model_io.parse_config(config_file, lambda: model_card.read_run(meta))
        answers_file = directory / model_io.ANSWERS_FILE
        answers = model_io.parse_config(answers_file, lambda: answer_list(model_io.read_json(answers_file)))
        tokenizer = load_saved_tokenizer(directory / model_io.TOKENIZER_DIR, text_hf_config.vocab_size)
        processor = processor_for(config, tokenizer)
        described_by = f"{config_file} and {answers_file} ({len(answers)} answers)"
        model = model_io.build_checked(
            lambda: cls(config, answers, processor, text_hf_config=text_hf_config, load_pretrained=False),
            shapes, directory, described_by,
        )
        version = meta["format_version"]
        _, state = model_io.upgrade_answering_model(version, meta["config"], model_io.read_weights(directory, map_location))
        model_io.load_weights(model, state, directory, described_by)
        model.run_record = run
        return model.to(map_location).eval()


def answer_list(answers: Any) -> list[str]:
    """``answers.json``'s content checked to be a list of distinct strings."""
    if not isinstance(answers, list) or not all(isinstance(answer, str) for answer in answers):
        raise ValueError("must be a JSON list of answer strings")
    if len(set(answers)) != len(answers):
        raise ValueError("lists an answer twice")
    return answers


def processor_for(config: VLFuseConfig, tokenizer) -> VLFuseProcessor:
    """The processor of a model of ``config``: ``tokenizer``, and the image size, interpolation and text
    length of its encoders."""
    image = config.image
    return VLFuseProcessor(tokenizer, image_size=image.image_size, max_length=config.text.max_length, interpolation=image.interpolation)


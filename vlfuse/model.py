"""VLFuseModel: image encoder + text encoder + fusion stack + a readout, in four public stages."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig

from vlfuse.encoders import (
    ImageEncoder,
    ImageEncoderConfig,
    TextEncoder,
    TextEncoderConfig,
    TokenCache,
    build_word_tokenizer,
    load_tokenizer,
    scratch_config,
)
from vlfuse.layers import FusionStack, ProjectedContext, head_diversity
from vlfuse.readouts import Readout, get_readout

FORMAT_VERSION = 2
"""Format 2 keeps the readout's weights under ``readout.``; format 1 kept them at the top level
(and accepted options that had no effect), and still loads: see :meth:`VLFuseModel.from_pretrained`."""
READABLE_FORMATS = (1, 2)
WEIGHTS_FILE, CONFIG_FILE, ANSWERS_FILE, TOKENIZER_DIR = "model.safetensors", "config.json", "answers.json", "tokenizer"


@dataclass
class VLFuseConfig:
    """Architecture of a :class:`VLFuseModel`.

    Attributes:
        image: the image encoder.
        text: the text encoder.
        fusion_dim: width of the fusion stack (both encoders are projected to it).
        fusion_depth: number of fusion blocks: at least 1 for a readout of fused tokens (``pool``),
            0 for one that reads the question itself (``map_program``).
        fusion_heads: attention heads per fusion block.
        mlp_ratio: hidden width of the fusion MLPs as a multiple of ``fusion_dim``.
        dropout: dropout on the fusion residual branches and before the ``pool`` classifier.
        attn_dropout: dropout on the fusion attention weights.
        text_self_attention: fusion blocks start with text self-attention.
        gated: fusion branches go through tanh gates initialised to 0.
        attention_normalizer: how the fusion attentions turn scores into weights: ``softmax``
            (the fast SDPA path) or ``leaky_relu`` (linear in the scores; the explicit path).
        diversity_weight: weight of the head-diversity penalty (the mean pairwise cosine
            similarity of the cross-attention heads' distributions, averaged over layers) added to
            the training loss; 0 (default) turns it off. When on, every fusion layer takes the
            explicit attention path in training, to materialise its weights.
        output_gate: the fusion attentions multiply each head's output by a sigmoid gate computed
            from the query token (see :class:`~vlfuse.layers.CrossAttention`).
        mlp_type: the fusion MLPs: ``gelu`` (Linear-GELU-Linear) or ``swiglu`` (gated, see
            :class:`~vlfuse.layers.SwiGLU`).
        readout: the name of the part that turns the question into answer scores (see
            :mod:`vlfuse.readouts`): ``pool`` (mean over the fused question tokens, then a linear
            classifier: any answer vocabulary) or ``map_program`` (the question's word embeddings,
            right to left, run as a program over the image patches, for two-answer existence
            questions such as SHAPES; no fusion blocks).
        pruned_heads: ``{layer: [original head ids]}`` removed from each fusion layer's
            cross-attention (filled by pruning; layers as strings for JSON).

    An option that no part of the chosen architecture reads (every fusion option without fusion
    blocks, e.g. ``diversity_weight`` with ``readout: map_program``) must keep its default: the
    model refuses it by name rather than ignore it.
    """

    image: ImageEncoderConfig = field(default_factory=ImageEncoderConfig)
    text: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    fusion_dim: int = 128
    fusion_depth: int = 2
    fusion_heads: int = 16
    mlp_ratio: float = 2.0
    dropout: float = 0.1
    attn_dropout: float = 0.0
    text_self_attention: bool = True
    gated: bool = True
    attention_normalizer: Literal["softmax", "leaky_relu"] = "softmax"
    diversity_weight: float = 0.0
    output_gate: bool = False
    mlp_type: Literal["gelu", "swiglu"] = "gelu"
    readout: str = "pool"
    pruned_heads: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> "VLFuseConfig":
        data = dict(data)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        image = ImageEncoderConfig(**data.pop("image", {}))
        text = TextEncoderConfig(**data.pop("text", {}))
        return cls(image=image, text=text, **data)


FUSION_OPTIONS = (
    "fusion_heads",
    "mlp_ratio",
    "dropout",
    "attn_dropout",
    "text_self_attention",
    "gated",
    "attention_normalizer",
    "diversity_weight",
    "output_gate",
    "mlp_type",
    "pruned_heads",
)
"""The :class:`VLFuseConfig` fields the fusion stack reads. A readout that reads one of them too lists it
in its ``options`` (``pool``: ``dropout``); without fusion blocks the others must keep their defaults."""


def _default(name: str) -> Any:
    spec = VLFuseConfig.__dataclass_fields__[name]
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def unused_options(config: VLFuseConfig, readout: type[Readout]) -> list[str]:
    """The fields of ``config`` set away from their default that no chosen part reads."""
    used = set(readout.options) | (set(FUSION_OPTIONS) if readout.reads_fusion else set())
    return [name for name in FUSION_OPTIONS if name not in used and getattr(config, name) != _default(name)]


def check_config(config: VLFuseConfig, answers: Sequence[str]) -> type[Readout]:
    """Validate ``config`` with ``answers``; return its readout class. Errors name the option."""
    if len(answers) < 2:
        raise ValueError(f"need at least 2 answers, got {len(answers)}")
    readout = get_readout(config.readout)
    if config.diversity_weight < 0:
        raise ValueError(f"diversity_weight must be >= 0, got {config.diversity_weight}")
    if readout.reads_fusion and config.fusion_depth < 1:
        raise ValueError(f"readout {config.readout!r} reads fused tokens: fusion_depth must be at least 1, got {config.fusion_depth}")
    if not readout.reads_fusion and config.fusion_depth != 0:
        raise ValueError(
            f"readout {config.readout!r} reads the question itself, with no fusion blocks: "
            f"set fusion_depth to 0 (got {config.fusion_depth})"
        )
    unused = unused_options(config, readout)
    if unused:
        shown = ", ".join(f"{name}={getattr(config, name)!r}" for name in unused)
        raise ValueError(
            f"options without effect with readout {config.readout!r} (no fusion blocks): {shown}; "
            "leave them at their defaults"
        )
    readout.check(config, answers)
    return readout


@dataclass
class ImageContext:
    """What a batch of images gives the rest of the model, computed once per image (:meth:`VLFuseModel.encode_images`).

    Attributes:
        layers: per fusion layer, the image keys/values ``(Bi, H, Li, hd)``; empty without fusion blocks.
        readout: what the readout needs of the images (see :meth:`~vlfuse.readouts.Readout.image_context`),
            e.g. the map reader's :class:`~vlfuse.readouts.PatchKeys`; ``None`` for most.
    """

    layers: list[ProjectedContext]
    readout: Any = None

    def select(self, index: slice | torch.Tensor) -> "ImageContext":
        """The images ``index`` (a slice gives views, no copy)."""
        return _combine([self], lambda tensors: tensors[0][index])

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
class Fused:
    """What :meth:`VLFuseModel.fuse` returns.

    Attributes:
        tokens: ``(Bq, Lt, fusion_dim)`` the question tokens after the fusion blocks.
        attentions: ``{layer: (Bq, H, Lt, Li)}`` cross-attention weights of the layers asked for.
        head_diversity: the head-diversity penalty when it is computed (training, weight > 0), else ``None``.
    """

    tokens: torch.Tensor
    attentions: dict[int, torch.Tensor]
    head_diversity: torch.Tensor | None = None


@dataclass
class VLFuseOutput:
    """What :meth:`VLFuseModel.forward` returns.

    Attributes:
        logits: ``(Bq, num_answers)`` answer scores.
        attentions: ``{layer: (Bq, H, Lt, Li)}`` cross-attention weights of the layers asked for.
        text_mask: ``(Bq, Lt)`` True for real (non-padding) question tokens.
        head_diversity: in training mode with ``config.diversity_weight > 0``, the head-diversity
            penalty (scalar, differentiable; see :func:`vlfuse.layers.head_diversity`), else ``None``.
    """

    logits: torch.Tensor
    attentions: dict[int, torch.Tensor]
    text_mask: torch.Tensor
    head_diversity: torch.Tensor | None = None


class VLFuseModel(nn.Module):
    """A vision-language fusion model for answer classification.

    Image tokens (timm ViT) and question tokens (transformers encoder) are projected to
    ``fusion_dim``; a stack of fusion blocks lets each question token attend to the image; a
    readout (:mod:`vlfuse.readouts`, chosen by ``config.readout``) turns the result into scores
    over ``answers``. The four stages are public and :meth:`forward` is their composition:

    - :meth:`encode_images`: pixels -> an :class:`ImageContext`, reusable for many questions;
    - :meth:`encode_questions`: token ids -> question tokens ``(Bq, Lt, fusion_dim)``;
    - :meth:`fuse`: question tokens x image context -> fused tokens (with an optional head mask);
    - :meth:`read_out`: fused tokens -> answer scores.

    Args:
        config: the architecture.
        answers: the answer vocabulary (one classifier output each).
        tokenizer: a transformers tokenizer; for a from-scratch text encoder, build one with
            :func:`vlfuse.encoders.build_word_tokenizer`; for a pretrained one, its own.
        text_hf_config: the transformers config of the text encoder to build without loading
            weights (used by :meth:`from_pretrained`); ``None`` builds from ``config.text``.
        load_pretrained: load pretrained encoder weights where the config names them.
    """

    def __init__(
        self,
        config: VLFuseConfig,
        answers: Sequence[str],
        tokenizer,
        *,
        text_hf_config=None,
        load_pretrained: bool = True,
    ) -> None:
        super().__init__()
        readout = check_config(config, answers)
        self.config = config
        self.answers = list(answers)
        self.tokenizer = tokenizer
        if text_hf_config is None and config.text.name is None:
            text_hf_config = scratch_config(config.text, len(tokenizer), tokenizer.pad_token_id)
        self.image_encoder = ImageEncoder(config.image, load_weights=load_pretrained)
        self.text_encoder = TextEncoder(config.text, text_hf_config)
        self.question_tokens = TokenCache(self._tokenize, tokenizer.pad_token_id, tokenizer.padding_side)
        d = config.fusion_dim
        self.image_proj = nn.Linear(self.image_encoder.width, d)
        self.text_proj = nn.Linear(self.text_encoder.width, d)
        self.fusion = None
        if config.fusion_depth:
            self.fusion = FusionStack.from_config(config, self_attention=config.text_self_attention)
        self.readout = readout(
            config, self.answers, text_width=self.text_encoder.width, grid_size=tuple(self.image_encoder.grid_size)
        )
        for layer, heads in config.pruned_heads.items():
            if not 0 <= int(layer) < config.fusion_depth:
                raise ValueError(f"pruned_heads names layer {layer}, but the model has {config.fusion_depth} fusion layers")
            self.fusion.blocks[int(layer)].cross_attn.prune_heads(heads)

    @classmethod
    def from_config(cls, config: VLFuseConfig, answers: Sequence[str], questions: Iterable[str] = ()) -> "VLFuseModel":
        """Build a new model; a from-scratch text encoder gets a word tokenizer made from ``questions``."""
        if config.text.name is None:
            tokenizer = build_word_tokenizer(questions, config.text.max_length)
        else:
            tokenizer = load_tokenizer(config.text.name)
        return cls(config, answers, tokenizer)

    # ----------------------------------------------------------------------------- the stages
    def tokenize(self, questions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Questions -> ``input_ids`` and ``attention_mask`` (Bq, Lt), truncated to ``max_length``.

        In training, each distinct question is tokenized once (:attr:`question_tokens`, a
        :class:`~vlfuse.encoders.cache.TokenCache`): epochs repeat the same questions, and the
        tokenizer took about 4% of an easy-VQA training step.
        """
        if self.training:
            return self.question_tokens(questions)
        return self._tokenize(questions)

    def _tokenize(self, questions: Sequence[str]) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(
            list(questions),
            padding=True,
            truncation=True,
            max_length=self.config.text.max_length,
            return_tensors="pt",
            return_token_type_ids=False,
        )
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def encode_images(
        self, pixel_values: torch.Tensor | None, image_keys: Sequence[str | None] | None = None
    ) -> ImageContext:
        """Images ``(Bi, 3, S, S)`` in [0, 1] -> their :class:`ImageContext`, reusable for many questions:
        every fusion layer's keys/values and what the readout needs of them. The same as
        ``image_context(embed_images(pixel_values, image_keys))``."""
        return self.image_context(self.embed_images(pixel_values, image_keys))

    def embed_images(
        self, pixel_values: torch.Tensor | None, image_keys: Sequence[str | None] | None = None
    ) -> torch.Tensor:
        """Images ``(Bi, 3, S, S)`` -> image tokens ``(Bi, Li, fusion_dim)``: the image encoder, projected.
        ``image_keys`` name the images for a frozen encoder's cache (see :meth:`ImageEncoder.forward`)."""
        return self.image_proj(self.image_encoder(pixel_values, image_keys))

    def image_context(self, image_tokens: torch.Tensor) -> ImageContext:
        """Image tokens from :meth:`embed_images` -> the keys/values of every fusion layer and the readout's context."""
        layers = [] if self.fusion is None else self.fusion.project_context(image_tokens)
        return ImageContext(layers, self.readout.image_context(image_tokens, self.image_encoder.num_prefix_tokens))

    def encode_questions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(Bq, Lt)`` tokenized questions -> question tokens ``(Bq, Lt, fusion_dim)``: what the readout
        reads of the question (the text encoder's states, each distinct question encoded once; or,
        for ``map_program``, the word embeddings), projected by ``text_proj``."""
        return self.text_proj(self.readout.question_features(self.text_encoder, input_ids, attention_mask))

    def fuse(
        self,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: ImageContext,
        image_index: torch.Tensor | None = None,
        *,
        head_mask: torch.Tensor | None = None,
        weights_from: Iterable[int] = (),
    ) -> Fused:
        """Run the fusion blocks: question tokens attend to their images.

        Args:
            text: ``(Bq, Lt, fusion_dim)`` from :meth:`encode_questions`.
            text_mask: ``(Bq, Lt)`` bool, True for real (non-padding) tokens.
            image_context: from :meth:`encode_images`.
            image_index: ``(Bq,)`` the image of each question (default: question i, image i).
            head_mask: ``(L, H0)`` or ``(Bq, L, H0)`` factors on each cross-attention head's output,
                indexed by ORIGINAL head id (``H0 = config.fusion_heads``; entries of pruned heads are
                ignored, e.g. NaN): 0 gives the logits of the model with that head pruned, 1 leaves
                it; differentiable.
            weights_from: fusion layers whose cross-attention weights to return.

        Without fusion blocks (``map_program``) the tokens pass unchanged; asking such a model for
        a head mask or attention weights is an error.
        """
        wanted = set(weights_from)
        if self.fusion is None:
            if wanted or head_mask is not None:
                self.require_fusion_heads("mask or draw")
            return Fused(text, {})
        # The diversity penalty needs every layer's weights: only then do all layers leave SDPA.
        diversity_layers = range(len(self.fusion)) if self.training and self.config.diversity_weight > 0 else ()
        tokens, attentions = self.fusion(
            text,
            text_mask=text_mask,
            kvs=image_context.layers,
            image_index=image_index,
            weights_from=wanted.union(diversity_layers),
            head_masks=None if head_mask is None else self._layer_head_masks(head_mask),
        )
        diversity = None
        if diversity_layers:
            diversity = torch.stack([head_diversity(attentions[i], text_mask) for i in diversity_layers]).mean()
            attentions = {i: w for i, w in attentions.items() if i in wanted}
        return Fused(tokens, attentions, diversity)

    def read_out(
        self,
        tokens: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: ImageContext,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fused question tokens ``(Bq, Lt, fusion_dim)`` -> answer scores ``(Bq, num_answers)``."""
        return self.readout(tokens, text_mask, image_context.readout, image_index)

    def forward(
        self,
        pixel_values: torch.Tensor | None,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        image_index: torch.Tensor | None = None,
        image_context: ImageContext | None = None,
        head_mask: torch.Tensor | None = None,
        weights_from: Iterable[int] = (),
    ) -> VLFuseOutput:
        """Answer scores for each question: the four stages in turn.

        Args:
            pixel_values: ``(Bi, 3, S, S)`` images in [0, 1], or ``None`` with ``image_context``.
            input_ids, attention_mask: ``(Bq, Lt)`` tokenized questions.
            image_index: ``(Bq,)`` the image of each question when images are shared
                (default: question i is about image i).
            image_context: from :meth:`encode_images`, instead of ``pixel_values``.
            head_mask: per-head factors, see :meth:`fuse`.
            weights_from: fusion layers whose cross-attention weights to return.
        """
        if image_context is None:
            image_context = self.encode_images(pixel_values)
        text_mask = attention_mask.bool()
        text = self.encode_questions(input_ids, attention_mask)
        fused = self.fuse(text, text_mask, image_context, image_index, head_mask=head_mask, weights_from=weights_from)
        logits = self.read_out(fused.tokens, text_mask, image_context, image_index)
        return VLFuseOutput(logits, fused.attentions, text_mask, fused.head_diversity)

    # ----------------------------------------------------------------------------- fusion heads
    @property
    def has_fusion_heads(self) -> bool:
        """Whether the model has fusion blocks, and so cross-attention heads to draw, score or prune."""
        return self.fusion is not None

    @property
    def num_fusion_layers(self) -> int:
        """Number of fusion blocks (0 for a readout without them, such as ``map_program``)."""
        return self.config.fusion_depth

    def require_fusion_heads(self, purpose: str, name: str = "this model") -> None:
        """Raise a one-line ``ValueError`` saying why there is nothing to ``purpose`` when the model has no heads.

        Args:
            purpose: what the caller wanted to do with the heads, e.g. ``"prune"``.
            name: how to name the model in the message, e.g. its directory.
        """
        if not self.has_fusion_heads:
            raise ValueError(
                f"{name} has no fusion heads to {purpose}: its readout {self.config.readout!r} "
                "reads the question without fusion blocks (fusion_depth 0)"
            )

    @property
    def fusion_head_ids(self) -> list[list[int]]:
        """Per fusion layer, the original ids of the cross-attention heads still present."""
        return [] if self.fusion is None else [list(block.cross_attn.head_ids) for block in self.fusion.blocks]

    def _layer_head_masks(self, head_mask: torch.Tensor) -> list[torch.Tensor]:
        """``(L, H0)`` or ``(Bq, L, H0)`` over original ids -> per layer ``(H,)`` or ``(Bq, H)`` over the heads present."""
        expected = (self.num_fusion_layers, self.config.fusion_heads)
        if head_mask.dim() not in (2, 3) or tuple(head_mask.shape[-2:]) != expected:
            raise ValueError(f"head_mask must be (layers, heads) {expected} or (questions, *{expected}), got {tuple(head_mask.shape)}")
        return [head_mask[..., layer, ids] for layer, ids in enumerate(self.fusion_head_ids)]

    def prune_heads(self, heads: dict[int, Iterable[int]]) -> None:
        """Remove cross-attention heads for real: ``{layer: original head ids}``; recorded in the config."""
        self.require_fusion_heads("prune")
        for layer, ids in heads.items():
            self.fusion.blocks[int(layer)].cross_attn.prune_heads(ids)
        self.config.pruned_heads = {
            str(i): sorted(block.cross_attn.pruned_heads)
            for i, block in enumerate(self.fusion.blocks)
            if block.cross_attn.pruned_heads
        }

    # ------------------------------------------------------------------------- save and load
    def save_pretrained(self, directory: str | Path) -> Path:
        """Write weights (safetensors), config and answers (JSON) and the tokenizer to ``directory``."""
        directory = save_weights(self, directory)
        meta = {
            "format_version": FORMAT_VERSION,
            "model_type": "vlfuse",
            "config": asdict(self.config),
            "text_encoder_config": self.text_encoder.model.config.to_dict(),
        }
        (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        (directory / ANSWERS_FILE).write_text(json.dumps(self.answers, indent=1) + "\n")
        self.tokenizer.save_pretrained(directory / TOKENIZER_DIR)
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str | torch.device = "cpu") -> "VLFuseModel":
        """Rebuild a model saved by :meth:`save_pretrained`; nothing is unpickled, no hub is needed.

        Format 1 (before readouts were parts) loads too: its readout weights are renamed with the
        readout's :attr:`~vlfuse.readouts.Readout.format_v1_keys`, and the options it accepted but
        never read are reset to their defaults (they had no effect), so the logits are unchanged.
        """
        directory = Path(directory)
        require_files(directory, (WEIGHTS_FILE, CONFIG_FILE, ANSWERS_FILE, TOKENIZER_DIR), "a saved vlfuse model")
        meta = json.loads((directory / CONFIG_FILE).read_text())
        version = meta.get("format_version")
        if meta.get("model_type") != "vlfuse" or version not in READABLE_FORMATS:
            raise ValueError(
                f"{directory / CONFIG_FILE} was written by another vlfuse version "
                f"(format {version!r}, this version reads {' and '.join(map(str, READABLE_FORMATS))})"
            )
        config = VLFuseConfig.from_dict(meta["config"])
        if version == 1:
            for name in unused_options(config, get_readout(config.readout)):
                setattr(config, name, _default(name))
        answers = json.loads((directory / ANSWERS_FILE).read_text())
        text_hf = meta["text_encoder_config"]
        text_hf_config = AutoConfig.for_model(text_hf.pop("model_type"), **text_hf)
        model = cls(
            config,
            answers,
            load_tokenizer(str(directory / TOKENIZER_DIR)),
            text_hf_config=text_hf_config,
            load_pretrained=False,
        )
        state = load_file(directory / WEIGHTS_FILE, device=str(map_location))
        if version == 1:
            state = {_rename(key, model.readout.format_v1_keys): value for key, value in state.items()}
        described_by = f"{directory / CONFIG_FILE} and {directory / ANSWERS_FILE} ({len(answers)} answers)"
        load_weights(model, state, directory, described_by)
        return model.to(map_location).eval()


def save_weights(model: nn.Module, directory: str | Path) -> Path:
    """Create ``directory`` and write ``model``'s state to its ``model.safetensors``; return the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    return directory


def require_files(directory: Path, names: Sequence[str], what: str) -> None:
    """Raise ``FileNotFoundError`` naming ``directory`` when it is missing or lacks one of ``names``."""
    if not directory.is_dir():
        raise FileNotFoundError(f"model folder not found: {directory}")
    missing = [n for n in names if not (directory / n).exists()]
    if missing:
        raise FileNotFoundError(f"{directory} is not {what}: missing {', '.join(missing)}")


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], directory: Path, described_by: str) -> None:
    """Load ``state`` (read from ``directory``'s weights file) into ``model``, built from ``described_by``
    (the files that describe it); a key of another shape, missing or extra is a one-line ``ValueError``."""
    own = model.state_dict()
    wrong = [key for key, value in state.items() if key in own and value.shape != own[key].shape]
    if wrong:
        key = wrong[0]
        raise ValueError(
            f"{directory / WEIGHTS_FILE} does not match {described_by}: {key} is {tuple(state[key].shape)} "
            f"in the file, {tuple(own[key].shape)} in the model they describe"
        )
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{directory / WEIGHTS_FILE} does not match {directory / CONFIG_FILE}: "
            f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def _rename(key: str, prefixes: dict[str, str]) -> str:
    """``key`` with its first matching old prefix replaced by the new one."""
    for old, new in prefixes.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key

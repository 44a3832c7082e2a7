"""VLFuseModel: image encoder + text encoder + fusion stack + answer classifier."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig

from vlfuse.encoders import (
    ImageEncoder,
    ImageEncoderConfig,
    TextEncoder,
    TextEncoderConfig,
    build_word_tokenizer,
    load_tokenizer,
    scratch_config,
)
from vlfuse.layers import FusionStack, MapProgramReader, ProjectedContext, head_diversity
from vlfuse.layers.map_program import ExistenceClassifier

FORMAT_VERSION = 1
READOUTS = ("pool", "map_program")
WEIGHTS_FILE, CONFIG_FILE, ANSWERS_FILE, TOKENIZER_DIR = "model.safetensors", "config.json", "answers.json", "tokenizer"


@dataclass
class VLFuseConfig:
    """Architecture of a :class:`VLFuseModel`.

    Attributes:
        image: the image encoder.
        text: the text encoder.
        fusion_dim: width of the fusion stack (both encoders are projected to it).
        fusion_depth: number of fusion blocks (0, and only 0, with the ``map_program`` readout).
        fusion_heads: attention heads per fusion block.
        mlp_ratio: hidden width of the fusion MLPs as a multiple of ``fusion_dim``.
        dropout: dropout on the fusion residual branches and before the classifier.
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
        readout: how the question becomes answer scores: ``pool`` (mean over the fused
            question tokens, then a linear classifier: any answer vocabulary) or ``map_program``
            (:class:`~vlfuse.layers.MapProgramReader`: the question's word embeddings, right to
            left, run as a program over the image patches, for two-answer existence questions such
            as SHAPES; needs ``fusion_depth`` 0 and, for a from-scratch text encoder, ``depth`` 0).
        pruned_heads: ``{layer: [original head ids]}`` removed from each fusion layer's
            cross-attention (filled by pruning; layers as strings for JSON).
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
    readout: Literal["pool", "map_program"] = "pool"
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


def _check_map_program(config: VLFuseConfig, answers: Sequence[str]) -> None:
    """The ``map_program`` readout: no fusion blocks, no unused encoder layers, two answers."""
    if config.fusion_depth != 0:
        raise ValueError(
            "readout 'map_program' reads the question's word embeddings, with no fusion blocks: "
            f"set fusion_depth to 0 (got {config.fusion_depth})"
        )
    if config.text.name is None and config.text.depth != 0:
        raise ValueError(
            "readout 'map_program' reads the question's word embeddings, not the encoder's layers: "
            f"set text.depth to 0 for a from-scratch text encoder (got {config.text.depth})"
        )
    if len(answers) != 2:
        raise ValueError(
            f"readout 'map_program' answers existence questions with two answers (e.g. false/true), got {len(answers)}"
        )


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
    ``fusion_dim``; a stack of fusion blocks lets each question token attend to the image; the
    fused question tokens are mean-pooled over real tokens and classified over ``answers``
    (``readout="pool"``), or run as a program over the image patches by a
    :class:`~vlfuse.layers.MapProgramReader` (``readout="map_program"``).

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
        if len(answers) < 2:
            raise ValueError(f"need at least 2 answers, got {len(answers)}")
        if config.diversity_weight < 0:
            raise ValueError(f"diversity_weight must be >= 0, got {config.diversity_weight}")
        if config.readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {config.readout!r}")
        if config.readout == "map_program":
            _check_map_program(config, answers)
        self.config = config
        self.answers = list(answers)
        self.tokenizer = tokenizer
        if text_hf_config is None and config.text.name is None:
            text_hf_config = scratch_config(config.text, len(tokenizer), tokenizer.pad_token_id)
        self.image_encoder = ImageEncoder(config.image, load_weights=load_pretrained)
        self.text_encoder = TextEncoder(config.text, text_hf_config)
        d = config.fusion_dim
        self.image_proj = nn.Linear(self.image_encoder.width, d)
        self.text_proj = nn.Linear(self.text_encoder.width, d)
        self.fusion = None if config.readout == "map_program" else FusionStack(
            config.fusion_depth,
            d,
            config.fusion_heads,
            mlp_ratio=config.mlp_ratio,
            dropout=config.dropout,
            attn_dropout=config.attn_dropout,
            self_attention=config.text_self_attention,
            gated=config.gated,
            attention_normalizer=config.attention_normalizer,
            output_gate=config.output_gate,
            mlp_type=config.mlp_type,
        )
        if config.readout == "map_program":
            # word embeddings start tiny (std 0.02), under text_proj's bias: normalise them first,
            # or every word reaches the reader as nearly the same vector
            self.word_norm = nn.LayerNorm(self.text_encoder.width)
            self.reader = MapProgramReader(d, self.image_encoder.grid_size)
            self.head = ExistenceClassifier()
        else:
            self.reader = None
            self.head = nn.Sequential(nn.LayerNorm(d), nn.Dropout(config.dropout), nn.Linear(d, len(self.answers)))
        self._apply_pruning(config.pruned_heads)

    @classmethod
    def from_config(cls, config: VLFuseConfig, answers: Sequence[str], questions: Iterable[str] = ()) -> "VLFuseModel":
        """Build a new model; a from-scratch text encoder gets a word tokenizer made from ``questions``."""
        if config.text.name is None:
            tokenizer = build_word_tokenizer(questions, config.text.max_length)
        else:
            tokenizer = load_tokenizer(config.text.name)
        return cls(config, answers, tokenizer)

    # ----------------------------------------------------------------- the forward pass, in parts
    def tokenize(self, questions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Questions -> ``input_ids`` and ``attention_mask`` (Bq, Lt), truncated to ``max_length``."""
        encoded = self.tokenizer(
            list(questions),
            padding=True,
            truncation=True,
            max_length=self.config.text.max_length,
            return_tensors="pt",
            return_token_type_ids=False,
        )
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def encode_images(self, pixel_values: torch.Tensor) -> list[ProjectedContext]:
        """Images (Bi, 3, S, S) in [0, 1] -> per-layer keys/values, reusable for many questions.

        With the ``map_program`` readout (no fusion layers), the one entry is the reader's patch
        keys (prefix tokens such as CLS left out).
        """
        tokens = self.image_proj(self.image_encoder(pixel_values))  # (Bi, Li, fusion_dim)
        if self.reader is not None:
            return [self.reader.project_context(tokens[:, self.image_encoder.num_prefix_tokens :])]
        return self.fusion.project_context(tokens)

    def encode_questions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Text encoder states (Bq, Lt, width), computed once per distinct question in the batch.

        Datasets repeat questions (easy-VQA has a few hundred distinct ones); the encoder output
        depends on the question alone, so duplicates are gathered, not recomputed. Gradients
        flow back through the gather to every use.
        """
        tokens = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)  # (Bq, 2 * Lt)
        distinct, inverse = torch.unique(tokens, dim=0, return_inverse=True)
        if len(distinct) == len(tokens):
            return self.text_encoder(input_ids, attention_mask)
        ids, mask = distinct.split(input_ids.shape[1], dim=1)
        return self.text_encoder(ids, mask)[inverse]

    def reader_words(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(Bq, Lt)`` token ids -> what the ``map_program`` reader reads, ``(Bq, Lt, fusion_dim)``:
        the word embeddings, layer-normalised and projected (no position, no context)."""
        if self.reader is None:
            raise ValueError("reader_words needs the 'map_program' readout")
        return self.text_proj(self.word_norm(self.text_encoder.embed_words(input_ids)))

    def forward(
        self,
        pixel_values: torch.Tensor | None,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        image_index: torch.Tensor | None = None,
        image_kvs: list[ProjectedContext] | None = None,
        weights_from: Iterable[int] = (),
    ) -> VLFuseOutput:
        """Answer scores for each question.

        Args:
            pixel_values: ``(Bi, 3, S, S)`` images in [0, 1], or ``None`` with ``image_kvs``.
            input_ids, attention_mask: ``(Bq, Lt)`` tokenized questions.
            image_index: ``(Bq,)`` the image of each question when images are shared
                (default: question i is about image i).
            image_kvs: keys/values from :meth:`encode_images`, instead of ``pixel_values``.
            weights_from: fusion layers whose cross-attention weights to return.
        """
        if image_kvs is None:
            image_kvs = self.encode_images(pixel_values)
        text_mask = attention_mask.bool()
        wanted = set(weights_from)
        if self.reader is not None:
            if wanted:
                raise ValueError(f"weights_from={sorted(wanted)}, but this model has no fusion layers (readout 'map_program')")
            evidence = self.reader(self.reader_words(input_ids), text_mask, image_kvs[0], image_index)  # (Bq,)
            return VLFuseOutput(self.head(evidence), {}, text_mask)
        text = self.text_proj(self.encode_questions(input_ids, attention_mask))  # (Bq, Lt, fusion_dim)
        # The diversity penalty needs every layer's weights: only then do all layers leave SDPA.
        diversity_layers = range(len(self.fusion)) if self.training and self.config.diversity_weight > 0 else ()
        fused, attentions = self.fusion(
            text,
            text_mask=text_mask,
            kvs=image_kvs,
            image_index=image_index,
            weights_from=wanted.union(diversity_layers),
        )
        diversity = None
        if diversity_layers:
            diversity = torch.stack([head_diversity(attentions[i], text_mask) for i in diversity_layers]).mean()
            attentions = {i: w for i, w in attentions.items() if i in wanted}
        weights = text_mask.unsqueeze(-1).to(fused.dtype)  # (Bq, Lt, 1)
        pooled = (fused * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # (Bq, fusion_dim)
        return VLFuseOutput(self.head(pooled), attentions, text_mask, diversity)

    # ----------------------------------------------------------------------------- head pruning
    @property
    def num_fusion_layers(self) -> int:
        """Number of fusion blocks (0 for the ``map_program`` readout, which has none)."""
        return 0 if self.fusion is None else len(self.fusion)

    def _apply_pruning(self, pruned_heads: dict[str, list[int]]) -> None:
        if pruned_heads and self.fusion is None:
            raise ValueError("pruned_heads given, but this model has no fusion layers (readout 'map_program')")
        for layer, heads in pruned_heads.items():
            index = int(layer)
            if not 0 <= index < len(self.fusion):
                raise ValueError(f"pruned_heads names layer {layer}, but the model has {len(self.fusion)} fusion layers")
            self.fusion.blocks[index].cross_attn.prune_heads(heads)

    def prune_heads(self, heads: dict[int, Iterable[int]]) -> None:
        """Remove cross-attention heads for real: ``{layer: original head ids}``; recorded in the config."""
        if self.fusion is None:
            raise ValueError("this model has no fusion heads to prune (readout 'map_program')")
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
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt"})
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
        """Rebuild a model saved by :meth:`save_pretrained`; nothing is unpickled, no hub is needed."""
        directory = Path(directory)
        missing = [n for n in (WEIGHTS_FILE, CONFIG_FILE, ANSWERS_FILE, TOKENIZER_DIR) if not (directory / n).exists()]
        if missing:
            raise FileNotFoundError(f"{directory} is not a saved vlfuse model: missing {', '.join(missing)}")
        meta = json.loads((directory / CONFIG_FILE).read_text())
        if meta.get("model_type") != "vlfuse" or meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{directory / CONFIG_FILE} was written by another vlfuse version "
                f"(format {meta.get('format_version')!r}, this version reads {FORMAT_VERSION})"
            )
        config = VLFuseConfig.from_dict(meta["config"])
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
        classifier = state.get("head.2.weight")
        if classifier is not None and classifier.shape[0] != len(answers):
            raise ValueError(
                f"{directory / ANSWERS_FILE} lists {len(answers)} answers but the classifier in "
                f"{directory / WEIGHTS_FILE} has {classifier.shape[0]} outputs"
            )
        result = model.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(
                f"{directory / WEIGHTS_FILE} does not match {directory / CONFIG_FILE}: "
                f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
            )
        return model.to(map_location).eval()

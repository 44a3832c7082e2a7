"""CaptionModel: an image encoder and a caption decoder, saved like :class:`~vlfuse.model.VLFuseModel`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from vlfuse import hub, model_card, model_io
from vlfuse.encoders import ImageEncoder, ImageEncoderConfig, build_word_tokenizer, load_saved_tokenizer
from vlfuse.encoders.adapters import merged
from vlfuse.parts import MAX_HEADS, MAX_LAYERS, MAX_TOKENS, MAX_WIDTH, check_fields, check_mlp_ratio, check_range
from vlfuse.heads.caption_decoder import CaptionDecoder, DecoderCache, DecoderOutput
from vlfuse.model import ImageContext
from vlfuse.processor import VLFuseProcessor

FORMAT_VERSION = 1
MODEL_TYPE = "vlfuse-caption"
EMBEDDINGS = "decoder.embed.weight"
"""The decoder's word embeddings in a saved folder's weights: ``(vocabulary, dim)``."""
CHECKPOINTED_PARTS = ("image", "decoder")
"""The parts :meth:`CaptionModel.set_grad_checkpointing` can checkpoint."""


@dataclass
class CaptionConfig:
    """Architecture of a :class:`CaptionModel`.

    Attributes:
        image: the image encoder.
        dim: width of the decoder (the image tokens are projected to it).
        depth: number of decoder blocks.
        heads: attention heads of every decoder attention (causal self-attention and cross-attention).
        mlp_ratio: hidden width of the decoder MLPs as a multiple of ``dim``.
        mlp_type: ``gelu`` or ``swiglu`` (a name of :data:`vlfuse.layers.MLP_LAYERS`).
        dropout: dropout on the embeddings and the residual branches.
        attn_dropout: dropout on the attention weights.
        gated: the cross-attention and MLP branches go through tanh gates initialised to 0 (Flamingo's
            way of adding a block to a trained text model; a decoder trained from scratch learns
            faster without them).
        max_length: the longest caption in tokens, begin and end tokens included (the decoder's positions).
    """

    image: ImageEncoderConfig = field(default_factory=ImageEncoderConfig)
    dim: int = 128
    depth: int = 2
    heads: int = 16
    mlp_ratio: float = 2.0
    mlp_type: str = "gelu"
    dropout: float = 0.1
    attn_dropout: float = 0.0
    gated: bool = False
    max_length: int = 40

    def __post_init__(self) -> None:
        check_fields(self, "caption model")
        check_range("dim", self.dim, 1, MAX_WIDTH)
        check_range("depth", self.depth, 1, MAX_LAYERS)
        check_range("heads", self.heads, 1, MAX_HEADS)
        check_mlp_ratio("mlp_ratio", self.mlp_ratio)
        check_range("max_length", self.max_length, 2, MAX_TOKENS)

    @classmethod
    def from_dict(cls, data: dict) -> "CaptionConfig":
        data = dict(data)
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown caption model config keys: {unknown}")
        return cls(image=ImageEncoderConfig(**data.pop("image", {})), **data)


class CaptionTokens:
    """A caption model's text side, from its ``processor`` (a :class:`~vlfuse.processor.VLFuseProcessor`
    whose tokenizer has pad, cls = begin and sep = end tokens): a caption is ``BOS words EOS``."""

    processor: VLFuseProcessor

    @property
    def tokenizer(self):
        """The processor's tokenizer."""
        return self.processor.tokenizer

    @property
    def bos_id(self) -> int:
        return self.tokenizer.cls_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.sep_token_id

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def tokenize(self, captions: Iterable[str]) -> torch.Tensor:
        """Captions -> ``(B, L)`` ids ``BOS words EOS``, right-padded, at most ``max_length`` tokens."""
        return self.processor.tokenize(captions)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids -> the caption: the words up to the first end token, joined by spaces."""
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        special = {self.bos_id, self.pad_id}
        return " ".join(self.tokenizer.convert_ids_to_tokens([i for i in ids if i not in special]))


class CaptionModel(CaptionTokens, nn.Module, hub.HubMixin, **model_card.hub_metadata(MODEL_TYPE)):
    """Writes a caption for an image: a timm ViT encodes the image, a causal decoder of fusion
    blocks (:class:`~vlfuse.heads.caption_decoder.CaptionDecoder`) writes the words, each of them
    attending to the image patches with 16-head cross-attention.

    The processor's tokenizer wraps a caption as ``BOS words EOS``: its ``cls_token`` begins and its
    ``sep_token`` ends a caption. The stages: :meth:`encode_images` (pixels -> per-block image
    keys/values, projected once per image) and :meth:`decode` (tokens -> next-token scores, with an
    optional cache); :meth:`forward` is teacher forcing. Generation is :mod:`vlfuse.captioning.generate`.
    It saves, loads and shares as :class:`~vlfuse.model.VLFuseModel` does (:class:`vlfuse.hub.HubMixin`).

    Args:
        config: the architecture.
        processor: the tokenizer (with pad, cls = begin and sep = end tokens) and image transform,
            e.g. from :meth:`from_config`.
        load_pretrained: load pretrained image-encoder weights where the config names them.
    """

    def __init__(self, config: CaptionConfig, processor: VLFuseProcessor, *, load_pretrained: bool = True) -> None:
        super().__init__()
        tokenizer = processor.tokenizer
        for role in ("pad_token_id", "cls_token_id", "sep_token_id"):
            if getattr(tokenizer, role, None) is None:
                raise ValueError(f"the caption tokenizer needs a {role.removesuffix('_id')} (pad, begin = cls, end = sep)")
        self.config = config
        self.processor = processor
        self.run_record: model_card.RunRecord | None = None
        self.image_encoder = ImageEncoder(config.image, load_weights=load_pretrained)
        self.image_proj = nn.Linear(self.image_encoder.width, config.dim)
        self.decoder = CaptionDecoder(
            len(tokenizer),
            config.max_length,
            config.dim,
            config.depth,
            config.heads,
            dropout=config.dropout,
            attn_dropout=config.attn_dropout,
            mlp_ratio=config.mlp_ratio,
            mlp_layer=config.mlp_type,
            gated=config.gated,
        )

    @classmethod
    def from_config(cls, config: CaptionConfig, captions: Iterable[str]) -> "CaptionModel":
        """A new model whose word-level tokenizer knows every word of ``captions``."""
        return cls(config, caption_processor(config, build_word_tokenizer(captions, config.max_length)))

    # ----------------------------------------------------------------------------- the stages
    def encode_images(self, pixel_values: torch.Tensor) -> ImageContext:
        """Images ``(Bi, 3, S, S)`` in [0, 1] -> every block's cross-attention keys/values ``(Bi, H, Li, hd)``."""
        return ImageContext(self.decoder.project_context(self.image_proj(self.image_encoder(pixel_values))))

    def decode(
        self,
        input_ids: torch.Tensor,
        image_context: ImageContext,
        *,
        image_index: torch.Tensor | None = None,
        cache: DecoderCache | None = None,
        weights_from: Iterable[int] = (),
    ) -> DecoderOutput:
        """Next-token scores ``(B, Lt, vocab)`` for ``input_ids`` ``(B, Lt)`` (see :meth:`CaptionDecoder.forward`)."""
        return self.decoder(
            input_ids, image_context.features, image_index=image_index, cache=cache, weights_from=tuple(weights_from)
        )

    def new_cache(self) -> DecoderCache:
        """An empty cache for step-by-step decoding."""
        return DecoderCache.empty(len(self.decoder.blocks))

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: ``(B, L, vocab)`` scores of each next token of ``input_ids`` ``(B, L)``."""
        return self.decode(input_ids, self.encode_images(pixel_values)).logits

    @property
    def num_layers(self) -> int:
        """Decoder blocks, each with one cross-attention layer."""
        return len(self.decoder.blocks)

    def set_grad_checkpointing(self, enable: bool = True, parts: Iterable[str] | None = None) -> list[str]:
        """Activation checkpointing of ``parts`` (of :data:`CHECKPOINTED_PARTS`: ``"image"``, ``"decoder"``;
        ``None``: both), as :meth:`VLFuseModel.set_grad_checkpointing <vlfuse.model.VLFuseModel.set_grad_checkpointing>`
        does: the decoder's blocks in teacher forcing; a frozen image encoder is left out. Returns the parts it set."""
        names = list(CHECKPOINTED_PARTS if parts is None else [parts] if isinstance(parts, str) else parts)
        unknown = [name for name in names if name not in CHECKPOINTED_PARTS]
        if unknown:
            raise ValueError(f"activation checkpointing: unknown parts {unknown}; the caption model's parts are {list(CHECKPOINTED_PARTS)}")
        modules = {"image": self.image_encoder, "decoder": self.decoder}
        chosen = [name for name in CHECKPOINTED_PARTS if name in names and not (enable and name == "image" and self.config.image.freeze)]
        for name in chosen:
            modules[name].set_grad_checkpointing(enable)
        return chosen

    # ------------------------------------------------------------------------- save and load
    def _save_pretrained(
        self, save_directory: Path, *, run: model_card.RunRecord | None = None, card_text: dict[str, str] | None = None
    ) -> None:
        """The mixin's hook: write weights (safetensors), config (JSON), the tokenizer and the model card
        to ``save_directory``, atomically (as :meth:`VLFuseModel._save_pretrained <vlfuse.model.VLFuseModel._save_pretrained>`)."""
        plain = merged(self)  # each encoder's adapter folded into its weights: the folder needs no peft
        if plain is not self:
            plain._save_pretrained(save_directory, run=run, card_text=card_text)
            return
        meta = {"format_version": FORMAT_VERSION, "model_type": MODEL_TYPE, "config": asdict(self.config)}

        def write_files(folder: Path) -> None:
            model_io.save_weights(self, folder)
            self.tokenizer.save_pretrained(folder / model_io.TOKENIZER_DIR)

        hub.write_folder(self, Path(save_directory), meta, write_files, run=run, card_text=card_text)

    @classmethod
    def _load_folder(cls, directory: Path, map_location: str | torch.device = "cpu") -> "CaptionModel":
        """Rebuild a model from a folder :meth:`save_pretrained` wrote, with the checks of
        :meth:`VLFuseModel.from_pretrained <vlfuse.model.VLFuseModel.from_pretrained>`."""
        files = (model_io.WEIGHTS_FILE, model_io.CONFIG_FILE, model_io.TOKENIZER_DIR)
        model_io.require_files(directory, files, "a saved vlfuse caption model")
        meta = model_io.read_meta(directory, MODEL_TYPE, (FORMAT_VERSION,))
        model_io.verify_files(directory, meta)
        config_file = directory / model_io.CONFIG_FILE
        config = model_io.parse_config(config_file, lambda: CaptionConfig.from_dict(model_io.with_recorded_interpolation(meta["config"])))
        run = model_io.parse_config(config_file, lambda: model_card.read_run(meta))
        header = model_io.read_header(directory)
        vocab_size = header.get(EMBEDDINGS, (None,))[0]  # the tokenizer's files and ids are checked against it
        processor = caption_processor(config, load_saved_tokenizer(directory / model_io.TOKENIZER_DIR, vocab_size))
        described_by = str(config_file)
        model = model_io.build_checked(lambda: cls(config, processor, load_pretrained=False), header, directory, described_by)
        model_io.load_weights(model, model_io.read_weights(directory, map_location), directory, described_by)
        model.run_record = run
        return model.to(map_location).eval()


def caption_processor(config: CaptionConfig, tokenizer) -> VLFuseProcessor:
    """The processor of a caption model of ``config``: ``tokenizer``, its image size and its longest caption."""
    image = config.image
    return VLFuseProcessor(tokenizer, image_size=image.image_size, max_length=config.max_length, interpolation=image.interpolation)


def is_caption_model(directory: str | Path) -> bool:
    """Whether ``directory``'s ``config.json`` describes a caption model (``False`` when it has none)."""
    return model_io.model_type_of(directory) == MODEL_TYPE

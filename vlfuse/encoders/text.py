"""Text encoder: any Hugging Face transformers encoder, pretrained or built from a small config."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig
from transformers.masking_utils import create_bidirectional_mask

from vlfuse.encoders.adapters import AdaptableEncoder, AdapterConfig, parse_adapter
from vlfuse.encoders.cache import FeatureCache
from vlfuse.encoders.hub import load_named
from vlfuse.errors import first_line
from vlfuse.parts import MAX_HEADS, MAX_LAYERS, MAX_TOKENS, MAX_WIDTH, check_fields, check_range


@dataclass
class TextEncoderConfig:
    """A transformers encoder: pretrained (``name``) or from scratch (the size fields).

    Attributes:
        name: hub name, local directory or ``package:<module>/<folder>`` (a folder inside an
            installed Python package, see :mod:`vlfuse.encoders.installed`) of a pretrained
            encoder; its tokenizer is used.
            ``None`` builds a ``model_type`` encoder from scratch with a word-level tokenizer
            made from the training questions.
        model_type: architecture for a from-scratch encoder (a transformers model type).
        width: hidden size of a from-scratch encoder.
        depth: number of layers of a from-scratch encoder.
        num_heads: attention heads of a from-scratch encoder.
        max_length: longest question in tokens; longer ones are truncated.
        freeze: keep the encoder's weights fixed during training (it then runs in eval mode).
        cache_features: with ``freeze``, keep the encoder's output for each distinct question in
            memory while the model trains (see :class:`~vlfuse.encoders.cache.FeatureCache`); with
            an ``adapter`` on the upper layers only, keep the output of the layers below them,
            which then run in eval mode (no dropout) as a frozen encoder does.
        adapter: fine-tune a pretrained encoder through an adapter instead of all its weights: a
            mapping with ``type`` (one of :data:`~vlfuse.encoders.adapters.ADAPTERS`: ``lora``) and
            its options, e.g. ``{type: lora, rank: 8}``; an
            :class:`~vlfuse.encoders.adapters.AdapterConfig` once built. A saved model has it merged.
    """

    name: str | None = None
    model_type: str = "bert"
    width: int = 128
    depth: int = 2
    num_heads: int = 4
    max_length: int = 32
    freeze: bool = False
    cache_features: bool = True
    adapter: dict[str, Any] | AdapterConfig | None = None

    def __post_init__(self) -> None:
        check_fields(self, "text")
        self.adapter = parse_adapter(self.adapter, "text")
        if self.adapter is not None and self.name is None:
            raise ValueError("text.adapter adapts a pretrained encoder: set text.name (a from-scratch encoder trains every weight)")
        if self.adapter is not None and self.freeze:
            raise ValueError("text.adapter trains the encoder through its adapter, text.freeze keeps it fixed: set one of them")
        check_range("text.width", self.width, 1, MAX_WIDTH)
        check_range("text.depth", self.depth, 0, MAX_LAYERS)
        check_range("text.num_heads", self.num_heads, 1, MAX_HEADS)
        check_range("text.max_length", self.max_length, 1, MAX_TOKENS)


def scratch_config(config: TextEncoderConfig, vocab_size: int, pad_token_id: int) -> PretrainedConfig:
    """The transformers config of a from-scratch encoder."""
    try:
        return AutoConfig.for_model(
            config.model_type,
            hidden_size=config.width,
            num_hidden_layers=config.depth,
            num_attention_heads=config.num_heads,
            intermediate_size=4 * config.width,
            vocab_size=vocab_size,
            max_position_embeddings=max(config.max_length, 8),
            pad_token_id=pad_token_id,
        )
    except ValueError:
        raise ValueError(f"transformers does not know the text encoder type {config.model_type!r}") from None


class TextEncoder(AdaptableEncoder):
    """Wraps a transformers encoder and returns its last hidden states.

    Args:
        config: which encoder to build.
        hf_config: the transformers config to build from (no weights loaded); when ``None``,
            ``config.name`` is loaded with its pretrained weights.

    With ``config.adapter``, :attr:`model` is the ``peft`` model wrapping the transformers encoder.
    """

    adapted = "model"

    def __init__(self, config: TextEncoderConfig, hf_config: PretrainedConfig | None = None) -> None:
        super().__init__()
        self.config = config
        if hf_config is not None:
            self.model = AutoModel.from_config(hf_config, trust_remote_code=False)
        elif config.name is not None:
            self.model = load_named(partial(AutoModel.from_pretrained, trust_remote_code=False), config.name, "the text encoder")
        else:
            raise ValueError("a from-scratch text encoder needs its transformers config")
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(positions, int) and config.max_length > positions:
            raise ValueError(
                f"text.max_length {config.max_length} is more than the {positions} positions of the text encoder "
                "(its max_position_embeddings): a question that long could not be read"
            )
        if getattr(self.model, "pooler", None) is not None:
            self.model.pooler = None  # unused: we pool after fusion
        self.add_adapter("text.adapter")
        self.frozen_layers = config.adapter.first_adapted_layer if config.adapter is not None and config.cache_features else 0
        """The layers below the adapted ones whose output is cached in training (0: none)."""
        if self.frozen_layers:
            layer_stack(self.model, "text.adapter.layers")  # a BERT-like encoder, or a ValueError now
        # Set the mode from the start (Lightning trains without calling train()): from_pretrained
        # returns the model in eval mode, which would fine-tune it without its dropout.
        if config.freeze:
            self.model.requires_grad_(False).eval()
        else:
            self.train()
        self.cache = FeatureCache() if config.cache_features and (config.freeze or self.frozen_layers) else None

    def train(self, mode: bool = True) -> "TextEncoder":
        """``self.training`` follows the model; a frozen transformer, and the frozen layers whose
        output is cached, stay in eval mode (no dropout)."""
        super().train(mode)
        if self.config.freeze:
            self.model.eval()
        elif self.frozen_layers:
            embeddings, layers = layer_stack(self.model, "text.adapter.layers")
            embeddings.eval()
            layers[: self.frozen_layers].eval()
        return self

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each layer's activations in backward instead of keeping them: transformers' own
        switch (``activation_checkpointing_enable``, the name ``gradient_checkpointing_enable`` has in
        transformers 5; non-reentrant ``torch.utils.checkpoint``, in training), through a peft adapter too.
        An encoder type without it is a ValueError naming it."""
        if not enable:
            self.model.activation_checkpointing_disable()
            self.model.disable_input_require_grads()  # the hook that switching it on adds
            return
        try:
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        except ValueError as err:  # "... does not support activation checkpointing."
            raise ValueError(f"text: {first_line(err)}") from None

    @property
    def width(self) -> int:
        return self.model.config.hidden_size

    def embed_words(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` (B, L) -> the encoder's word embeddings (B, L, width): no position, no context."""
        return self.model.get_input_embeddings()(input_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``input_ids``, ``attention_mask`` (B, L) -> hidden states (B, L, width).

        In training with a cache, the frozen encoder (or its frozen lower layers) runs only on
        questions it has not seen before; their padding positions are then zeros (padding is
        masked everywhere downstream); the adapted layers above run on every question.
        """
        if self.cache is None or not self.training:
            return self._encode(input_ids, attention_mask)
        real = attention_mask.bool()
        keys = [tuple(ids[keep].tolist()) for ids, keep in zip(input_ids, real)]
        frozen = self._encode_frozen_layers if self.frozen_layers else self._encode

        def compute(new: list[int]) -> list[torch.Tensor]:
            states = frozen(input_ids[new], attention_mask[new])
            return [s[keep] for s, keep in zip(states, real[new])]  # each (real tokens, width)

        rows = self.cache.get(keys, compute)
        states = rows[0].new_zeros(*input_ids.shape, self.width)  # (B, L, width)
        states[real] = torch.cat(rows)
        if self.frozen_layers:
            states = self._run_layers(states, attention_mask, layer_stack(self.model, "text.adapter.layers")[1][self.frozen_layers :])
        return states

    def _encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def _encode_frozen_layers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The output of the layers below the adapted ones (B, L, width): the input of the lowest adapted layer."""
        embeddings, layers = layer_stack(self.model, "text.adapter.layers")
        return self._run_layers(embeddings(input_ids=input_ids), attention_mask, layers[: self.frozen_layers])

    def _run_layers(self, hidden: torch.Tensor, attention_mask: torch.Tensor, layers: nn.ModuleList) -> torch.Tensor:
        """``hidden`` (B, L, width) through ``layers``, padding masked as the encoder masks it."""
        mask = create_bidirectional_mask(config=self.model.config, inputs_embeds=hidden, attention_mask=attention_mask)
        for layer in layers:
            hidden = layer(hidden, mask)
        return hidden


def layer_stack(model: nn.Module, where: str) -> tuple[nn.Module, nn.ModuleList]:
    """The embeddings and the list of layers of a BERT-like transformers encoder (``embeddings``,
    ``encoder.layer``), through a ``peft`` wrapper; a ``ValueError`` naming ``where`` for any other."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings, layers = getattr(base, "embeddings", None), getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(embeddings, nn.Module) or not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{where}: caching the output of the layers below the adapted ones needs a BERT-like encoder "
            f"(embeddings, encoder.layer), not {type(base).__name__}; set text.cache_features false"
        )
    return embeddings, layers

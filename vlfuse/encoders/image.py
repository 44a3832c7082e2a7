"""Image encoder: any timm vision transformer, returning every token and the patch grid."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Container, Sequence

import timm
import torch
from timm.data import resolve_data_config
from timm.models import get_pretrained_cfg

from vlfuse.encoders.adapters import AdaptableEncoder, AdapterConfig, parse_adapter
from vlfuse.encoders.cache import FeatureCache, tensor_key
from vlfuse.encoders.feature_store import DiskFeatureStore, encoder_identity
from vlfuse.encoders.hub import use_cache_if_hub_unreachable, weights_not_fetched
from vlfuse.data.transforms import INTERPOLATIONS, check_interpolation
from vlfuse.errors import first_line
from vlfuse.parts import MAX_HEADS, MAX_IMAGE_SIDE, MAX_LAYERS, MAX_WIDTH, check_fields, check_range


@dataclass
class ImageEncoderConfig:
    """A timm vision transformer, from scratch with size overrides or with pretrained weights.

    Attributes:
        name: timm model name, e.g. ``vit_tiny_patch16_224``.
        pretrained: load timm's pretrained weights for ``name`` (needs the model hub or its cache).
        weights_file: load pretrained weights from this local file instead (timm's format).
        image_size: side of the square input image; ``None`` takes the pretrained weights'
            input size (timm's ``pretrained_cfg``), or 64 for a model trained from scratch.
        patch_size: override the patch size (``None`` keeps the model's).
        width: override the embedding width.
        depth: override the number of transformer blocks.
        num_heads: override the number of heads of the encoder's self-attention.
        mean: per-channel mean used to normalise [0, 1] pixels; ``None`` takes the pretrained
            weights' (e.g. ImageNet's for DeiT or DINOv2), or 0.5 from scratch.
        std: per-channel standard deviation used to normalise [0, 1] pixels; ``None`` as ``mean``.
        interpolation: how images are resized to ``image_size``, one of
            :data:`~vlfuse.data.transforms.INTERPOLATIONS`; ``None`` takes the pretrained weights'
            (timm's configs mostly say ``bicubic``), or ``bilinear`` from scratch.
        freeze: keep the encoder's weights fixed during training (it then runs in eval mode).
        cache_features: with ``freeze``, keep the encoder's output for each distinct image in
            memory while the model trains (see :class:`~vlfuse.encoders.cache.FeatureCache`), so
            that it runs once per image (up to 2 GiB of features, see
            :data:`~vlfuse.encoders.cache.DEFAULT_MAX_BYTES`).
        adapter: fine-tune the pretrained weights through an adapter instead of all of them (as
            :attr:`TextEncoderConfig.adapter <vlfuse.encoders.text.TextEncoderConfig.adapter>`;
            a ViT's ``target_modules`` are e.g. ``[qkv, proj]``).
    """

    name: str = "vit_tiny_patch16_224"
    pretrained: bool = False
    weights_file: str | None = None
    image_size: int | None = None
    patch_size: int | None = 8
    width: int | None = 128
    depth: int | None = 2
    num_heads: int | None = 4
    mean: list[float] | None = None
    std: list[float] | None = None
    interpolation: str | None = None
    freeze: bool = False
    cache_features: bool = True
    adapter: dict[str, Any] | AdapterConfig | None = None

    def __post_init__(self) -> None:
        check_fields(self, "image")
        self.adapter = parse_adapter(self.adapter, "image")
        if self.adapter is not None and not (self.pretrained or self.weights_file):
            raise ValueError("image.adapter adapts pretrained weights: set image.pretrained or image.weights_file")
        if self.adapter is not None and self.freeze:
            raise ValueError("image.adapter trains the encoder through its adapter, image.freeze keeps it fixed: set one of them")
        self.resolve_preprocessing()
        check_range("image.image_size", self.image_size, 1, MAX_IMAGE_SIDE)
        check_range("image.patch_size", self.patch_size, 1, self.image_size)
        check_range("image.width", self.width, 1, MAX_WIDTH)
        check_range("image.depth", self.depth, 0, MAX_LAYERS)
        check_range("image.num_heads", self.num_heads, 1, MAX_HEADS)
        for name in ("mean", "std"):
            if len(getattr(self, name)) != 3:
                raise ValueError(f"image.{name} must give 3 numbers (red, green, blue), got {getattr(self, name)}")
        if not all(s > 0 for s in self.std):
            raise ValueError(f"image.std must be positive, got {self.std}")
        check_interpolation(self.interpolation, "image.interpolation")

    def resolve_preprocessing(self) -> None:
        """Fill ``image_size``, ``mean``, ``std`` and ``interpolation`` where they are ``None``: from
        timm's ``pretrained_cfg`` of ``name`` when the weights are pretrained (hub or file), else
        :data:`SCRATCH_PREPROCESSING`. Values the config sets are kept. A saved model's config holds
        the values filled in, so it preprocesses as it was trained."""
        unset = [name for name in PREPROCESSING_FIELDS if getattr(self, name) is None]
        if not unset:
            return
        defaults = pretrained_preprocessing(self.name) if self.pretrained or self.weights_file else SCRATCH_PREPROCESSING
        for name in unset:
            setattr(self, name, copy.copy(defaults[name]))


PREPROCESSING_FIELDS = ("image_size", "mean", "std", "interpolation")
"""The fields of :class:`ImageEncoderConfig` that say how pixels reach the encoder."""

SCRATCH_PREPROCESSING: dict[str, Any] = {"image_size": 64, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bilinear"}
"""The preprocessing of an image encoder trained from scratch (pixels in [-1, 1])."""


def pretrained_preprocessing(name: str) -> dict[str, Any]:
    """The input size, mean, std and interpolation of timm's pretrained weights ``name`` (a model
    name, with or without its ``.tag``), by timm's own ``resolve_data_config``; nothing is downloaded."""
    if not timm.is_model(name):
        raise ValueError(f"timm does not know the image encoder {name!r} (see timm.list_models())")
    try:
        pretrained_cfg = get_pretrained_cfg(name)
    except RuntimeError as err:  # a tag the model does not have
        raise ValueError(f"image.name {name!r}: {first_line(err)} (timm.list_pretrained({name.split('.')[0]!r}) lists them)") from None
    if pretrained_cfg is None:  # a model registered without any pretrained config
        raise ValueError(
            f"timm has no pretrained config for the image encoder {name!r}: set image.image_size, "
            "image.mean, image.std and image.interpolation"
        )
    data = resolve_data_config(pretrained_cfg=pretrained_cfg.to_dict())
    interpolation = data["interpolation"] if data["interpolation"] in INTERPOLATIONS else "bicubic"
    return {"image_size": data["input_size"][-1], "mean": list(data["mean"]), "std": list(data["std"]), "interpolation": interpolation}


class ImageEncoder(AdaptableEncoder):
    """Wraps a timm ViT: normalises [0, 1] pixels and returns all tokens (prefix tokens first).

    Args:
        config: which model to build and how.
        load_weights: load pretrained weights when the config asks for them; ``False`` when the
            weights will come from a saved vlfuse model anyway.

    With ``config.adapter``, :attr:`vit` is the ``peft`` model wrapping the timm model.
    """

    adapted = "vit"

    def __init__(self, config: ImageEncoderConfig, load_weights: bool = True) -> None:
        super().__init__()
        self.config = config
        overrides = {
            key: value
            for key, value in {
                "patch_size": config.patch_size,
                "embed_dim": config.width,
                "depth": config.depth,
                "num_heads": config.num_heads,
            }.items()
            if value is not None
        }
        pretrained = load_weights and (config.pretrained or config.weights_file is not None)
        extra = {"pretrained_cfg_overlay": {"file": config.weights_file}} if pretrained and config.weights_file else {}
        if not timm.is_model(config.name):
            raise ValueError(f"timm does not know the image encoder {config.name!r} (see timm.list_models())")
        if pretrained and config.weights_file and not Path(config.weights_file).is_file():
            raise ValueError(f"model.architecture.image.weights_file: no such file {config.weights_file!r}")
        from_hub = pretrained and not config.weights_file
        if from_hub:
            use_cache_if_hub_unreachable()
        try:
            self.vit = timm.create_model(
                config.name, pretrained=pretrained, num_classes=0, img_size=config.image_size, **overrides, **extra
            )
        except OSError as err:  # huggingface_hub's errors: no connection, not in the cache, no such repository
            if not from_hub:
                raise
            raise ValueError(hub_failure(config.name, err)) from err
        except TypeError as err:  # a model without the ViT's options (img_size, patch_size, ...)
            raise ValueError(f"image encoder {config.name!r} is not a vision transformer with patch tokens: {first_line(err)}") from None
        if not hasattr(self.vit, "forward_features") or not hasattr(self.vit, "patch_embed"):
            raise ValueError(f"image encoder {config.name!r} is not a vision transformer with patch tokens")
        self.add_adapter("image.adapter")
        self.register_buffer("mean", torch.tensor(config.mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(config.std).view(1, 3, 1, 1), persistent=False)
        if config.freeze:
            self.vit.requires_grad_(False).eval()  # from the start: Lightning trains without calling train()
        self.cache = FeatureCache() if config.freeze and config.cache_features else None
        self.store: DiskFeatureStore | None = None
        """The features on disk it reads instead of running (:meth:`use_feature_store`)."""
        self._warned_missing = False

    def train(self, mode: bool = True) -> "ImageEncoder":
        """``self.training`` follows the model; a frozen ViT stays in eval mode (no dropout)."""
        super().train(mode)
        if self.config.freeze:
            self.vit.eval()
        return self

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each ViT block's activations in backward instead of keeping them: timm's own
        ``set_grad_checkpointing`` (through a peft adapter too), which checkpoints every block with
        ``torch.utils.checkpoint``, non-reentrant unless timm is told otherwise (the environment
        variable ``TIMM_REENTRANT_CKPT``): that is refused, as reentrant checkpointing gives no
        gradient to an adapter whose blocks' inputs need none."""
        from timm.layers import use_reentrant_ckpt

        if enable and use_reentrant_ckpt():
            raise ValueError("image: timm is set to reentrant activation checkpointing (TIMM_REENTRANT_CKPT): unset it")
        self.vit.set_grad_checkpointing(enable)

    @property
    def width(self) -> int:
        return self.vit.embed_dim

    @property
    def grid_size(self) -> tuple[int, int]:
        """(rows, columns) of the patch grid."""
        return tuple(self.vit.patch_embed.grid_size)

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patch tokens (CLS, registers)."""
        return self.vit.num_prefix_tokens

    def feature_identity(self) -> dict[str, Any]:
        """What its features depend on (:func:`~vlfuse.encoders.feature_store.encoder_identity`): the
        timm name, the digest of the ViT's weights and the preprocessing."""
        return encoder_identity(self.config.name, self.vit, vars(self.config))

    def use_feature_store(self, store: DiskFeatureStore) -> None:
        """Read the features of the images ``store`` holds instead of running, in training and
        evaluation alike; images it lacks are encoded (through the in-memory cache in training, if
        there is one). Only a frozen encoder reads a store, and only one written by this same encoder
        (a ``ValueError`` names the field that differs)."""
        if not self.config.freeze:
            raise ValueError(f"feature store {store.directory}: the image encoder is trained, not frozen: set model.architecture.image.freeze true")
        store.check_encoder(self.feature_identity())
        tokens = self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
        if store.shape != (tokens, self.width):
            raise ValueError(f"feature store {store.directory} holds features {list(store.shape)}, this encoder gives {[tokens, self.width]}")
        self.store = store

    def held_features(self) -> Container[str] | None:
        """The image keys whose features it has without pixels in training (in its store or its
        cache), for :meth:`~vlfuse.data.GroupedVQADataset.decode_only_uncached`; ``None`` with neither."""
        if self.store is None:
            return self.cache
        return HeldFeatures(self.store, self.cache)

    def forward(self, pixels: torch.Tensor | None, keys: Sequence[str | None] | None = None) -> torch.Tensor:
        """``pixels`` (B, 3, S, S) in [0, 1] -> tokens (B, prefix + rows * cols, width).

        In training, a frozen encoder with a cache runs only on images it has not seen before,
        each known by its entry of ``keys`` (its file, see :func:`vlfuse.data.dataset.image_key`)
        or, where that is ``None`` or ``keys`` is, by its pixels; ``pixels`` may then be ``None``
        if every key is cached. With a feature store (:meth:`use_feature_store`), the images it
        holds are read from it, in training and evaluation, and need no pixels.
        """
        if self.store is not None and keys is not None:
            return self._with_store(pixels, keys)
        return self._encode_or_cache(pixels, keys)

    def _encode_or_cache(self, pixels: torch.Tensor | None, keys: Sequence[str | None] | None) -> torch.Tensor:
        """:meth:`forward` without a store."""
        if self.cache is None or not self.training:
            return self._encode(pixels_given(pixels))
        if keys is None or None in keys:
            pixels = pixels_given(pixels)
            keys = [tensor_key(p) if key is None else key for p, key in zip(pixels, keys or [None] * len(pixels))]
        rows = self.cache.get(keys, lambda new: self._encode(pixels_given(pixels, keys[new[0]])[new]))
        return torch.stack(rows)

    def _with_store(self, pixels: torch.Tensor | None, keys: Sequence[str | None]) -> torch.Tensor:
        """:meth:`forward` with a store: its rows for the keys it holds, the encoder's for the others."""
        stored = [i for i, key in enumerate(keys) if key is not None and key in self.store]
        dtype, device = self.mean.dtype, self.mean.device
        if len(stored) == len(keys):
            return self.store.get(keys).to(device=device, dtype=dtype)
        held = set(stored)
        missing = [i for i in range(len(keys)) if i not in held]
        if not self._warned_missing:
            warnings.warn(f"image {keys[missing[0]]!r} is not in the feature store {self.store.directory}: images it lacks are encoded", stacklevel=3)
            self._warned_missing = True
        pixels = pixels_given(pixels, keys[missing[0]])
        computed = self._encode_or_cache(pixels[missing], [keys[i] for i in missing])  # (missing, tokens, width)
        if not stored:
            return computed
        features = computed.new_empty((len(keys), *computed.shape[1:]))
        features[missing] = computed
        features[stored] = self.store.get([keys[i] for i in stored]).to(device=device, dtype=dtype)
        return features

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vit.forward_features((pixels - self.mean) / self.std)


class HeldFeatures:
    """The image keys of a feature store and of an in-memory cache together (``in`` looks in both)."""

    def __init__(self, store: Container[str], cache: Container[str] | None) -> None:
        self.store = store
        self.cache = cache

    def __contains__(self, key: object) -> bool:
        return key in self.store or (self.cache is not None and key in self.cache)


def pixels_given(pixels: torch.Tensor | None, uncached_key: str | None = None) -> torch.Tensor:
    """``pixels``; when there are none, a ValueError naming the image whose features are not cached."""
    if pixels is None:
        uncached = f": the features of image {uncached_key!r} are not cached" if uncached_key else ""
        raise ValueError(f"the image encoder needs pixel_values{uncached}")
    return pixels


def hub_failure(name: str, err: OSError) -> str:
    """The line for timm weights ``name`` that the hub did not give."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        local = "--model.architecture.image.weights_file FILE (timm's safetensors or .pth of the same model)"
        return weights_not_fetched("model.architecture.image.pretrained", name, local)
    return f"cannot load the pretrained weights of the image encoder {name!r}: {first_line(err)}"

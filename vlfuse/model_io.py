"""Model folders: writing them, reading them back, and reading the formats of earlier versions.

A folder holds ``config.json`` (format version, model type, architecture), ``model.safetensors``
(the weights: nothing is unpickled), ``tokenizer/`` and, for an answering model, ``answers.json``.
:class:`~vlfuse.model.VLFuseModel` and :class:`~vlfuse.captioning.CaptionModel` read and write
them through this module; it imports no model code.

Answering models (``model_type: vlfuse``):

- format 3 (now): the architecture as parts, ``fuser`` and ``head`` each with its ``type``; the
  fuser's weights under ``fuser.``, the head's under ``head.``;
- format 2: one flat architecture (``fusion_depth``, ``readout``, ...), the fusion blocks under
  ``fusion.``, the readout under ``readout.``;
- format 1: as 2, with the readout's weights at the top level.

:func:`upgrade_answering_model` turns a folder's config and weights of format 1 or 2 into format 3,
so that every saved model keeps loading and answering as it did.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
MODEL_TYPE = "vlfuse"
WEIGHTS_FILE, CONFIG_FILE, ANSWERS_FILE, TOKENIZER_DIR = "model.safetensors", "config.json", "answers.json", "tokenizer"

FORMAT_2_DEFAULTS: dict[str, Any] = {
    "fusion_dim": 128,
    "fusion_depth": 2,
    "fusion_heads": 16,
    "mlp_ratio": 2.0,
    "dropout": 0.1,
    "attn_dropout": 0.0,
    "text_self_attention": True,
    "gated": True,
    "attention_normalizer": "softmax",
    "diversity_weight": 0.0,
    "output_gate": False,
    "mlp_type": "gelu",
    "readout": "pool",
    "pruned_heads": {},
}
"""The flat architecture of formats 1 and 2 with its defaults then (a field a file lacks took these)."""

FORMAT_1_KEYS = {
    "pool": {"head.": "readout.classifier."},
    "map_program": {"reader.": "readout.reader.", "word_norm.": "readout.word_norm.", "head.": "readout.existence."},
}
"""Format 1 -> 2: the readout's weights moved from the top level to ``readout.``."""


# ------------------------------------------------------------------------------- writing
def save_weights(model: nn.Module, directory: str | Path) -> Path:
    """Create ``directory`` and write ``model``'s state to its ``model.safetensors``; return the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    return directory


def write_json(path: Path, data: Any, indent: int = 2) -> None:
    """Write ``data`` as JSON with a final newline."""
    path.write_text(json.dumps(data, indent=indent) + "\n")


# ------------------------------------------------------------------------------- reading
def require_files(directory: Path, names: Sequence[str], what: str) -> None:
    """Raise ``FileNotFoundError`` naming ``directory`` when it is missing or lacks one of ``names``."""
    if not directory.is_dir():
        raise FileNotFoundError(f"model folder not found: {directory}")
    missing = [n for n in names if not (directory / n).exists()]
    if missing:
        raise FileNotFoundError(f"{directory} is not {what}: missing {', '.join(missing)}")


def read_json(path: Path) -> Any:
    """The JSON in ``path``; a ``ValueError`` naming the file when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def read_meta(directory: Path, model_type: str, formats: Sequence[int]) -> dict:
    """``config.json`` of ``directory``, checked to describe a ``model_type`` model of one of ``formats``."""
    meta = read_json(directory / CONFIG_FILE)
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("model_type") != model_type or version not in formats:
        found = (meta.get("model_type"), version) if isinstance(meta, dict) else (None, None)
        raise ValueError(
            f"{directory / CONFIG_FILE} is not a {model_type} model of format {' or '.join(map(str, formats))} "
            f"(model_type {found[0]!r}, format {found[1]!r}): written by another vlfuse version, or not by vlfuse"
        )
    return meta


def model_type_of(directory: str | Path) -> str | None:
    """The ``model_type`` in ``directory``'s ``config.json``; ``None`` when it has none or cannot be read."""
    try:
        meta = json.loads((Path(directory) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("model_type") if isinstance(meta, dict) else None


def read_weights(directory: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of ``directory``'s ``model.safetensors``."""
    return load_file(directory / WEIGHTS_FILE, device=str(device))


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


# ------------------------------------------------------------------------------ earlier formats
def parts_of_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """A format-1/2 flat architecture (``fusion_depth``, ``readout``, ...) as the format-3 one
    (``fuser`` and ``head`` parts): the same model, option for option."""
    arch = {key: value for key, value in flat.items() if key not in FORMAT_2_DEFAULTS}  # image, text
    get = {**FORMAT_2_DEFAULTS, **flat}.__getitem__
    arch["fusion_dim"] = get("fusion_dim")
    arch["pruned_heads"] = dict(get("pruned_heads"))
    readout = get("readout")
    if readout in ("pool", "bilinear"):
        arch["fuser"] = {
            "type": "fusion_stack", "depth": get("fusion_depth"), "heads": get("fusion_heads"),
            "mlp_ratio": get("mlp_ratio"), "mlp": get("mlp_type"), "output_gate": get("output_gate"),
            "self_attention": get("text_self_attention"), "gated": get("gated"),
            "normalizer": get("attention_normalizer"), "dropout": get("dropout"),
            "attn_dropout": get("attn_dropout"), "diversity_weight": get("diversity_weight"),
        }
        arch["head"] = {"type": "pooled" if readout == "pool" else "bilinear", "dropout": get("dropout")}
    elif readout == "map_program":
        arch["fuser"], arch["head"] = {"type": "map_program"}, {"type": "existence"}
    elif readout == "cell_steps":
        arch["fuser"] = {
            "type": "cell_steps", "heads": get("fusion_heads"), "mlp_ratio": get("mlp_ratio"),
            "mlp": get("mlp_type"), "output_gate": get("output_gate"), "dropout": get("dropout"),
        }
        arch["head"] = {"type": "existence"}
    else:
        raise ValueError(f"readout {readout!r} of an earlier format is not one vlfuse knows")
    return arch


def format_3_keys(readout: str) -> dict[str, str]:
    """Format 2 -> 3: ``{old prefix: new prefix}`` of the weights of a model with ``readout``."""
    if readout in ("pool", "bilinear"):
        return {"fusion.": "fuser.stack.", "readout.": "head."}
    return {"readout.existence.": "head.", "readout.": "fuser."}


def rename(state: dict[str, torch.Tensor], prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """``state`` with each key's first matching old prefix replaced by the new one."""
    def renamed(key: str) -> str:
        for old, new in prefixes.items():
            if key.startswith(old):
                return new + key[len(old):]
        return key

    return {renamed(key): value for key, value in state.items()}


def upgrade_answering_model(
    version: int, config: dict[str, Any], state: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A format-``version`` architecture and weights as format 3's (unchanged for format 3)."""
    if version == 3:
        return config, state
    readout = config.get("readout", FORMAT_2_DEFAULTS["readout"])
    if version == 1:
        state = rename(state, FORMAT_1_KEYS.get(readout, {}))
    return parts_of_flat(config), rename(state, format_3_keys(readout))

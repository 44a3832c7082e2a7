"""The transformers config of a saved model's text encoder (``config.json``'s ``text_encoder_config``),
checked as untrusted data before transformers sees it.

transformers reads more from a config than sizes: the attention implementation (a Hub kernel name
makes it fetch and load native code), the dtype, the activation by name, a task head's labels (a
million of them allocate a million-entry table). :func:`saved_text_config` therefore lets through
only what describes an encoder: the settings of the model type's own config, each of the type its
default has and within bounds; other keys only as small plain values; nothing private, no labels,
no attention implementation but PyTorch's own, and float32 weights.
"""

from __future__ import annotations

import json
import math
from typing import Any

from transformers import AutoConfig, PretrainedConfig
from transformers.activations import ACT2FN

from vlfuse.errors import first_line
from vlfuse.parts import MAX_HEADS, MAX_LAYERS, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH, check_range

WHERE = "text_encoder_config"

SIZES = {
    "num_hidden_layers": (0, MAX_LAYERS), "num_attention_heads": (1, MAX_HEADS), "hidden_size": (1, MAX_WIDTH),
    "intermediate_size": (1, 8 * MAX_WIDTH), "max_position_embeddings": (1, MAX_TOKENS), "vocab_size": (1, MAX_VOCAB),
}
"""The sizes that are checked to lie in a range (an int) before the config is built."""

MAX_INT = MAX_VOCAB
"""The largest magnitude of any other integer setting."""

MAX_PLAIN_JSON = 4096
"""The longest (as JSON) value of a key that the model type's config does not define."""

LEFT_OUT = frozenset({"transformers_version", "architectures", "_name_or_path", "id2label", "label2id", "num_labels", "problem_type"})
"""Keys that describe the file or a task head, not the encoder: not passed on."""

ONE_OF = {"attn_implementation": (None, "eager", "sdpa"), "dtype": (None, "float32"), "torch_dtype": (None, "float32")}
"""Keys whose value must be one of a few: PyTorch's own attention, float32 weights."""


def saved_text_config(data: object) -> PretrainedConfig:
    """The transformers config a model folder saved, every key checked first: a one-line
    ``ValueError`` names the bad key (``text_encoder_config.KEY``)."""
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"{WHERE} must be a transformers config with a model_type")
    model_type = data["model_type"]
    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
    except (ValueError, KeyError):
        raise ValueError(f"{WHERE}.model_type {model_type!r} is not a transformers model type") from None
    options = {}
    for key, value in data.items():
        if key in LEFT_OUT or key == "model_type":
            continue
        check_setting(f"{WHERE}.{key}", key, value, defaults)
        options[key] = value
    pad = options.get("pad_token_id")
    vocab = options.get("vocab_size", defaults.get("vocab_size"))
    if pad is not None and isinstance(vocab, int) and not 0 <= pad < vocab:
        raise ValueError(f"{WHERE}.pad_token_id must be a token id below vocab_size {vocab}, got {pad}")
    try:
        return AutoConfig.for_model(model_type, **options)
    except Exception as err:  # transformers' own checks raise several kinds; the folder is what is wrong
        raise ValueError(f"{WHERE}: {first_line(err)}") from None


def check_setting(where: str, key: str, value: Any, defaults: dict[str, Any]) -> None:
    """A ``ValueError`` naming ``where`` unless ``value`` may be the setting ``key`` (see the module)."""
    if key.startswith("_"):
        raise ValueError(f"{where}: a private setting of transformers, which a saved encoder does not set")
    if key in ONE_OF:
        if value not in ONE_OF[key]:
            raise ValueError(f"{where} must be one of {list(ONE_OF[key])}, got {value!r}")
        return
    if key in SIZES:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where} must be an int, got {value!r}")
        check_range(where, value, *SIZES[key])
        return
    if key == "hidden_act":
        if not isinstance(value, str) or value not in ACT2FN:
            raise ValueError(f"{where} must name one of transformers' activations ({', '.join(sorted(ACT2FN))}), got {value!r}")
        return
    if key in defaults:
        check_like_default(where, value, defaults[key])
    elif len(json.dumps(value)) > MAX_PLAIN_JSON:
        raise ValueError(f"{where} is not a setting of this encoder type and is larger than {MAX_PLAIN_JSON} bytes of JSON")
    check_number(where, value)


def check_like_default(where: str, value: Any, default: Any) -> None:
    """``value`` must have the JSON type of the setting's ``default`` (an int where a float is; null
    where a number is; any number or null where the default is null)."""
    if default is None:
        allowed: tuple[type, ...] = (type(None), int, float)
    elif isinstance(default, bool):
        allowed = (bool,)
    elif isinstance(default, (int, float)):  # or null: a token id a type has and a saved model may not
        allowed = (type(None), int, float) if isinstance(default, float) else (type(None), int)
    else:
        allowed = (type(default),)
    if not isinstance(value, allowed) or (isinstance(value, bool) and not isinstance(default, bool)):
        kinds = " or ".join("null" if kind is type(None) else kind.__name__ for kind in allowed)
        raise ValueError(f"{where} must be {kinds}, got {value!r}")


def check_number(where: str, value: Any) -> None:
    """A number must be finite and an int at most :data:`MAX_INT` in size."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_INT:
        raise ValueError(f"{where} must be at most {MAX_INT} in size, got {value!r}")

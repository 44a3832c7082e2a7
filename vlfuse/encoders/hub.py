"""Pretrained weights from the Hugging Face hub: fail fast when it cannot be reached.

Without a connection, huggingface_hub retries each download for about a minute before it gives
up. :func:`use_cache_if_hub_unreachable` tries one quick connection first and, when it fails,
switches the hub to offline mode (``HF_HUB_OFFLINE=1``): weights already in the cache still
load, and missing ones fail at once with :func:`weights_not_fetched`'s line.
:func:`load_named` does both for transformers' models and tokenizers.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable, TypeVar
from urllib.parse import urlparse

from vlfuse.encoders.installed import resolve_model_name
from vlfuse.errors import first_line

Loaded = TypeVar("Loaded")

CONNECT_TIMEOUT_S = 3.0
"""How long the quick connection to the hub may take before the hub counts as unreachable."""

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def hub_reachable(timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub's endpoint (``HF_ENDPOINT``) opens within ``timeout`` seconds."""
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def use_cache_if_hub_unreachable() -> None:
    """Switch huggingface_hub (and with it timm and transformers) to offline mode when the hub
    cannot be reached directly; nothing when offline mode is already on or a proxy is set (the
    direct connection says nothing then)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(name) for name in PROXY_VARIABLES):
        return
    if not hub_reachable():
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants.HF_HUB_OFFLINE = True  # read once at import: transformers and timm ask this constant


def weights_not_fetched(option: str, name: str, local: str) -> str:
    """The line for pretrained weights that are neither in the cache nor downloadable.

    Args:
        option: the option that asked for them, e.g. ``model.architecture.text.name``.
        name: the hub name.
        local: how to give the weights from a local file or folder instead.
    """
    return (
        f"{option}: could not fetch the pretrained weights of {name!r} from the Hugging Face hub (no connection, "
        f"not in the cache); give them locally: {local}, or download them once where the hub is reachable "
        "(HF_HUB_OFFLINE=1 then loads them from the cache without trying the network)"
    )


def is_hub_name(name: str) -> bool:
    """Whether ``name`` is a hub repository name (``bert-base-uncased``, ``org/model``) rather than a folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(name).is_dir():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


TEXT_LOCAL = "--model.architecture.text.name DIR (a folder saved with save_pretrained, or package:<module>/<folder>)"


def load_named(load: Callable[[str], Loaded], name: str, what: str) -> Loaded:
    """``load(path)`` for a transformers name: a local folder, a ``package:`` name or a hub name
    (tried after :func:`use_cache_if_hub_unreachable`).

    Args:
        load: e.g. ``AutoModel.from_pretrained``.
        name: see :attr:`vlfuse.encoders.TextEncoderConfig.name`.
        what: what is loaded, for the message: ``"the text encoder"``, ``"a tokenizer"``.

    Raises:
        ValueError: it cannot be loaded; the line says why, and how to give it locally when the
            hub cannot be reached.
    """
    from huggingface_hub import constants

    path = resolve_model_name(name)
    from_hub = is_hub_name(path)
    if from_hub:
        use_cache_if_hub_unreachable()
    try:
        return load(path)
    except (OSError, ValueError) as err:
        if from_hub and constants.HF_HUB_OFFLINE:
            raise ValueError(weights_not_fetched("model.architecture.text.name", name, TEXT_LOCAL)) from None
        raise ValueError(f"cannot load {what} from {name!r}: {first_line(err)}") from None

"""Model folders: writing them, reading them back, and reading the formats of earlier versions.

A folder holds ``config.json`` (format version, model type, architecture, and the size and SHA-256
of every other file), ``model.safetensors`` (the weights: nothing is unpickled), ``tokenizer/``,
for an answering model ``answers.json``, and its model card ``README.md`` (:mod:`vlfuse.model_card`):
documentation, not the model, so it has no digest and may be edited or rewritten
(``vlfuse card MODEL --write``) without making the folder fail its checks.
:class:`~vlfuse.model.VLFuseModel` and :class:`~vlfuse.captioning.CaptionModel` read and write
them through this module; it imports no model code.

Writing is atomic (:func:`write_model_folder`): the files go to a hidden folder beside the target,
which then takes the target's place in one rename, so that a process killed at any moment leaves
the old folder or the new one. Reading treats a folder as untrusted data: only regular files are
opened, JSON is size-limited, the files must match the digests in ``config.json``, the weights'
shapes are compared with the architecture (built on the meta device, so nothing is allocated)
before any tensor is read, and non-finite weights are refused. Every error is one line naming the
file.

Answering models (``model_type: vlfuse``):

- format 3 (now): the architecture as parts, ``fuser`` and ``head`` each with its ``type``; the
  fuser's weights under ``fuser.``, the head's under ``head.``;
- format 2: one flat architecture (``fusion_depth``, ``readout``, ...), the fusion blocks under
  ``fusion.``, the readout under ``readout.``;
- format 1: as 2, with the readout's weights at the top level.

:func:`upgrade_answering_model` turns a folder's config and weights of format 1 or 2 into format 3,
so that every saved model keeps loading and answering as it did. Folders written before the
digests (``files``) were recorded load without that check.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from vlfuse import atomic
from vlfuse.errors import first_line
from vlfuse.json_input import JSONInputError, parse_json

FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
MODEL_TYPE = "vlfuse"
WEIGHTS_FILE, CONFIG_FILE, ANSWERS_FILE, TOKENIZER_DIR = "model.safetensors", "config.json", "answers.json", "tokenizer"
CARD_FILE = "README.md"
"""The model card: written with the folder, never hashed (:func:`files_below` leaves it out).
"""
MODEL_TYPES = (MODEL_TYPE, "vlfuse-caption")
"""The ``model_type`` of every kind of folder vlfuse writes (a folder of another is never replaced)."""

MAX_JSON_BYTES = 64 << 20
"""The largest JSON file of a model folder that is read (64 MiB: a million answers fit)."""
MAX_CONFIG_BYTES = 4 << 20
"""The largest ``config.json`` that is read (one vlfuse writes holds about 12 KB)."""

STAGING = ".partial-"
"""Marks the hidden folder a save writes into, ``.<target>.partial-<pid>-<random>``, beside the target
(:func:`vlfuse.atomic.remove_abandoned` removes those of killed saves)."""

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
    atomic.give_default_permissions(directory / WEIGHTS_FILE)
    return directory


def write_json(path: Path, data: Any, indent: int = 2) -> None:
    """Write ``data`` as JSON with a final newline (never ``NaN``: it is not JSON)."""
    path.write_text(json_text(data, indent))


def json_text(data: Any, indent: int = 2) -> str:
    """``data`` as :func:`write_json` writes it."""
    return json.dumps(data, indent=indent, allow_nan=False) + "\n"


def write_model_folder(
    target: str | Path,
    meta: Mapping[str, Any],
    write_files: Callable[[Path], None],
    describe: Callable[[Path, dict], None] | None = None,
) -> Path:
    """Write a model folder at ``target`` atomically; return ``target``.

    ``write_files(folder)`` writes every file but ``config.json`` into a fresh hidden folder beside
    ``target``; ``config.json`` (``meta`` with the size and SHA-256 of each of those files) is
    written next, then ``describe(folder, config)`` writes what describes the folder from the
    config as written (the model card, which has no digest); everything is flushed to disk, and
    the folder takes ``target``'s place in one rename. A kill at any moment leaves the old folder or the new one, never a mix; a killed
    save's hidden folder is removed by the next save beside it.

    Raises:
        ValueError: ``target`` exists and is not an empty folder or a vlfuse model folder.
    """
    target = Path(target)
    check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_abandoned(target.parent, f".{target.name}{STAGING}")
    staging = make_staging(target)
    try:
        write_files(staging)
        config = {**meta, "files": file_digests(staging)}
        write_json(staging / CONFIG_FILE, config)
        if describe is not None:
            describe(staging, config)
        sync_tree(staging)
        move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def make_staging(target: Path) -> Path:
    """Create the hidden folder ``.<target>.partial-<pid>-<random>`` beside ``target``, with the
    permissions of any new folder (the umask's, as the folder it replaces had)."""
    while True:
        staging = staging_name(target)
        try:
            staging.mkdir()
            return staging
        except FileExistsError:
            continue


def staging_name(target: Path) -> Path:
    """A fresh hidden name beside ``target`` for this process to write it under: ``.<target>.partial-<pid>-<random>``."""
    return target.with_name(f".{target.name}{STAGING}{os.getpid()}-{secrets.token_hex(4)}")


def check_replaceable(target: Path) -> None:
    """Refuse to replace anything but an empty folder or a folder vlfuse wrote (it would be lost)."""
    if not os.path.lexists(target):
        return
    if target.is_dir() and (not any(target.iterdir()) or model_type_of(target) in MODEL_TYPES):
        return
    raise ValueError(f"{target} exists and is not a vlfuse model folder: not replaced (save to another folder, or remove it)")


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` of every file below ``folder`` (``config.json`` aside)."""
    return {name: {"size": (folder / name).stat().st_size, "sha256": sha256(folder / name)} for name in files_below(folder)}


def files_below(folder: Path) -> list[str]:
    """The relative paths of every file below ``folder`` but ``config.json`` and the card, sorted."""
    names = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sorted(name for name in names if name not in (CONFIG_FILE, CARD_FILE))


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a hidden file beside it, flushed, renamed onto it (a kill
    leaves the old file or the new one). For the files of a folder that are not hashed
    (``config.json``, the card); a folder's other files are written with the folder."""
    atomic.remove_abandoned(path.parent, f".{path.name}{STAGING}")
    atomic.replace_file(path, staging_name(path), lambda file: file.write(text.encode("utf-8")))


def sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def sync_tree(folder: Path) -> None:
    """Flush every file and folder below ``folder`` (itself included) to disk."""
    for path in [*folder.rglob("*"), folder]:
        atomic.fsync(path)


def move_into_place(staging: Path, target: Path) -> None:
    """Put the folder ``staging`` at ``target``, replacing what is there in one step where the system can.

    Linux swaps the two folders atomically (``renameat2`` with ``RENAME_EXCHANGE``); elsewhere the
    old folder is first renamed aside (``.<target>.old-<pid>``), so that a kill between the two
    renames leaves it there, whole.
    """
    if not os.path.lexists(target):
        os.rename(staging, target)
    elif exchange(staging, target):
        shutil.rmtree(staging)  # the old folder, now
    else:
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
        os.rename(staging, target)
        shutil.rmtree(old)
    atomic.fsync(target.parent)


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``);
    ``False`` where the system or the filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd, rename_exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


# ------------------------------------------------------------------------------- reading
def require_files(directory: Path, names: Sequence[str], what: str) -> None:
    """Raise ``FileNotFoundError`` naming ``directory`` when it is missing or lacks one of ``names``,
    and a ``ValueError`` when one of them is not a regular file (or, for ``tokenizer``, a folder of them)."""
    if directory.is_file() and directory.suffix == ".ckpt":
        raise ValueError(
            f"{directory} is a Lightning checkpoint, not a model folder: give the run's model/ folder, which vlfuse fit "
            "exports at its end (runs/NAME/latest/model), or evaluate the checkpoint with vlfuse test --ckpt_path"
        )
    if not directory.is_dir():
        raise FileNotFoundError(f"model folder not found: {directory}")
    missing = [n for n in names if not (directory / n).exists()]
    if missing:
        raise FileNotFoundError(f"{directory} is not {what}: missing {', '.join(missing)}")
    root = containing_folder(directory).resolve()
    for name in names:
        path = directory / name
        if name == TOKENIZER_DIR:
            if not path.is_dir():
                raise ValueError(f"{path} is not a folder")
            inside = [inner for inner in path.rglob("*") if not inner.is_dir()]
        else:
            inside = [path]
        for file in inside:
            if not file.resolve().is_relative_to(root):
                raise ValueError(f"{file} is a link to {file.resolve()}, outside {directory}: a model folder's files must lie in it")
            require_regular(file)


def require_regular(path: Path) -> None:
    """A ``ValueError`` when ``path`` is not a regular file (a FIFO, a device: reading it could hang)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path} is not a regular file")


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON in ``path``; a one-line ``ValueError`` naming the file when it is larger than
    ``max_bytes`` or not strict JSON (:func:`vlfuse.json_input.parse_json`)."""
    require_regular(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{path} is {size / 2**20:.1f} MiB, more than the {max_bytes >> 20} MiB this file of a model folder may be")
    try:
        return parse_json(path.read_bytes())
    except JSONInputError as err:
        raise ValueError(f"{path}: {err}") from None


def read_meta(directory: Path, model_type: str, formats: Sequence[int]) -> dict:
    """``config.json`` of ``directory``, checked to describe a ``model_type`` model of one of ``formats``."""
    meta = read_json(directory / CONFIG_FILE, MAX_CONFIG_BYTES)
    version = meta.get("format_version") if isinstance(meta, dict) else None
    known = version in formats and not isinstance(version, bool)  # true == 1 in Python, not in the format
    if not isinstance(meta, dict) or meta.get("model_type") != model_type or not known:
        found = (meta.get("model_type"), version) if isinstance(meta, dict) else (None, None)
        raise ValueError(
            f"{directory / CONFIG_FILE} is not a {model_type} model of format {' or '.join(map(str, formats))} "
            f"(model_type {found[0]!r}, format {found[1]!r}): written by another vlfuse version, or not by vlfuse"
        )
    return meta


def model_type_of(directory: str | Path) -> str | None:
    """The ``model_type`` in ``directory``'s ``config.json``; ``None`` when it has none or cannot be read."""
    try:
        meta = read_json(Path(directory) / CONFIG_FILE, MAX_CONFIG_BYTES)
    except (OSError, ValueError):
        return None
    return meta.get("model_type") if isinstance(meta, dict) else None


def verify_files(directory: Path, meta: dict) -> None:
    """Check every file ``config.json`` lists (``files``) against its size and SHA-256, and that the
    tokenizer folder holds no file it does not list; a ``ValueError`` names the first that differs.

    A folder written before digests were recorded (no ``files``) passes.
    """
    listed = meta.get("files")
    if listed is None:
        return
    config = directory / CONFIG_FILE
    if not isinstance(listed, dict) or not all(isinstance(entry, dict) for entry in listed.values()):
        raise ValueError(f"{config}: 'files' must map each file to its size and sha256")
    root = containing_folder(directory).resolve()
    for name, entry in listed.items():
        path = directory / name
        if not path.resolve().is_relative_to(root) or not path.is_file():
            raise ValueError(f"{config} lists {name}, which is not a file in {directory}")
        require_regular(path)
        if path.stat().st_size != entry.get("size") or sha256(path) != entry.get("sha256"):
            raise ValueError(
                f"{path} does not match {config}: it is not the file that was saved with the model "
                "(an interrupted copy, or changed since); save or copy the model again"
            )
    extra = [name for name in files_below(directory) if name.startswith(f"{TOKENIZER_DIR}/") and name not in listed]
    if extra:
        raise ValueError(f"{directory / extra[0]} was not saved with the model ({config} does not list it): remove it")


def containing_folder(directory: Path) -> Path:
    """The folder the files of ``directory`` must lie in: itself, or for a snapshot in the Hugging Face
    Hub's cache (``models--OWNER--NAME/snapshots/COMMIT``, whose files link to the repository's
    ``blobs/``) the repository's cache folder."""
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent
    return directory


def read_header(directory: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of ``directory``'s weights, from the safetensors header (no tensor is read)."""
    path = directory / WEIGHTS_FILE
    require_regular(path)
    try:
        with safe_open(str(path), framework="pt") as weights:
            return {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a safetensors weights file: {first_line(err)}") from None


def read_weights(directory: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of ``directory``'s ``model.safetensors``; a ``ValueError`` for a damaged file or
    a tensor with NaN or infinite values."""
    path = directory / WEIGHTS_FILE
    try:
        state = load_file(path, device=str(device))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a safetensors weights file: {first_line(err)}") from None
    for key, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{path}: {key} holds NaN or infinite values: the weights are damaged (a diverged run?)")
    return state


def check_shapes(
    expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], directory: Path, described_by: str
) -> None:
    """A one-line ``ValueError`` when the weights file's tensors (``found``) are not those of the model
    ``described_by`` describes (``expected``): a key of another shape, missing or extra."""
    wrong = [key for key in found if key in expected and tuple(found[key]) != tuple(expected[key])]
    if wrong:
        key = wrong[0]
        raise ValueError(
            f"{directory / WEIGHTS_FILE} does not match {described_by}: {key} is {tuple(found[key])} "
            f"in the file, {tuple(expected[key])} in the model they describe"
        )
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{directory / WEIGHTS_FILE} does not match {described_by}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


Module = TypeVar("Module", bound=nn.Module)


def build_checked(build: Callable[[], Module], header: Mapping[str, tuple[int, ...]], directory: Path, described_by: str) -> Module:
    """``build()``, once its weights' shapes on the meta device (nothing allocated) match ``header``
    and what it holds besides its weights is no larger than :func:`derived_bytes_allowed`."""
    try:
        with torch.device("meta"):
            skeleton = build()
    except (ValueError, TypeError) as err:  # e.g. a timm name that is no vision transformer
        raise ValueError(f"{described_by}: {first_line(err)}") from None
    weights = skeleton.state_dict()
    check_shapes({key: tuple(value.shape) for key, value in weights.items()}, header, directory, described_by)
    derived = sum(buffer.numel() * buffer.element_size() for name, buffer in skeleton.named_buffers() if name not in weights)
    allowed = derived_bytes_allowed(directory)
    if derived > allowed:
        raise ValueError(
            f"{described_by}: the model would hold {derived / 2**20:,.0f} MiB of tensors that are not in {WEIGHTS_FILE} "
            f"(computed buffers, e.g. position tables of the grid), more than the {allowed / 2**20:,.0f} MiB allowed beside its weights"
        )
    return build()


MIN_DERIVED_BYTES = 256 << 20
"""The computed buffers (tensors a model builds itself, outside its weights file) any model folder may ask for."""


def derived_bytes_allowed(directory: Path) -> int:
    """How many bytes of computed buffers a folder may make its model allocate: as many as its weights
    file holds, and at least :data:`MIN_DERIVED_BYTES`, so that a small folder cannot ask for gigabytes."""
    return max(MIN_DERIVED_BYTES, (directory / WEIGHTS_FILE).stat().st_size)


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], directory: Path, described_by: str) -> None:
    """Load ``state`` (read from ``directory``'s weights file) into ``model``, built from ``described_by``
    (the files that describe it); a key of another shape or kind (an integer tensor for floating-point
    weights), missing or extra is a one-line ``ValueError``."""
    expected = model.state_dict()
    check_shapes({key: tuple(value.shape) for key, value in expected.items()},
                 {key: tuple(value.shape) for key, value in state.items()}, directory, described_by)
    for key, tensor in state.items():
        want = expected[key].dtype
        if tensor.dtype != want and not (tensor.is_floating_point() and want.is_floating_point):
            raise ValueError(f"{directory / WEIGHTS_FILE}: {key} is stored as {tensor.dtype}, where {described_by} needs {want}")
    model.load_state_dict(state)


def parse_config(path: Path, parse: Callable[[], Any]) -> Any:
    """``parse()`` of what ``path`` holds; its error (a bad value, a key missing or of the wrong type)
    as a one-line ``ValueError`` naming ``path``."""
    try:
        return parse()
    except KeyError as err:
        raise ValueError(f"{path}: missing {err.args[0]!r}") from None
    except (ValueError, TypeError, AttributeError) as err:
        message = first_line(err)
        raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from None


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


def with_recorded_interpolation(architecture: Any) -> Any:
    """A saved architecture (a dict with ``image``) whose image encoder names how images are resized:
    folders written before ``image.interpolation`` existed resized bilinearly, whatever their weights
    (anything else is returned as it is, for the config's own checks)."""
    image = architecture.get("image") if isinstance(architecture, dict) else None
    if not isinstance(image, dict) or "interpolation" in image:
        return architecture
    return {**architecture, "image": {**image, "interpolation": "bilinear"}}


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

"""Saving, loading and sharing model folders through huggingface_hub's :class:`~huggingface_hub.ModelHubMixin`.

:class:`HubMixin` gives :class:`~vlfuse.model.VLFuseModel` and
:class:`~vlfuse.captioning.CaptionModel` the mixin's ``save_pretrained`` / ``from_pretrained`` /
``push_to_hub`` over vlfuse's own folder format (:mod:`vlfuse.model_io`): each model implements the
mixin's hooks, ``_save_pretrained`` (the folder, written atomically, with its model card) and
``_load_folder`` (the checks of an untrusted folder), and ``from_pretrained`` takes a local folder or
a Hub repository id, whose snapshot the Hub's own machinery fetches (or finds in its cache, offline)
before the same checks read it.

Two of the mixin's methods are replaced, for what a vlfuse folder promises. The mixin's
``save_pretrained`` deletes the target's ``config.json`` before it writes (a kill then leaves a
folder that loads as nothing, and a folder of someone else's loses its file); vlfuse's writes a
hidden folder and swaps it in whole, refusing to replace a folder it did not write. The mixin's
``from_pretrained`` reads ``config.json`` with no size limit and passes its keys to the model's
constructor; vlfuse's reads nothing before its checks. ``push_to_hub`` is the mixin's: it saves the
model with ``save_pretrained`` into a temporary folder and uploads that folder in one commit.
"""

from __future__ import annotations

import os
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, Callable

from huggingface_hub import ModelHubMixin, snapshot_download
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from torch import nn

from vlfuse import model_card, model_io
from vlfuse.errors import first_line

FOLDER_FILES = [model_io.CONFIG_FILE, model_io.WEIGHTS_FILE, model_io.ANSWERS_FILE, f"{model_io.TOKENIZER_DIR}/*", model_io.CARD_FILE]
"""What is fetched of a repository: the files of a model folder (a repository may hold others)."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub repository id, ``OWNER/NAME`` (a bare name is a local folder)."""
    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_folder(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> Path:
    """The local folder of ``name_or_path``: a path that exists (or that is no repository id) as it is,
    else the snapshot of the Hub repository ``OWNER/NAME`` at ``revision`` (fetched with
    :func:`huggingface_hub.snapshot_download`; with ``HF_HUB_OFFLINE=1`` or ``local_files_only``,
    the one in the Hub's cache).

    Raises:
        FileNotFoundError: no such folder here, and the Hub gave no snapshot (one line, with the Hub's reason).
    """
    name = os.fspath(name_or_path)
    if os.path.lexists(name) or not is_repo_id(name):
        return Path(name)
    try:
        return Path(snapshot_download(
            name, revision=revision, cache_dir=cache_dir, force_download=force_download,
            local_files_only=local_files_only, token=token, allow_patterns=FOLDER_FILES,
        ))
    except (OSError, ValueError) as err:  # the Hub's errors: not found, offline and not cached, ...
        raise FileNotFoundError(
            f"model folder not found: {name}, and the Hub gave no snapshot of a repository {name}: {first_line(err)}"
        ) from None


class HubMixin(ModelHubMixin, library_name="vlfuse", tags=list(model_card.TAGS)):
    """huggingface_hub's :class:`~huggingface_hub.ModelHubMixin` over vlfuse's model folders (see the module).

    A model class implements ``_save_pretrained(save_directory, *, run=None, card_text=None)`` (with
    :func:`write_folder`) and the class method ``_load_folder(directory, map_location)``.
    """

    def save_pretrained(
        self,
        save_directory: str | Path,
        *,
        run: model_card.RunRecord | None = None,
        config: Any = None,
        repo_id: str | None = None,
        push_to_hub: bool = False,
        model_card_kwargs: dict[str, str] | None = None,
        **push_to_hub_kwargs,
    ) -> Path | str:
        """Write the model folder (weights, config, tokenizer, answers and model card) to
        ``save_directory`` atomically: a kill leaves the old folder or the new one, and a folder that
        vlfuse did not write is not replaced (``ValueError``). Returns the folder, or with
        ``push_to_hub`` the URL of the commit that uploaded it (to ``repo_id``, default the folder's name).

        Args:
            run: what the run that made these weights measured (:class:`~vlfuse.model_card.RunRecord`),
                for the card; default: the record the model was loaded with, if any (the card shows
                its metrics only while the weights are the ones they were measured on).
            config: the mixin's; a vlfuse model's config is its own (``model.config``): must be ``None``.
            model_card_kwargs: texts of the card: ``intended_use``, ``limitations``.
        """
        if config is not None:
            raise TypeError("save_pretrained: a vlfuse model saves its own config (model.config); config must be None")
        target = Path(save_directory)
        self._save_pretrained(target, run=run, card_text=model_card_kwargs)
        if push_to_hub:
            return self.push_to_hub(repo_id or target.name, model_card_kwargs=model_card_kwargs, **push_to_hub_kwargs)
        return target

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        map_location: str | Any = "cpu",
        *,
        revision: str | None = None,
        cache_dir: str | Path | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
        token: str | bool | None = None,
    ):
        """Load a model folder, or a Hub repository's (``OWNER/NAME``, fetched by
        :func:`resolve_folder`: ``revision``, ``cache_dir``, ``force_download``, ``local_files_only``
        and ``token`` are the Hub's), onto ``map_location``, in eval mode.

        The folder is data: nothing is unpickled and no code in it runs, its files are checked
        against their digests and the weights against the architecture before anything is
        allocated; every error is one line naming the file.
        """
        return cls._from_pretrained(
            model_id=os.fspath(pretrained_model_name_or_path), revision=revision, cache_dir=cache_dir,
            force_download=force_download, local_files_only=local_files_only, token=token, map_location=map_location,
        )

    @classmethod
    def _from_pretrained(
        cls,
        *,
        model_id: str,
        revision: str | None,
        cache_dir: str | Path | None,
        force_download: bool,
        local_files_only: bool,
        token: str | bool | None,
        map_location: str | Any = "cpu",
    ):
        """The mixin's hook: the folder of ``model_id`` (:func:`resolve_folder`), checked and loaded."""
        directory = resolve_folder(
            model_id, revision=revision, cache_dir=cache_dir, force_download=force_download,
            local_files_only=local_files_only, token=token,
        )
        return cls._load_folder(directory, map_location)

    def generate_model_card(self, **model_card_kwargs) -> model_card.ModelCard:
        """The card :meth:`save_pretrained` would write now (the model is saved to a temporary folder)."""
        with TemporaryDirectory() as scratch:
            folder = self.save_pretrained(Path(scratch) / "model", model_card_kwargs=model_card_kwargs)
            return model_card.ModelCard((folder / model_io.CARD_FILE).read_text(encoding="utf-8"))


def write_folder(
    model: nn.Module,
    target: Path,
    meta: dict[str, Any],
    write_files: Callable[[Path], None],
    *,
    run: model_card.RunRecord | None,
    card_text: dict[str, str] | None,
) -> Path:
    """:func:`vlfuse.model_io.write_model_folder` of ``model`` with its card: ``meta`` gains the card's
    facts (:func:`vlfuse.model_card.card_facts`: parameters, software, ``run`` or the record the model
    was loaded with) and the folder its ``README.md``, written from the config once the weights'
    digest is known (a fresh ``run`` describes these weights)."""
    carried = getattr(model, "run_record", None)
    facts = model_card.card_facts(model, run if run is not None else carried, card_text)
    fresh = run is not None

    def describe(folder: Path, config: dict) -> None:
        if fresh:
            config[model_card.CARD_KEY]["run"]["weights_sha256"] = config["files"][model_io.WEIGHTS_FILE]["sha256"]
            model_io.write_json(folder / model_io.CONFIG_FILE, config)
        model_card.write_card(folder, config)

    return model_io.write_model_folder(target, {**meta, model_card.CARD_KEY: facts}, write_files, describe)

"""Shared fixtures: a tiny architecture that trains in seconds on CPU, toy batches, scored models."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from vlfuse.data import IGNORE_INDEX, GroupedVQADataset, ImageQuestions, collate_grouped
from vlfuse.data.answers import AnswerVocab
from vlfuse.encoders import ImageEncoderConfig, TextEncoderConfig
from vlfuse.model import VLFuseConfig, VLFuseModel

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# ------------------------------------------------ parallel runs (pytest-xdist: -n auto, see pyproject.toml)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker, here and in the commands the tests start: the workers already keep
    # every core busy, and two OpenMP teams on one core spin-wait for each other.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

DOCUMENTED_EXAMPLE = re.compile(r"\[(README\.md|docs/[^\]:]+\.md):\d+\]$")
"""The id of a test of tests/test_docs.py that runs a document's example, e.g. ``[docs/api.md:186]``."""


def worker_scope(nodeid: str) -> str:
    """What runs on one worker, in order: a document's examples (they build on one another in one
    workspace), or else a test module (its module fixtures then run once)."""
    example = DOCUMENTED_EXAMPLE.search(nodeid)
    return example.group(1) if example else nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's load-by-scope scheduling (``--dist loadscope``, the default of pyproject.toml),
    with :func:`worker_scope` as the scope; any other ``--dist`` keeps xdist's own scheduler."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleOrDocumentScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return ModuleOrDocumentScheduling(config, log)


def load_script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` as module ``name`` (registered in ``sys.modules``: dataclasses look it up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


TINY_FUSER = dict(type="fusion_stack", depth=2, heads=16, mlp="gelu", output_gate=False, self_attention=True, gated=True)
"""The fuser of :func:`tiny_config`: every part of a fusion block switched on (self-attention, gates)."""


def tiny_config(*, fuser: dict | None = None, head: dict | None = None, **fields) -> VLFuseConfig:
    """A model small enough to train in seconds: widths 32, one layer each, 2 fusion blocks of 16 heads
    (:data:`TINY_FUSER`) and the pooled head. ``fuser`` and ``head`` options are added to these (a
    ``fuser`` of another ``type`` replaces them); ``fields`` are :class:`VLFuseConfig`'s."""
    fuser = dict(fuser or {})
    if fuser.get("type", "fusion_stack") == "fusion_stack":
        fuser = {**TINY_FUSER, **fuser}
    settings = dict(
        image=ImageEncoderConfig(image_size=32, patch_size=8, width=32, depth=1, num_heads=2),
        text=TextEncoderConfig(width=32, depth=1, num_heads=2, max_length=16),
        fusion_dim=32,
        fuser=fuser,
        head={"type": "pooled", **(head or {})},
    )
    settings.update(fields)
    return VLFuseConfig(**settings)


def reader_config(fuser: str = "map_program", **fuser_options) -> VLFuseConfig:
    """:func:`tiny_config` with a fuser that reads word embeddings (``map_program`` or ``cell_steps``)
    and the existence head: text depth 0."""
    return tiny_config(
        text=TextEncoderConfig(width=32, depth=0, num_heads=2, max_length=16),
        fuser={"type": fuser, **fuser_options},
        head={"type": "existence"},
    )


def tiny_overrides(limit_images: int = 8, *, map_program: bool = False) -> list[str]:
    """Command-line overrides that shrink any config to a tiny model on a few images, quietly.

    ``map_program``: the config's fuser reads word embeddings (``map_program``): text depth 0 and
    the fuser left as the config has it; otherwise one fusion block.
    """
    depth = 0 if map_program else 1
    fuser = [] if map_program else ["--model.architecture.fuser.depth=1"]
    return [
        "--model.architecture.image.image_size=32",
        "--model.architecture.image.patch_size=8",
        "--model.architecture.image.width=32",
        "--model.architecture.image.depth=1",
        "--model.architecture.image.num_heads=2",
        "--model.architecture.text.width=32",
        f"--model.architecture.text.depth={depth}",
        "--model.architecture.text.num_heads=2",
        "--model.architecture.fusion_dim=32",
        *fuser,
        f"--data.init_args.limit_images={limit_images}",
        "--data.init_args.batch_size=4",
        "--data.init_args.num_workers=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]


def tiny_caption_overrides() -> list[str]:
    """Command-line overrides that shrink a caption config (configs/shapes_captions.yaml) to a tiny
    decoder on a few scenes, one epoch, quietly."""
    return [
        "--model.init_args.caption_model.image.width=16",
        "--model.init_args.caption_model.dim=16",
        "--model.init_args.caption_model.depth=1",
        "--data.init_args.num_train_scenes=32",
        "--data.init_args.num_val_scenes=8",
        "--data.init_args.num_test_scenes=8",
        "--data.init_args.batch_size=16",
        "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]


def tiny_cli_args(root: Path, limit_images: int = 8, *, map_program: bool = False, caption: bool = False) -> list[str]:
    """:func:`tiny_overrides` (:func:`tiny_caption_overrides` for a ``caption`` config), writing
    everything under ``root`` and logging nothing."""
    return [
        *(tiny_caption_overrides() if caption else tiny_overrides(limit_images, map_program=map_program)),
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=false",
        f"--checkpoint.dirpath={root / 'checkpoints'}",
        f"--export.dirpath={root / 'model'}",
    ]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices on a loaded 2-core machine: OpenMP waits for the busy core cost 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny() -> VLFuseConfig:
    return tiny_config()


def logits(model: VLFuseModel, batch: dict, **kwargs) -> torch.Tensor:
    """The model's logits on a :func:`~vlfuse.data.collate_grouped` batch; ``kwargs`` go to ``forward``."""
    inputs = model.processor.batch(batch, dtype=next(model.parameters()).dtype)
    return model(**inputs, **kwargs).logits


def parameters_without_gradient(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s parameters that got no gradient, or an all-zero one, from the last backward."""
    return [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]


# -------------------------------------------------- red or blue images, two questions each
COLOUR_ANSWERS = ["no", "yes", "red", "blue"]


def toy_batch(n_images: int = 4, size: int = 32, seed: int = 0) -> tuple[list[ImageQuestions], dict]:
    """Images that are red or blue, each with two questions: the records and their batch."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n_images):
        colour = "red" if i % 2 == 0 else "blue"
        pixels = (torch.rand(size, size, 3, generator=g) * 60).to(torch.uint8)
        pixels[..., 0 if colour == "red" else 2] += 150
        records.append(
            ImageQuestions(
                pixels.numpy(),
                ["what color is the shape?", f"is there a {colour} shape?"],
                [colour, "yes"],
                image_id=str(i),
            )
        )
    dataset = GroupedVQADataset(records, AnswerVocab(COLOUR_ANSWERS), size)
    return records, collate_grouped([dataset[i] for i in range(len(dataset))])


def make_model(**overrides) -> tuple[VLFuseModel, dict]:
    """A tiny model (``tiny_config(**overrides)``: ``fuser=``, ``head=`` and config fields) over
    :data:`COLOUR_ANSWERS` and a :func:`toy_batch`."""
    torch.manual_seed(0)
    records, batch = toy_batch()
    questions = [q for r in records for q in r.questions]
    return VLFuseModel.from_config(tiny_config(**overrides), COLOUR_ANSWERS, questions), batch


# ---------------------------------------- an untrained model whose heads are scored and pruned
SCORED_ANSWERS = ["no", "yes", "red", "blue", "green", "circle"]
SCORED_QUESTIONS = ["what color is the shape?", "is there a red shape?", "is there a blue shape?", "what shape is it?"]
HEADS = {0: [1, 5, 9], 1: [0, 2, 3, 15]}
"""Heads that tests prune: ``{layer: original ids}``."""


def make_batches(seed: int = 1) -> list[dict]:
    """Two batches of 3 random images with 1-4 questions each; one label is IGNORE_INDEX."""
    g = torch.Generator().manual_seed(seed)
    items = [
        {
            "pixel_values": torch.rand(3, 32, 32, generator=g),
            "questions": SCORED_QUESTIONS[: 1 + i % 4],
            "labels": torch.randint(0, len(SCORED_ANSWERS), (1 + i % 4,), generator=g),
        }
        for i in range(6)
    ]
    items[2]["labels"][0] = IGNORE_INDEX
    return [collate_grouped(items[:3]), collate_grouped(items[3:])]


@pytest.fixture(scope="module")
def model() -> VLFuseModel:
    """Tiny, untrained and ungated (so that every cross-attention head changes the answer scores), in eval mode."""
    torch.manual_seed(0)
    return VLFuseModel.from_config(tiny_config(fuser={"gated": False}), SCORED_ANSWERS, SCORED_QUESTIONS).eval()


@pytest.fixture(scope="module")
def batches(model) -> list[dict]:
    """:func:`make_batches` labelled with ``model``'s own answers: accuracy 1 with every head, lower without some."""
    batches = make_batches()
    with torch.no_grad():
        for batch in batches:
            valid = batch["labels"] != IGNORE_INDEX
            batch["labels"][valid] = logits(model, batch).argmax(-1)[valid]
    return batches

"""Model cards: the ``README.md`` of a model folder, written from what its ``config.json`` records.

``config.json`` keeps, under ``card``, the facts a card is written from: the parameter counts, the
versions (and git commit) of the software that saved the folder, and the :class:`RunRecord` of the
run that made the weights (its data and split, metrics with the command that measured them, config
and seed). ``vlfuse fit`` (its export, then its test with ``test_after_fit``) and ``vlfuse prune``
record their run; ``vlfuse card MODEL`` prints the card the folder's facts give and ``--write``
rewrites ``README.md`` from them.

The card has no digest in ``config.json`` (:data:`vlfuse.model_io.CARD_FILE`): it documents the
model, so editing or rewriting it leaves the folder loadable. A run's metrics are bound to the
weights they were measured on (``weights_sha256``): a model loaded, changed and saved again keeps
its record, and its card says the metrics describe other weights (the metadata then claims none).

The metadata block is huggingface_hub's :class:`~huggingface_hub.ModelCardData`, with an
:class:`~huggingface_hub.EvalResult` per metric, so that the Hub shows the library, task, data and
results. This module imports no model code.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from torch import nn

import vlfuse
from vlfuse import model_io
from vlfuse.errors import first_line

CARD_KEY = "card"
"""The key of ``config.json`` that holds the card's facts."""

TAGS = ("vlfuse", "vision-language", "cross-attention")
"""Tags of every vlfuse model (the Hub mixin adds ``model_hub_mixin``)."""

KINDS = {
    model_io.MODEL_TYPE: ("visual-question-answering", "visual question answering model", ()),
    "vlfuse-caption": ("image-to-text", "image captioning model", ("image-captioning",)),
}
"""``model_type`` -> (the Hub's pipeline tag, what the model is, its tags besides :data:`TAGS`)."""


def hub_metadata(model_type: str) -> dict[str, Any]:
    """The Hub mixin's class options of a model of ``model_type`` (``class M(nn.Module, HubMixin, **hub_metadata(...))``):
    the pipeline tag and tags its cards carry."""
    pipeline, _, tags = KINDS[model_type]
    return {"pipeline_tag": pipeline, "tags": [pipeline, *tags]}

METRICS = {
    "acc": ("accuracy", "accuracy"),
    "soft_acc": ("accuracy", "VQA soft accuracy"),
    "loss": ("loss", "cross-entropy loss"),
    "bleu4": ("bleu", "BLEU-4"),
    "cider": ("cider", "CIDEr-D"),
    "fact_precision": ("precision", "fact precision"),
    "object_recall": ("recall", "object recall"),
}
"""A logged metric's name -> (its Hub metric type, how the card names it); others keep their name."""

COUNTS = ("questions", "images")
"""Logged totals that say how much a split's metrics were measured on (``val/questions``, ``test/images``)."""

SOFTWARE = ("torch", "transformers", "timm", "lightning", "huggingface_hub", "safetensors")

DEFAULT_TEXT = {
    "intended_use": (
        "Research, teaching and baselines: {task} on images like those of its training data ({data}), "
        "{inputs}."
    ),
    "limitations": (
        "{output} Its metrics hold for the data they were measured on: images from another source "
        "(photographs, other sizes and styles), other wordings and other answers were not measured. "
        "No study of bias, fairness or safety was made: do not use it to make decisions about people."
    ),
}
"""The card's default texts (``save_pretrained(model_card_kwargs=...)`` replaces them), filled per kind."""


# ------------------------------------------------------------------------------ what a run records
@dataclass
class Metric:
    """One metric of a run, with what measured it.

    Attributes:
        split: the split it was measured on (``val``, ``test``, ...).
        name: the logged name (``acc``, ``cider``, ...; see :data:`METRICS`).
        value: the value.
        command: the command line that measured it.
        count: how many questions (or images) it was measured on.
        unit: what ``count`` counts.
        note: e.g. ``best checkpoint epoch=3-step=400.ckpt``.
    """

    split: str
    name: str
    value: float
    command: str | None = None
    count: int | None = None
    unit: str | None = None
    note: str | None = None


@dataclass
class RunRecord:
    """What the run that made a model's weights tells of it, for the model card.

    Attributes:
        command: the command line of the run.
        seed: the run's seed.
        data: the training data and split (:func:`describe_data`).
        metrics: what the run measured (:class:`Metric`).
        config: the run's config, as given.
        derived_from: the model the run started from (e.g. the folder ``vlfuse prune`` pruned).
        notes: more facts of the run, one sentence each.
        software: versions and git commit of the run's software (:func:`software`).
        weights_sha256: the SHA-256 of the weights file the metrics were measured on (set by the save).
    """

    command: str | None = None
    seed: int | None = None
    data: dict[str, Any] | None = None
    metrics: list[Metric] = field(default_factory=list)
    config: dict[str, Any] | None = None
    derived_from: str | None = None
    notes: list[str] = field(default_factory=list)
    software: dict[str, Any] = field(default_factory=lambda: software())
    weights_sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "RunRecord":
        """The record of a ``config.json``; a ``ValueError`` for one that is not a record's data."""
        if not isinstance(data, dict):
            raise ValueError("card.run must be a mapping")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"card.run has unknown keys {unknown}")
        metrics = data.get("metrics", [])
        if not isinstance(metrics, list) or not all(isinstance(m, dict) for m in metrics):
            raise ValueError("card.run.metrics must be a list of mappings")
        try:
            record = cls(**{"software": {}, **data, "metrics": [Metric(**m) for m in metrics]})
        except TypeError as err:
            raise ValueError(f"card.run: {err}") from None
        for name, kinds in (("command", str), ("seed", int), ("data", dict), ("config", dict), ("derived_from", str),
                            ("notes", list), ("software", dict), ("weights_sha256", str)):
            value = getattr(record, name)
            if value is not None and not isinstance(value, kinds):
                raise ValueError(f"card.run.{name} must be of type {kinds.__name__}, got {type(value).__name__}")
        if not all(isinstance(m.value, (int, float)) and isinstance(m.split, str) and isinstance(m.name, str) for m in record.metrics):
            raise ValueError("card.run.metrics: each needs a split, a name and a number")
        return record


def read_run(meta: Mapping[str, Any]) -> RunRecord | None:
    """The :class:`RunRecord` of a folder's ``config.json`` data, ``None`` when it records none."""
    card = meta.get(CARD_KEY)
    if card is None:
        return None
    if not isinstance(card, dict):
        raise ValueError("card must be a mapping")
    run = card.get("run")
    return None if run is None else RunRecord.from_dict(run)


def metrics_of(results: Mapping[str, Any], split: str, command: str | None, note: str | None = None) -> list[Metric]:
    """The logged ``{split}/{name}`` values of ``results`` (e.g. a Lightning test's) as metrics, each
    with the count of questions or images they were measured on (``{split}/questions``)."""
    prefix = f"{split}/"
    counts = {unit: int(float(results[prefix + unit])) for unit in COUNTS if prefix + unit in results}
    unit, count = next(iter(counts.items()), (None, None))
    return [
        Metric(split, key[len(prefix):], float(f"{float(value):.7g}"), command, count, unit, note)  # float32: 7 digits
        for key, value in sorted(results.items())
        if key.startswith(prefix) and key[len(prefix):] not in COUNTS
    ]


def fit_record(trainer: Any, base: RunRecord | None = None) -> RunRecord:
    """The record of a Lightning fit that ends, for its model's card: ``base`` (what ``vlfuse fit``
    knows: command, config, seed) with the data it read (train and val splits) and its validation
    metric: the monitored one of the best checkpoint, whose weights are exported, else the last
    epoch's ``val/*`` values."""
    run = dataclasses.replace(base) if base is not None else RunRecord(seed=_global_seed())
    datamodule = trainer.datamodule
    if hasattr(datamodule, "records"):
        options = ((run.config or {}).get("data") or {}).get("init_args")
        run.data = describe_data(datamodule, ["train", "val"], options if isinstance(options, dict) else None)
    logged = {key: value for key, value in trainer.callback_metrics.items()}
    checkpoint = trainer.checkpoint_callback
    best = getattr(checkpoint, "best_model_path", "")
    score = getattr(checkpoint, "best_model_score", None)
    monitor = getattr(checkpoint, "monitor", None) or ""
    if best and score is not None and "/" in monitor:
        split = monitor.split("/", 1)[0]
        counted = metrics_of({**{k: v for k, v in logged.items() if k.startswith(f"{split}/")}, monitor: score}, split, run.command)
        run.metrics = [dataclasses.replace(m, note=f"best checkpoint {Path(best).name}") for m in counted if f"{split}/{m.name}" == monitor]
    else:
        run.metrics = metrics_of(logged, "val", run.command, "final weights: the last epoch")
    return run


def _global_seed() -> int | None:
    """The seed ``seed_everything`` set in this process (Lightning keeps it in ``PL_GLOBAL_SEED``)."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed and seed.lstrip("-").isdigit() else None


def describe_data(datamodule: Any, splits: Sequence[str], options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The data of a run for its card: the datamodule's class, ``options`` (its config's ``init_args``),
    a dataset name, and the images and questions (or captions) of each of ``splits``, as the datamodule
    counts them (:meth:`~vlfuse.datamodules.VQADataModule.split_sizes`)."""
    cls = type(datamodule)
    options = dict(options or {})
    named = options.get("dataset")
    name = named if isinstance(named, str) else snake_case(cls.__name__.removesuffix("DataModule"))
    sizes = {split: datamodule.split_sizes(split) for split in splits}
    return {"name": name, "source": f"{cls.__module__}.{cls.__qualname__}", "options": options, "splits": sizes}


def snake_case(name: str) -> str:
    """``EasyVQA`` -> ``easy_vqa``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def software() -> dict[str, Any]:
    """The versions of vlfuse, Python and the libraries a model depends on, and vlfuse's git commit."""
    versions = {"vlfuse": vlfuse.__version__, "python": platform.python_version()}
    for name in SOFTWARE:
        loaded = getattr(sys.modules.get(name), "__version__", None)  # torch's names its build: 2.14.1+cu130
        try:
            versions[name] = loaded or importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"versions": versions, "commit": git_commit()}


@functools.cache
def git_commit() -> str | None:
    """The commit of the git checkout vlfuse runs from, ``+changes`` when its tracked files differ
    from it; ``None`` outside a checkout (an installed package) or without git. Asked once a process:
    the code a process runs is the code it imported."""
    source = Path(vlfuse.__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        commit = git("rev-parse", "--verify", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+changes" if changed else commit


def card_facts(model: nn.Module, run: RunRecord | None, text: Mapping[str, str] | None) -> dict[str, Any]:
    """What ``config.json`` keeps for the card of ``model``: parameter counts, the saving software,
    ``run`` and the card's ``text`` (see :data:`DEFAULT_TEXT`)."""
    unknown = sorted(set(text or {}) - set(DEFAULT_TEXT))
    if unknown:
        raise ValueError(f"model_card_kwargs: unknown {unknown}; the card's texts are {sorted(DEFAULT_TEXT)}")
    parts = {name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()}
    parameters = {
        "total": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "parts": {name: count for name, count in parts.items() if count},
    }
    return {"parameters": parameters, "software": software(), "run": run and run.to_dict(), "text": dict(text or {})}


# ------------------------------------------------------------------------------ writing the card
def write_card(folder: Path, meta: Mapping[str, Any] | None = None) -> Path:
    """Write ``folder``'s ``README.md`` atomically from its config (``meta``, default its ``config.json``);
    returns the card's path. The folder's digests do not cover the card: it stays loadable."""
    meta = read_folder_meta(folder) if meta is None else meta
    path = folder / model_io.CARD_FILE
    model_io.replace_file(path, str(render(folder, meta)))
    return path


def read_folder_meta(folder: Path) -> dict[str, Any]:
    """``folder``'s ``config.json``, checked to be a vlfuse model's (any kind and format)."""
    model_io.require_files(folder, [model_io.CONFIG_FILE], "a saved vlfuse model")
    meta = model_io.read_json(folder / model_io.CONFIG_FILE, model_io.MAX_CONFIG_BYTES)
    if not isinstance(meta, dict) or meta.get("model_type") not in KINDS:
        raise ValueError(f"{folder / model_io.CONFIG_FILE} is not the config of a vlfuse model folder")
    return meta


def add_metrics(folder: Path, metrics: Sequence[Metric], splits: Mapping[str, Any] | None = None) -> None:
    """Add ``metrics`` (measured on ``folder``'s weights as they are) to its run record, with the
    sizes of the ``splits`` they read, in ``config.json`` (replaced atomically: it has no digest),
    then rewrite the card. A folder without a run record gets one with only these."""
    meta = read_folder_meta(folder)
    card = meta.setdefault(CARD_KEY, {})
    run = read_run(meta) or RunRecord(weights_sha256=None)
    weights = (meta.get("files") or {}).get(model_io.WEIGHTS_FILE, {}).get("sha256")
    if run.weights_sha256 != weights:  # the record was of other weights: these metrics start a new one
        run = RunRecord(command=run.command, seed=run.seed, data=run.data, config=run.config, weights_sha256=weights)
    replaced = {(m.split, m.name) for m in metrics}
    run.metrics = [m for m in run.metrics if (m.split, m.name) not in replaced] + list(metrics)
    if splits and run.data is not None:
        run.data.setdefault("splits", {}).update(splits)
    card["run"] = run.to_dict()
    model_io.replace_file(folder / model_io.CONFIG_FILE, model_io.json_text(meta))
    write_card(folder, meta)


def render(folder: Path, meta: Mapping[str, Any]) -> ModelCard:
    """The card of the model folder ``folder`` whose ``config.json`` holds ``meta``; a ``config.json``
    whose values are not of the kinds vlfuse writes is a one-line ``ValueError`` naming it."""
    try:
        facts = Facts(folder, meta)
        return ModelCard(f"---\n{facts.card_data().to_yaml()}\n---\n\n{facts.body()}")
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"{folder / model_io.CONFIG_FILE}: cannot describe the model from it, a value is not of the kind vlfuse writes "
            f"({type(err).__name__}: {first_line(err)})"
        ) from None


class Facts:
    """What a folder tells its card: its config, the run that made it and what the files say."""

    def __init__(self, folder: Path, meta: Mapping[str, Any]) -> None:
        self.folder, self.meta = folder, meta
        self.model_type = meta["model_type"]
        self.pipeline, self.kind, self.tags = KINDS[self.model_type]
        card = meta.get(CARD_KEY) or {}
        self.card = card if isinstance(card, dict) else {}
        self.run = read_run(meta)
        weights = (meta.get("files") or {}).get(model_io.WEIGHTS_FILE, {})
        self.weights_sha256 = weights.get("sha256") if isinstance(weights, dict) else None
        self.measured_here = self.run is not None and self.run.weights_sha256 is not None and self.run.weights_sha256 == self.weights_sha256
        data = (self.run.data if self.run else None) or {}
        self.dataset = data.get("name")

    # -------------------------------------------------------------------------- metadata
    def card_data(self) -> ModelCardData:
        metrics = self.run.metrics if self.measured_here else []
        results = [
            EvalResult(
                task_type=self.pipeline, dataset_type=self.dataset or "unknown", dataset_name=self.dataset or "unknown",
                dataset_split=m.split, metric_type=METRICS.get(m.name, (m.name,))[0], metric_value=m.value,
                metric_name=f"{m.split} {metric_label(m.name)}",
            )
            for m in metrics if m.name != "loss"
        ]
        return ModelCardData(
            library_name="vlfuse",
            pipeline_tag=self.pipeline,
            tags=sorted({*TAGS, "model_hub_mixin", self.pipeline, *self.tags}),
            datasets=[self.dataset] if self.dataset else None,
            metrics=sorted({r.metric_type for r in results}) or None,
            model_name=self.title if results else None,
            eval_results=results or None,
        )

    @property
    def title(self) -> str:
        return f"vlfuse {self.kind}" + (f" ({self.dataset})" if self.dataset else "")

    # -------------------------------------------------------------------------- sections
    def body(self) -> str:
        sections = [
            f"# {self.title}\n\nA {self.kind} of vlfuse: a timm vision transformer "
            "encodes the image, and 16-head cross-attention blocks, in which the text tokens are the queries and the "
            "image patches the keys and values, fuse it with the text. This card was written from the folder's "
            "`config.json` (`vlfuse card MODEL --write` writes it again).",
            self.architecture(), self.parameters(), self.training(), self.evaluation(),
            self.software_section(), self.usage(), self.intended_use(),
        ]
        return "\n\n".join(section.strip() for section in sections) + "\n"

    def architecture(self) -> str:
        config = self.meta.get("config") or {}
        lines = ["## Architecture", ""]
        if self.model_type == model_io.MODEL_TYPE:
            version = self.meta.get("format_version")
            arch = config if version == model_io.FORMAT_VERSION else model_io.parts_of_flat(config)
            lines += [
                f"- image encoder: {image_encoder(arch.get('image', {}))}",
                f"- text encoder: {text_encoder(arch.get('text', {}))}",
                f"- both projected to width {arch.get('fusion_dim')}",
                f"- fuser: {part(arch.get('fuser', {}))}",
                f"- head: {part(arch.get('head', {}))}",
            ]
            pruned = arch.get("pruned_heads") or {}
            if pruned:
                lines.append("- pruned heads: " + "; ".join(f"layer {layer}: {len(ids)} heads ({ids})" for layer, ids in sorted(pruned.items())))
            answers = self.answers()
            if answers is not None:
                lines.append(f"- answers: {answers} (`answers.json`): every question gets one of them")
        else:
            options = {k: v for k, v in config.items() if k != "image"}
            lines += [
                f"- image encoder: {image_encoder(config.get('image', {}))}",
                f"- caption decoder: {', '.join(f'{k} {v}' for k, v in options.items())}",
            ]
        lines.append(f"- folder format {self.meta.get('format_version')} (`model_type: {self.model_type}`), weights in safetensors")
        return "\n".join(lines)

    def answers(self) -> int | None:
        try:
            return len(model_io.read_json(self.folder / model_io.ANSWERS_FILE))
        except (OSError, ValueError, TypeError):
            return None

    def parameters(self) -> str:
        counts = self.card.get("parameters")
        if isinstance(counts, dict) and "total" in counts:
            lines = ["## Parameters", "", f"{counts['total']:,} parameters ({counts.get('trainable', 0):,} trainable when saved).", "",
                     "| part | parameters |", "|---|---:|"]
            lines += [f"| {name} | {count:,} |" for name, count in (counts.get("parts") or {}).items()]
            return "\n".join(lines)
        try:
            header = model_io.read_header(self.folder)
        except ValueError:
            return "## Parameters\n\nNot recorded, and the weights file cannot be read."
        total = sum(_product(shape) for shape in header.values())
        return f"## Parameters\n\n{total:,} values in `model.safetensors` (buffers included: the folder predates the count)."

    def training(self) -> str:
        if self.run is None:
            return ("## Training\n\nNo run is recorded: the folder was saved by `save_pretrained` outside `vlfuse fit` "
                    "and `vlfuse prune` (or before vlfuse recorded runs).")
        run, lines = self.run, ["## Training", ""]
        data = run.data or {}
        if data:
            options = ", ".join(f"{k} {v}" for k, v in (data.get("options") or {}).items())
            lines.append(f"Data: **{data.get('name')}** (`{data.get('source')}`{': ' + options if options else ''}).")
            splits = data.get("splits") or {}
            if splits:
                units = sorted({unit for sizes in splits.values() for unit in sizes}, key=["images", "questions", "captions"].index)
                lines += ["", "| split | " + " | ".join(units) + " |", "|---|" + "---:|" * len(units)]
                lines += [f"| {split} | " + " | ".join(f"{sizes.get(u, '')}" for u in units) + " |" for split, sizes in splits.items()]
            lines.append("")
        if run.command:
            lines += [f"Command: `{run.command}`", ""]
        lines.append(f"Seed: {run.seed if run.seed is not None else 'not recorded'}.")
        if run.derived_from:
            lines += ["", f"Started from: {run.derived_from}."]
        if run.notes:
            lines += ["", *[f"- {note}" for note in run.notes]]
        if run.config:
            config = yaml.safe_dump(run.config, sort_keys=False, default_flow_style=False).strip()
            lines += ["", "<details><summary>Config of the run</summary>", "", "```yaml", config, "```", "", "</details>"]
        return "\n".join(lines)

    def evaluation(self) -> str:
        metrics = self.run.metrics if self.run else []
        if not metrics:
            return "## Evaluation\n\nNo metrics are recorded."
        lines = ["## Evaluation", ""]
        if not self.measured_here:
            lines += [f"These metrics were measured on other weights (sha256 {str(self.run.weights_sha256)[:12]}) than the "
                      f"folder's ({str(self.weights_sha256)[:12]}): the model was changed after (fine-tuned, pruned or "
                      "edited), and nothing measured it since. They are not in the metadata.", ""]
        lines += ["| split | metric | value | measured on | note |", "|---|---|---:|---:|---|"]
        for m in metrics:
            on = f"{m.count} {m.unit}" if m.count is not None else ""
            lines.append(f"| {m.split} | {metric_label(m.name)} | {m.value:.4f} | {on} | {m.note or ''} |")
        commands = list(dict.fromkeys(m.command for m in metrics if m.command))
        if commands:
            lines += ["", "Measured by:", "", *[f"- `{command}`" for command in commands]]
        return "\n".join(lines)

    def software_section(self) -> str:
        trained = (self.run.software if self.run else None) or {}
        saved = self.card.get("software") or {}
        shown = trained or saved
        if not shown:
            return "## Software\n\nNot recorded (the folder predates it)."
        versions = shown.get("versions") or {}
        which = "the run" if trained else "the save"
        lines = ["## Software", "", f"Versions of {which}:", "", "| package | version |", "|---|---|"]
        lines += [f"| {name} | {version} |" for name, version in versions.items()]
        lines += ["", f"vlfuse commit: {shown.get('commit') or 'not in a git checkout'}."]
        if trained and saved and saved.get("versions") != versions:
            lines.append(f"Saved again with: {', '.join(f'{k} {v}' for k, v in (saved.get('versions') or {}).items())}.")
        return "\n".join(lines)

    def usage(self) -> str:
        if self.model_type == model_io.MODEL_TYPE:
            code = ('from vlfuse import Predictor\n\npredictor = Predictor.from_pretrained("FOLDER_OR_OWNER/NAME")\n'
                    'print(predictor.predict(["image.png"], ["what shape is in the image?"]))')
        else:
            code = ('from vlfuse import Captioner\n\ncaptioner = Captioner.from_pretrained("FOLDER_OR_OWNER/NAME")\n'
                    'print(captioner.caption(["image.png"]))')
        return (f"## How to use\n\n```python\n{code}\n```\n\n`from_pretrained` takes this folder or its Hub repository "
                "(see vlfuse's docs/sharing.md).")

    def intended_use(self) -> str:
        text = {**DEFAULT_TEXT, **(self.card.get("text") or {})}
        data = self.dataset or "data not recorded"
        if self.model_type == model_io.MODEL_TYPE:
            values = {"task": "answering short questions", "data": data,
                      "inputs": "one image and one question at a time, in English words of its tokenizer",
                      "output": f"It gives one of its {self.answers() or 'fixed'} answers to every question, even one it "
                                "cannot answer: it has no \"I do not know\" (the predictor flags unknown words and low confidence)."}
        else:
            values = {"task": "describing images", "data": data, "inputs": "one image at a time",
                      "output": "It writes only words of its training captions' vocabulary."}
        use, limits = (text[key].format(**values) for key in ("intended_use", "limitations"))
        return f"## Intended use\n\n{use}\n\n## Limits\n\n{limits}"


def metric_label(name: str) -> str:
    return METRICS.get(name, (name, name))[1]


def part(config: Mapping[str, Any]) -> str:
    """``fusion_stack`` (depth 2, heads 16, ...)."""
    options = ", ".join(f"{k} {v}" for k, v in config.items() if k != "type")
    return f"`{config.get('type')}`" + (f" ({options})" if options else "")


def image_encoder(config: Mapping[str, Any]) -> str:
    pretrained = config.get("pretrained") or config.get("weights_file")
    how = "pretrained weights" + (f" from {config['weights_file']}" if config.get("weights_file") else "") if pretrained else "trained from scratch"
    sizes = ", ".join(f"{k.replace('_', ' ')} {config[k]}" for k in ("image_size", "patch_size", "width", "depth", "num_heads") if config.get(k) is not None)
    extra = [word for key, word in (("freeze", "frozen"), ("adapter", "LoRA adapter merged")) if config.get(key)]
    pixels = f"; images resized {config.get('interpolation', 'bilinear')}, normalised by mean {config.get('mean')} and std {config.get('std')}"
    return f"timm `{config.get('name')}`, {how}: {sizes}" + "".join(f", {word}" for word in extra) + pixels


def text_encoder(config: Mapping[str, Any]) -> str:
    if config.get("name"):
        head, keys = f"transformers `{config['name']}`, pretrained", ("max_length",)
    else:
        head, keys = f"{config.get('model_type')} from scratch with a word-level tokenizer", ("width", "depth", "num_heads", "max_length")
    sizes = ", ".join(f"{k.replace('_', ' ')} {config[k]}" for k in keys if config.get(k) is not None)
    extra = [word for key, word in (("freeze", "frozen"), ("adapter", "LoRA adapter merged")) if config.get(key)]
    return f"{head}: {sizes}" + "".join(f", {word}" for word in extra)


def _product(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total

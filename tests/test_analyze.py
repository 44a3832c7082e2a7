"""``vlfuse analyze``: the report of a tiny saved model on a few images, its data loading and rank maths."""

import math
import re
from pathlib import Path

import pytest
import torch

from vlfuse.analysis.data import build_datamodule, load_batches
from vlfuse.analysis.report import rank, spearman
from vlfuse.cli import main as vlfuse_main
from vlfuse.data import IGNORE_INDEX
from vlfuse.datamodules import EasyVQADataModule
from vlfuse.datamodules.shapes import find_shapes_dir
from vlfuse.model import VLFuseModel

from conftest import REPO, SHARED, reader_config, tiny_cli_args, tiny_config

EASY_VQA = REPO / "configs" / "easy_vqa.yaml"
SHAPES = REPO / "configs" / "shapes_pool.yaml"  # a model with fusion heads to analyse
PRUNED = {0: [1, 5]}  # layer 0 keeps 14 of its 16 heads
SHAPES_FUSION = REPO / "configs" / "shapes_fusion.yaml"  # the cell_moves fuser: one layer of 16 heads
ROLES = {"sink", "global", "object", "local", "mixed"}


def shapes_data_found() -> bool:
    """Whether the SHAPES datamodule finds the released files by itself (as ``vlfuse fit`` would)."""
    try:
        find_shapes_dir()
    except FileNotFoundError:
        return False
    return True


needs_shapes = pytest.mark.skipif(not shapes_data_found(), reason="SHAPES data folder not found")


def fit_shapes_fusion(root: Path) -> Path:
    """``vlfuse fit --config configs/shapes_fusion.yaml``, tiny (conftest's overrides for a word
    reader) and short (2 training batches, 2 images per question): the exported model's folder."""
    args = [
        "fit", "--config", str(SHAPES_FUSION), *tiny_cli_args(root, map_program=True),
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
        "--data.init_args.images_per_question=2",
    ]
    assert vlfuse_main(args) == 0
    return root / "model"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny untrained easy-VQA model (ungated, so the image matters), with two heads of layer 0 pruned."""
    torch.manual_seed(0)
    data = EasyVQADataModule(limit_images=8)
    model = VLFuseModel.from_config(tiny_config(fuser={"gated": False}), data.answers, data.train_questions)
    model.prune_heads(PRUNED)
    return model.save_pretrained(tmp_path_factory.mktemp("model") / "tiny")


def table_rows(section: str) -> list[list[str]]:
    """The body rows of the first markdown table in ``section``."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in lines[start + 2 : end]]


def sections(report: str, level: str) -> dict[str, str]:
    """``title -> text`` of the sections of one heading level (``"##"`` or ``"###"``)."""
    parts = re.split(rf"^{level} (.+)$", report, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_report_on_a_tiny_model_has_every_head_figure_and_score(model_dir, tmp_path, capsys):
    out = tmp_path / "report"
    args = ["analyze", "--model", str(model_dir), "--config", str(EASY_VQA), "--out", str(out)]
    assert vlfuse_main([*args, "--limit-images", "8", "--data.init_args.batch_size", "4"]) == 0
    assert f"wrote {out / 'report.md'}" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert "- data: 8 images," in report  # --limit-images reached the datamodule

    figures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert {"head_statistics.png", "head_agreement.png", "head_scores.png", "pruning_curve.png"} <= set(figures)
    assert any(name.startswith("role_") for name in figures)
    for name in figures:
        assert (out / name).stat().st_size > 1000, name

    layers = sections(report, "###")
    layer0, layer1 = table_rows(layers["Layer 0"]), table_rows(layers["Layer 1"])
    assert [int(row[0]) for row in layer0] == [h for h in range(16) if h not in PRUNED[0]]
    assert [int(row[0]) for row in layer1] == list(range(16))
    assert "Pruned heads: 1, 5." in layers["Layer 0"]
    for row in layer0 + layer1:
        assert 0.0 <= float(row[1]) <= 1.0 and row[-1] in ROLES
    dead = sum(row[-2] == "yes" for row in layer0 + layer1)
    assert f"dead heads: {dead} of 30" in report

    parts = sections(report, "##")
    scores = table_rows(parts["Head importance"])
    assert len(scores) == 30 and all(len(row) == 10 for row in scores)  # layer, head, 4 scores, 4 ranks
    assert {(int(r[0]), int(r[1])) for r in scores} == {(0, h) for h in range(16) if h not in PRUNED[0]} | {
        (1, h) for h in range(16)
    }
    correlations = table_rows(parts["Head importance"].split("Spearman")[1])
    assert [row[0] for row in correlations] == ["weight norm", "weight norm s_i", "gradient", "ablation"]
    assert all(float(correlations[i][i + 1]) == 1.0 for i in range(4))  # the diagonal

    curve = table_rows(parts["Accuracy against the fraction of heads pruned"])
    assert [float(row[0]) for row in curve] == pytest.approx([0.1 * i for i in range(10)])
    first = {float(value) for value in curve[0][1:]}
    assert len(first) == 1  # nothing pruned: one accuracy for every score
    assert f"accuracy: {first.pop():.4f}" in report
    assert "normalised entropy >= 0.95" in parts["Statistics, rules and thresholds"]


@pytest.fixture(scope="module")
def shapes_fusion_dir(tmp_path_factory) -> Path:
    """A tiny cell_moves model trained by ``vlfuse fit`` (:func:`fit_shapes_fusion`)."""
    return fit_shapes_fusion(tmp_path_factory.mktemp("shapes_fusion"))


@needs_shapes
def test_report_on_a_cell_reader_names_each_of_its_16_heads(shapes_fusion_dir, tmp_path, capsys):
    model = VLFuseModel.from_pretrained(shapes_fusion_dir)
    assert model.config.fuser.type == "cell_moves" and model.fusion_head_ids == [list(range(16))]
    out = tmp_path / "report"
    args = ["analyze", "--model", str(shapes_fusion_dir), "--config", str(SHAPES_FUSION), "--out", str(out),
            "--limit-images", "8"]
    assert vlfuse_main(args) == 0, capsys.readouterr().err
    report = (out / "report.md").read_text()
    assert "- data: 8 images," in report
    assert "- fusion layers: 1, heads: 16" in report

    figures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert {"head_statistics.png", "head_agreement.png", "head_scores.png", "pruning_curve.png"} <= set(figures)
    for name in figures:
        assert (out / name).stat().st_size > 1000, name

    layers = sections(report, "###")
    assert "Layer 1" not in layers
    rows = table_rows(layers["Layer 0"])
    assert [int(row[0]) for row in rows] == list(range(16))  # every head, by its id
    for row in rows:
        assert 0.0 <= float(row[1]) <= 1.0 and row[-1] in ROLES
    dead = sum(row[-2] == "yes" for row in rows)
    assert f"dead heads: {dead} of 16" in report
    scores = table_rows(sections(report, "##")["Head importance"])
    assert {(int(r[0]), int(r[1])) for r in scores} == {(0, h) for h in range(16)} and len(scores) == 16


def test_batches_are_labelled_with_the_models_own_answers(model_dir):
    model = VLFuseModel.from_pretrained(model_dir)
    model.answers = list(reversed(model.answers))  # another order than the datamodule's vocabulary
    data = build_datamodule(EASY_VQA, ["--data.init_args.limit_images=4", "--data.init_args.batch_size=2"])
    batches = load_batches(data, model, "val", max_batches=1)
    assert len(batches) == 1 and batches[0]["pixel_values"].shape[0] == 2
    expected = [a for record in data.records("val")[:2] for a in record.answers]
    labels = batches[0]["labels"].tolist()
    assert IGNORE_INDEX not in labels
    assert [model.answers[i] for i in labels] == expected
    model.answers = ["a", "b"]  # knows none of the answers
    with pytest.raises(ValueError, match="no question whose answer the model knows"):
        load_batches(data, model, "val")


@pytest.mark.skipif(not (SHARED / "data" / "shapes" / "val.query").is_file(), reason="released SHAPES files missing")
def test_shapes_config_gives_batches_with_objects_on_a_black_background(model_dir):
    from vlfuse.analysis.head_stats import object_cells

    model = VLFuseModel.from_pretrained(model_dir)
    model.answers = ["false", "true"]
    overrides = ["--data.init_args.limit_images=4", f"--data.init_args.data_dir={SHARED / 'data' / 'shapes'}"]
    data = build_datamodule(SHAPES, overrides)
    (batch,) = load_batches(data, model, "val")
    assert set(batch["labels"].tolist()) <= {0, 1}
    cells = object_cells(batch["pixel_values"], (6, 6))
    assert bool((cells.sum(1) >= 1).all()) and bool((cells.sum(1) < 36).all())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "missing.yaml"], "config file not found: missing.yaml"),
        (["--data.init_args.limit_imagez=3"], "limit_imagez"),
        (["--split", "test", "--config", str(SHAPES)], "SHAPES test split is held out"),
    ],
)
def test_bad_arguments_stop_with_one_message(model_dir, tmp_path, capsys, args, message):
    base = ["analyze", "--model", str(model_dir), "--config", str(EASY_VQA), "--out", str(tmp_path)]
    assert vlfuse_main([*base, *args]) == 2
    error = capsys.readouterr().err
    assert error.startswith("vlfuse: error:") and message in error
    assert not (tmp_path / "report.md").exists()


def test_a_model_whose_fuser_has_no_attention_heads_is_refused_in_one_line(tmp_path, capsys):
    torch.manual_seed(0)
    model = VLFuseModel.from_config(reader_config("map_program"), ["false", "true"], ["is a circle red"])
    directory = model.save_pretrained(tmp_path / "map_program")
    args = ["analyze", "--model", str(directory), "--config", str(EASY_VQA), "--out", str(tmp_path / "report"),
            "--limit-images", "4"]
    assert vlfuse_main(args) == 2
    assert capsys.readouterr().err == (
        f"vlfuse: error: {directory} has no attention heads to analyse: its fuser 'map_program' scores the image "
        "without cross-attention\n"
    )
    assert not (tmp_path / "report" / "report.md").exists()


def test_config_without_a_data_section_is_named(tmp_path):
    config = tmp_path / "model_only.yaml"
    config.write_text("model:\n  lr: 0.1\n")
    with pytest.raises(ValueError, match=f"{config} has no data: section"):
        build_datamodule(config)


def test_rank_gives_ties_their_mean_rank_and_spearman_reads_ranks_only():
    ranks = rank(torch.tensor([10.0, 30.0, 20.0, 30.0]))
    torch.testing.assert_close(ranks, torch.tensor([1.0, 3.5, 2.0, 3.5], dtype=torch.float64))
    a = torch.tensor([[0.1, 0.5, 0.2], [0.9, float("nan"), 0.3]])
    assert spearman(a, a.exp() * 7) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    # The NaN entry is left out of both: 5 pairs whose ranks differ by one swap of neighbours.
    b = torch.tensor([[0.2, 0.5, 0.1], [0.9, 0.0, 0.3]])
    assert spearman(a, b) == pytest.approx(1 - 6 * 2 / (5 * 24))
    assert math.isnan(spearman(torch.ones(2, 3), a))
    with pytest.raises(ValueError, match="one shape"):
        spearman(a, a.flatten())

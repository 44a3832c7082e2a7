"""scripts/shapes_accuracy.py reports val accuracy by depth for a saved model."""

import subprocess
import sys

import pytest

from vlfuse.datamodules import ShapesDataModule
from vlfuse.model import VLFuseModel

from conftest import REPO, SHARED, tiny_config

SHAPES = SHARED / "data" / "shapes"


needs_shapes = pytest.mark.skipif(not SHAPES.exists(), reason=f"needs the released SHAPES files in {SHAPES}")


def shapes_accuracy_output(tmp_path, *flags: str) -> str:
    """What the script prints for an untrained tiny model, run with ``flags``."""
    data = ShapesDataModule(data_dir=str(SHAPES), limit_images=64)
    VLFuseModel.from_config(tiny_config(), data.answers, data.train_questions).save_pretrained(tmp_path / "m")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "shapes_accuracy.py"), "--model", str(tmp_path / "m"),
         "--data-dir", str(SHAPES), *flags],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@needs_shapes
@pytest.mark.slow  # docs/datasets.md runs this command on a trained SHAPES model in every suite run
def test_reports_every_depth_and_all_val_questions(tmp_path):
    stdout = shapes_accuracy_output(tmp_path)
    rows = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["0", "1", "2", "all"]
    assert "| all | 1024 |" in stdout


@needs_shapes
def test_by_question_gives_each_of_the_16_val_questions_its_64_images(tmp_path):
    stdout = shapes_accuracy_output(tmp_path, "--by-question")
    rows = [line.split("|")[1:3] for line in stdout.splitlines() if line.startswith("| ")][1:]
    questions = [(name.strip(), int(count)) for name, count in rows[:-1]]
    assert len(questions) == 16 and all(count == 64 for _, count in questions)
    assert all(name[0] in "012" and ": (is " in name for name, _ in questions)

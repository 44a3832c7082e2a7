"""Every script in scripts/ answers --help; a bad --model is one line naming it (scripts/_common.py)."""

import runpy
import sys

import pytest

from conftest import REPO

SCRIPTS = sorted(path for path in (REPO / "scripts").glob("*.py") if not path.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_script_prints_its_usage_for_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {script.name} ") and "--help" in out


def test_a_script_run_on_a_folder_without_a_model_says_so_in_one_line(tmp_path, monkeypatch):
    script = REPO / "scripts" / "accuracy_by_question.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    message = exit_info.value.code  # Python prints it to stderr and exits with status 1
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(f"error: --model {tmp_path}: {tmp_path} is not a saved vlfuse model: missing ")


def test_the_shared_loaders_name_the_argument_at_fault(tmp_path):
    from _common import load_datamodule, set_threads

    with pytest.raises(SystemExit, match=f"^error: --config {tmp_path / 'none.yaml'}: config file not found"):
        load_datamodule(tmp_path / "none.yaml")
    with pytest.raises(SystemExit, match="^error: --threads must be at least 1, got 0$"):
        set_threads(0)

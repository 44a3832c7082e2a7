"""The output files of ``vlfuse predict`` and ``vlfuse caption`` (issue 31): written batch by batch
to a locked partial file and renamed at the end, never the input, never NaN."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from test_caption_cli import images  # noqa: F401 (a fixture: three random 30x30 PNGs)
from test_caption_model import tiny_caption_model
from test_predict import QUESTIONS, model_dir  # noqa: F401 (model_dir: a fixture)
from vlfuse.cli import main as vlfuse_main
from vlfuse.inference import Captioner, Predictor
from vlfuse.inference import jsonl
from vlfuse.inference.jsonl import InputRow, JsonlOutput, partial_path, write_rows
from vlfuse.model import VLFuseModel

from conftest import REPO

KILL_ROWS = 3000
"""Rows of the run that is killed: at batch size 1 many seconds of work, killed after its first rows."""

pytestmark = pytest.mark.usefixtures("one_thread")


OVERFLOW = 3e38
"""A finite float32 weight whose products overflow to infinity: the scores are NaN. (NaN weights
themselves are refused when a model is loaded.)"""


@pytest.fixture(scope="module")
def nan_model_dir(model_dir, tmp_path_factory):
    """The tiny model, saved again with its last classifier weights :data:`OVERFLOW`: every score is NaN."""
    model = VLFuseModel.from_pretrained(model_dir)
    with torch.no_grad():
        model.head.classifier[-1].weight.fill_(OVERFLOW)
    return model.save_pretrained(tmp_path_factory.mktemp("nan_model") / "tiny")


@pytest.fixture(scope="module")
def caption_dir(tmp_path_factory):
    return tiny_caption_model(seed=2).save_pretrained(tmp_path_factory.mktemp("caption") / "model")


@pytest.fixture(scope="module")
def nan_caption_dir(tmp_path_factory):
    model = tiny_caption_model(seed=2)
    with torch.no_grad():
        model.decoder.norm.weight.fill_(OVERFLOW)
    return model.save_pretrained(tmp_path_factory.mktemp("nan_caption") / "model")


def write_pairs(path: Path, images: list[Path], count: int, bad: bool = True) -> Path:
    """``count`` pairs over ``images`` in turn, and (with ``bad``) a malformed line and a missing image."""
    lines = [json.dumps({"image": str(images[i % len(images)]), "question": QUESTIONS[i % 4]}) for i in range(count)]
    if bad:
        lines[1:1] = ['{"image": "0.png", "question": ']
        lines.append(json.dumps({"image": str(path.parent / "missing.png"), "question": QUESTIONS[0]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def expected_lines(predictor: Predictor, source: Path, limit: int | None = None) -> list[str]:
    """What the command wrote before issue 31 for the first ``limit`` rows of ``source`` (default all):
    ``line``, the fields and the result (or the error) of each row."""
    rows = jsonl.read_rows(source)[:limit]
    readable = [row for row in rows if row.error is None]
    results = iter(predictor.predict([r.image for r in readable], [r.fields["question"] for r in readable],
                                     errors="report"))
    lines = []
    for row in rows:
        result = {"error": row.error} if row.error is not None else next(results)
        if "error" in result:
            result["error"] = f"line {row.line}: {result['error']}"
        lines.append(json.dumps({"line": row.line, **row.fields, **result}) + "\n")
    return lines


def reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_rows(text: str) -> list[dict]:
    """Every line of ``text`` as JSON, refusing NaN and infinity."""
    return [json.loads(line, parse_constant=reject_constant) for line in text.splitlines()]


@contextmanager
def held_lock(target: Path):
    """Hold the lock of ``target``'s partial file, as a run writing ``target`` does; the partial holds a row."""
    with open(partial_path(target), "a") as partial:
        partial.write('{"line": 1}\n')
        partial.flush()
        fcntl.flock(partial, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command loads a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Predictor, "from_pretrained", refuse)
    monkeypatch.setattr(Captioner, "from_pretrained", refuse)


# ------------------------------------------------------------------------------ complete and in order
@pytest.mark.parametrize("batch_size", ["1", "2", "64"])
def test_output_is_every_row_in_input_order_as_before(model_dir, images, tmp_path, capsys, batch_size):
    source = write_pairs(tmp_path / "pairs.jsonl", images, 7)
    output = tmp_path / "answers.jsonl"
    output.write_text("an old run\n")
    output.chmod(0o640)
    args = ["predict", "--model", str(model_dir), "--input", str(source), "--batch-size", batch_size]
    assert vlfuse_main([*args, "--output", str(output)]) == 1
    expected = expected_lines(Predictor.from_pretrained(model_dir, batch_size=int(batch_size)), source)
    assert output.read_text() == "".join(expected)
    assert [r["line"] for r in strict_rows(output.read_text())] == list(range(1, 10))
    assert output.stat().st_mode & 0o777 == 0o640
    assert not partial_path(output).exists()
    assert capsys.readouterr().err.splitlines()[-1].startswith("vlfuse predict: 2 of 9 rows failed (lines 2, 9)")
    assert vlfuse_main(args) == 1
    assert capsys.readouterr().out == "".join(expected)


def test_rows_reach_the_partial_file_batch_by_batch(model_dir, images, tmp_path, monkeypatch):
    source = write_pairs(tmp_path / "pairs.jsonl", images[:1], 5)  # one image: answered in input order
    output = tmp_path / "answers.jsonl"
    seen = []
    answer = Predictor._answer

    def recording(self, rows, *args):
        seen.append(len(partial_path(output).read_text().splitlines()))
        return answer(self, rows, *args)

    monkeypatch.setattr(Predictor, "_answer", recording)
    args = ["predict", "--model", str(model_dir), "--input", str(source), "--output", str(output), "--batch-size", "2"]
    assert vlfuse_main(args) == 1
    # Lines 1, 2 (malformed) and 3 after the first batch, 4 and 5 after the second; 6 and 7 (missing) at the end.
    assert seen == [0, 3, 5]
    assert len(output.read_text().splitlines()) == 7


def test_captions_are_written_in_order_through_the_partial_file(caption_dir, images, tmp_path, capsys):
    lines = [json.dumps({"image": str(images[0])}), "{not json", json.dumps({"image": str(tmp_path / "missing.png")}),
             json.dumps({"image": str(images[1])}), json.dumps({"image": str(images[2])})]
    source = tmp_path / "images.jsonl"
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "captions.jsonl"
    args = ["caption", "--model", str(caption_dir), "--input", str(source), "--output", str(output),
            "--max-length", "6", "--batch-size", "2"]
    assert vlfuse_main(args) == 1
    rows = strict_rows(output.read_text())
    expected = Captioner.from_pretrained(caption_dir).caption(images, max_length=6)
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r.get("caption") for r in rows] == [expected[0]["caption"], None, None, expected[1]["caption"],
                                                expected[2]["caption"]]
    assert not partial_path(output).exists()
    assert capsys.readouterr().err.splitlines()[-1].startswith("vlfuse caption: 2 of 5 rows failed (lines 2, 3)")


# ------------------------------------------------------------------------------ a run killed part-way
def test_a_killed_run_leaves_the_old_output_and_a_partial_prefix(model_dir, images, tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl", images[:1], KILL_ROWS, bad=False)
    output = tmp_path / "answers.jsonl"
    output.write_bytes(b'{"line": 1, "answer": "from an earlier run"}\n')
    before = output.read_bytes()
    partial = partial_path(output)
    command = [sys.executable, "-m", "vlfuse.cli", "predict", "--model", str(model_dir), "--input", str(source),
               "--output", str(output), "--batch-size", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (partial.exists() and partial.read_bytes().count(b"\n") >= 5):
            assert run.poll() is None, run.stderr.read().decode()
            assert time.monotonic() < deadline, "no rows in the partial file after 120 s"
            time.sleep(0.005)
        run.send_signal(signal.SIGKILL)
    finally:
        run.kill()
        run.wait()
        run.stderr.close()
    assert output.read_bytes() == before
    text = partial.read_text()
    # Each batch is one write of whole lines: a kill leaves whole lines (and at most a last one cut).
    whole = text[: text.rfind("\n") + 1]
    rows = strict_rows(whole)
    assert 5 <= len(rows) < KILL_ROWS
    predictor = Predictor.from_pretrained(model_dir, batch_size=1)
    expected = [json.loads(line) for line in expected_lines(predictor, source, len(rows))]
    assert [(r["line"], r["question"], r["answer"]) for r in rows] == [
        (e["line"], e["question"], e["answer"]) for e in expected]
    torch.testing.assert_close([r["score"] for r in rows], [e["score"] for e in expected], atol=1e-6, rtol=0)
    # The next run takes the partial file over (nobody holds its lock) and ends with the whole output.
    assert vlfuse_main(["predict", "--model", str(model_dir), "--input", str(source), "--output", str(output)]) == 0
    assert len(output.read_text().splitlines()) == KILL_ROWS
    assert not partial.exists()


# ------------------------------------------------------------------------------ one run per output file
@pytest.mark.parametrize("command", ["predict", "caption"])
def test_a_second_run_to_a_locked_output_fails_in_one_line_before_loading_the_model(
    command, images, tmp_path, capsys, no_model_load
):
    source = write_pairs(tmp_path / "pairs.jsonl", images, 2, bad=False)
    output = tmp_path / "out.jsonl"
    output.write_text("the last run's output\n")
    with held_lock(output):
        assert vlfuse_main([command, "--model", "unused", "--input", str(source), "--output", str(output)]) == 2
        assert partial_path(output).read_text() == '{"line": 1}\n'  # the running run's rows: not emptied
    assert capsys.readouterr().err == (
        f"vlfuse: error: another run is writing {output} (it holds the lock on {partial_path(output)}); "
        "wait for it to end or give another --output\n"
    )
    assert output.read_text() == "the last run's output\n"


def test_the_lock_is_held_until_the_output_is_renamed_and_then_taken_again(tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with JsonlOutput(target, source) as first:
        first.write(['{"line": 1}\n'])
        with pytest.raises(ValueError, match="another run is writing"):
            JsonlOutput(target, source)
        first.finish()  # the output is complete: a new run may start, and leaves it as it is until it ends
        with JsonlOutput(target, source) as second:
            assert target.read_text() == '{"line": 1}\n'
            second.write(['{"line": 2}\n'])
    assert target.read_text() == '{"line": 1}\n'  # not finished: the target stays; the partial keeps the row
    assert partial_path(target).read_text() == '{"line": 2}\n'


def test_a_run_ending_between_anothers_open_and_lock_keeps_its_output(tmp_path, monkeypatch):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    first = JsonlOutput(target, source)
    first.write(['{"line": 1}\n'])
    flock = fcntl.flock

    def first_ends_then_lock(fd, operation):
        if not target.exists():  # the second run has opened the first's partial file: the first ends now
            first.finish()
            first.close()
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", first_ends_then_lock)
    with JsonlOutput(target, source) as second:
        assert target.read_text() == '{"line": 1}\n'
        second.write(['{"line": 2}\n'])
        second.finish()
    assert target.read_text() == '{"line": 2}\n'


def test_a_run_that_fails_before_a_row_removes_its_partial_file(images, tmp_path, capsys):
    source = write_pairs(tmp_path / "pairs.jsonl", images, 2)
    output = tmp_path / "sub" / "out.jsonl"
    missing = tmp_path / "no_model"
    assert vlfuse_main(["predict", "--model", str(missing), "--input", str(source), "--output", str(output)]) == 2
    assert capsys.readouterr().err == f"vlfuse: error: model folder not found: {missing}\n"
    assert list(output.parent.iterdir()) == []


def test_a_symbolic_link_as_the_partial_file_is_refused(images, tmp_path, capsys, no_model_load):
    source = write_pairs(tmp_path / "pairs.jsonl", images, 2)
    output, victim = tmp_path / "out.jsonl", tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    partial_path(output).symlink_to(victim)
    assert vlfuse_main(["predict", "--model", "unused", "--input", str(source), "--output", str(output)]) == 2
    assert capsys.readouterr().err.startswith(f"vlfuse: error: {partial_path(output)} is a symbolic link")
    assert victim.read_text() == "keep me\n"


# ------------------------------------------------------------------------------ never the input
def test_output_that_is_the_input_is_refused_and_the_input_kept(images, tmp_path, capsys, monkeypatch, no_model_load):
    source = write_pairs(tmp_path / "pairs.jsonl", images, 3)
    with source.open("a") as extra:
        extra.write(json.dumps({"image": str(images[0]), "question": QUESTIONS[0], "id": "kept"}) + "\n")
    before = source.read_bytes()
    (tmp_path / "sub").mkdir()
    os.link(source, tmp_path / "hard.jsonl")
    (tmp_path / "link.jsonl").symlink_to(source)
    monkeypatch.chdir(tmp_path)
    for command, output in [("predict", "pairs.jsonl"), ("predict", "sub/../pairs.jsonl"), ("caption", "./pairs.jsonl"),
                            ("predict", "hard.jsonl"), ("predict", str(tmp_path / "link.jsonl"))]:
        assert vlfuse_main([command, "--model", "unused", "--input", "pairs.jsonl", "--output", output]) == 2
        assert capsys.readouterr().err == (
            f"vlfuse: error: --output {Path(output)} is the same file as --input pairs.jsonl; give another --output\n")
    assert source.read_bytes() == before
    assert not partial_path(source).exists()


# ------------------------------------------------------------------------------ non-finite scores
def test_nan_scores_are_row_errors_and_never_written(nan_model_dir, images, tmp_path, capsys):
    source = write_pairs(tmp_path / "pairs.jsonl", images, 2)
    output = tmp_path / "answers.jsonl"
    args = ["predict", "--model", str(nan_model_dir), "--input", str(source), "--top-k", "2"]
    assert vlfuse_main([*args, "--output", str(output)]) == 1
    rows = strict_rows(output.read_text())
    assert [r["line"] for r in rows] == [1, 2, 3, 4]
    assert all("answer" not in r and "score" not in r and "top_k" not in r for r in rows)
    assert rows[0]["error"] == "line 1: the model gave non-finite scores (nan); its weights may be damaged or overflow"
    assert rows[2]["error"].startswith("line 3: the model gave non-finite scores (nan)")
    assert capsys.readouterr().err.splitlines()[-1].startswith("vlfuse predict: 4 of 4 rows failed (lines 1, 2, 3, 4)")
    assert vlfuse_main(args) == 1
    assert strict_rows(capsys.readouterr().out) == rows


def test_nan_scores_of_one_pair_are_an_error_line(nan_model_dir, images, capsys):
    args = ["predict", "--model", str(nan_model_dir), "--image", str(images[0]), "--question", QUESTIONS[0]]
    assert vlfuse_main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "vlfuse: error: the model gave non-finite scores (nan); its weights may be damaged or overflow\n"
    with pytest.raises(ValueError, match="^row 0: the model gave non-finite scores"):
        Predictor.from_pretrained(nan_model_dir).predict(images[:1], QUESTIONS[:1])


def test_nan_caption_scores_are_row_errors_and_an_error_line(nan_caption_dir, images, tmp_path, capsys):
    source = tmp_path / "images.jsonl"
    source.write_text("".join(json.dumps({"image": str(path)}) + "\n" for path in images[:2]))
    output = tmp_path / "captions.jsonl"
    args = ["caption", "--model", str(nan_caption_dir), "--input", str(source), "--output", str(output)]
    assert vlfuse_main(args) == 1
    rows = strict_rows(output.read_text())
    assert [r["error"] for r in rows] == [
        f"line {n}: the model gave non-finite log-probability (nan); its weights may be damaged or overflow"
        for n in (1, 2)]
    capsys.readouterr()
    assert vlfuse_main(["caption", "--model", str(nan_caption_dir), "--image", str(images[0]), "--beam-size", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("vlfuse: error: the model gave non-finite log-probability (nan)")


def test_a_nan_that_slips_through_is_an_exception_not_a_line(tmp_path):
    rows = [InputRow(1, {"image": "a.png", "question": "what?"}, image=Path("a.png"))]
    target = tmp_path / "out.jsonl"
    with JsonlOutput(target, tmp_path / "in.jsonl") as out:
        with pytest.raises(ValueError, match="not JSON compliant"):
            write_rows(rows, iter([[{"answer": "red", "score": float("nan")}]]), out, "vlfuse predict", "answered", None)
    assert not target.exists() and not partial_path(target).exists()

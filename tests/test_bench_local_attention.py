"""Smoke test of scripts/bench_local_attention.py: tiny sizes, every contender, honest memory figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_script

bench = load_script("bench_local_attention")


def test_quick_run_prints_every_contender(tmp_path, capsys):
    report = tmp_path / "bench.json"
    rows = bench.main(["--quick", "--no-flex", "--no-memory", "--json", str(report)])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    for length in bench.QUICK["tokens"]:
        names = [row["case"] for row in rows if row["tokens"] == length]
        assert names[0] == "dense" and len(names) == 4 and all(n.endswith(": mask") for n in names[1:])
        assert sum(line.startswith(f"| {length} |") for line in table) == 4
    sliding = next(r for r in rows if r["case"].startswith("sliding") and r["tokens"] == 256)
    assert sliding["pairs_kept"] == pytest.approx(float(bench.sliding_window(256, 128).dense().float().mean()))
    data = json.loads(report.read_text())
    assert all(len(sample["ms"]) == bench.QUICK["repeats"] for sample in data["samples_ms"])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_memory_counts_what_a_call_allocates():
    # In a fresh process, as the benchmark's own workers measure: inside the test process, memory
    # that earlier tests freed can stay resident and be reused, so the peak would not rise.
    size = 64 * 2**20
    probe = (f"import torch; from conftest import load_script; "
             f"print(load_script('bench_local_attention').peak_extra_bytes(lambda: torch.ones({size // 4})))")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).parent, env=env,
                            capture_output=True, text=True, check=True)
    extra = int(result.stdout.strip().splitlines()[-1])  # 64 MiB, touched
    assert size <= extra < size + 16 * 2**20
    worker = bench.build_cases(256, 2, flex=False, only="dense")[0][0]
    assert bench.measure_memory(worker, heads=2, threads=1) > 0

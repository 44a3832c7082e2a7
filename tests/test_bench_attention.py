"""Smoke test of scripts/bench_attention.py: it runs at tiny sizes and reports every contender."""

import json

from conftest import load_script


def test_quick_run_prints_a_table_with_every_contender(tmp_path, capsys):
    bench = load_script("bench_attention")
    report = tmp_path / "bench.json"
    targets = bench.main(["--quick", "--json", str(report)])
    out = capsys.readouterr().out

    table = [line for line in out.splitlines() if line.startswith("| ")]
    labels = ["(a) CrossAttention", "(b) textbook", "(c) nn.MultiheadAttention", "pruned to 12 heads",
              "pruned to 8 heads", "bare (B*Lk,D)@(D,2D)"]
    for lk in bench.QUICK["lk"]:
        rows = [line for line in table if line.startswith(f"| {lk} |")]
        for label in labels:
            assert sum(label in row for row in rows) == 1, (lk, label)

    # Targets are printed with a verdict, never asserted on timings.
    assert len(targets) == 7
    assert all(t.status in ("PASS", "FAIL") for t in targets)
    assert out.count("PASS") + out.count("FAIL") == len(targets)

    data = json.loads(report.read_text())
    assert {row["contender"] for row in data["rows"]} == {"a", "b", "c", "d12", "d8", "bare"}
    assert all(len(case["ms"]) == bench.QUICK["repeats"] for case in data["samples_ms"])


def test_baseline_report_is_printed_next_to_this_run(tmp_path, capsys):
    bench = load_script("bench_attention")
    before = tmp_path / "before.json"
    bench.main(["--quick", "--json", str(before)])
    capsys.readouterr()
    bench.main(["--quick", "--baseline", str(before)])
    out = capsys.readouterr().out
    assert f"This run next to {before}" in out
    rows = [line for line in out.split("This run next to")[1].splitlines() if line.startswith("| ") and "ms before" not in line]
    earlier = json.loads(before.read_text())["rows"]
    assert len(rows) == len(earlier)
    for row, old in zip(rows, earlier):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:3] == [str(old["lk"]), old["label"], f"{old['fwd_ms']:.1f}"]
        assert cells[4] == f"{old['fwd_ratio']:.2f}"

"""scripts/bench_scale.py: a tiny run end to end (its tables, CSV files and plot), and what its numbers
rest on: the FLOP count, the exponent fit, the bytes kept for backward, the points swept. No timing
is asserted."""

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import load_script

bench_scale = load_script("bench_scale")


def read_csv(path):
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_a_tiny_sweep_runs_end_to_end_and_writes_its_tables_and_plot(tmp_path, capsys, one_thread):
    results = bench_scale.main(["--preset", "tiny", "--sweep", "tokens=5,17", "--variants", "plain",
                                "--repeats", "1", "--warmup", "0", "--threads", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    points = results["points"]
    assert [(row["tokens"], row["variant"], row["error"]) for row in points] == [(17, "plain", None), (5, "plain", None)]
    for row in points:  # each in a fresh process: its own peak, above what the model and optimizer hold
        assert row["image_size"] == 8 * math.isqrt(row["tokens"] - 1)
        assert row["kept_mib"] > 0 and row["static_mib"] > 0 and row["gflop_per_step"] > 0
        assert row["peak_mib"] >= row["baseline_mib"] > 0
    assert points[0]["kept_mib"] > points[1]["kept_mib"]  # more image tokens keep more for backward
    assert [(fit["factor"], fit["variant"], fit["values"]) for fit in results["exponents"]] == [("tokens", "plain", "5 17")]

    rows, summary = results["checkpointing"]
    assert [row["variant"] for row in rows] == ["plain", "checkpointed"]
    assert summary["kept_ratio"] > 1 and summary["max_grad_difference"] <= 1e-6
    fusion, growth = results["fusion"]
    assert [(row["fuser"], row["tokens"]) for row in fusion[:3]] == [("preset", 17), ("cross-attention only", 5),
                                                                      ("cross-attention only", 17)]
    assert fusion[2]["gflop"] > fusion[1]["gflop"] > 0 and growth["tokens"] == [5, 17]
    assert [row["part"] for row in results["split"]][-1] == "sum of the parts"

    assert "| image tokens | px | fusion depth |" in out and "Targets (benchmark goals, not assertions):" in out
    assert "PASS  tiny preset, batch 4: gradients equal" in out
    assert len(read_csv(tmp_path / "points.csv")) == 2 and read_csv(tmp_path / "exponents.csv")[0]["factor"] == "tokens"
    assert [row["variant"] for row in read_csv(tmp_path / "checkpointing.csv")] == ["plain", "checkpointed"]
    assert {"split.csv", "fusion.csv", "bench_scale.png"} <= {path.name for path in tmp_path.iterdir()}
    with Image.open(tmp_path / "bench_scale.png") as image:
        assert image.format == "PNG" and image.width > 300


def test_the_flops_of_a_linear_are_counted_by_hand():
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    forward = 2 * 4 * 16 * 8  # a multiply and an add per weight per row
    assert bench_scale.count_flops(lambda: linear(x)) == forward
    # backward: the input's gradient (4, 8) @ (8, 16) and the weight's (8, 4) @ (4, 16), as many again each
    assert bench_scale.count_flops(lambda: linear(x).sum().backward()) == 3 * forward
    frozen_input = torch.randn(4, 16)
    assert bench_scale.count_flops(lambda: linear(frozen_input).sum().backward()) == 2 * forward


def test_the_cpus_attention_kernels_are_counted():
    b, h, lq, lk, d = 2, 4, 5, 7, 8
    q = torch.randn(b, h, lq, d, requires_grad=True)
    k, v = torch.randn(b, h, lk, d, requires_grad=True), torch.randn(b, h, lk, d, requires_grad=True)
    product = 2 * b * h * lq * lk * d  # one of (Lq, d) @ (d, Lk) or (Lq, Lk) @ (Lk, d)
    assert bench_scale.count_flops(lambda: F.scaled_dot_product_attention(q, k, v)) == 2 * product
    # backward: the scores again, then the gradients of the weights, of v, of q and of k
    assert bench_scale.count_flops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward()) == 7 * product


def test_the_exponent_fit_finds_a_known_exponent():
    xs = [65, 197, 577]
    assert bench_scale.fit_exponent(xs, [3.0 * x**1.7 for x in xs]) == pytest.approx(1.7, abs=1e-9)
    assert bench_scale.fit_exponent([2, 6, 12], [0.5 + 0 * x for x in [2, 6, 12]]) == pytest.approx(0.0, abs=1e-12)
    noisy = [2.0 * x * (1.05 if i % 2 else 0.95) for i, x in enumerate([8, 16, 32, 64])]
    assert bench_scale.fit_exponent([8, 16, 32, 64], noisy) == pytest.approx(1.0, abs=0.1)
    with pytest.raises(ValueError, match="two or more distinct positive x"):
        bench_scale.fit_exponent([8, 8], [1.0, 2.0])


def test_kept_for_backward_counts_what_autograd_saves_but_not_the_weights():
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with bench_scale.KeptForBackward(linear) as kept:
        linear(x)  # addmm keeps x (for the weight's gradient) and the weight (a parameter: left out)
    assert kept.bytes == x.nbytes
    with bench_scale.KeptForBackward(linear) as kept:
        y = linear(x)
        torch.relu(y)  # and relu its output
    assert kept.bytes == x.nbytes + y.nbytes


def test_image_tokens_give_the_image_size_or_an_error_naming_the_argument():
    assert [bench_scale.image_size(tokens, 16) for tokens in (65, 197, 577)] == [128, 224, 384]
    with pytest.raises(ValueError, match=r"^--tokens 100: image tokens are a square grid of patches plus CLS"):
        bench_scale.image_size(100, 16)
    with pytest.raises(SystemExit):
        bench_scale.parse_args(["--tokens", "100"])


def test_points_vary_one_factor_at_a_time_around_the_base():
    base = bench_scale.Point(tokens=197, depth=6, width=768, batch=8)
    points = bench_scale.points_of(base, {"tokens": (65, 197, 577), "batch": (8, 32)})
    assert points == [base, bench_scale.Point(65, 6, 768, 8), bench_scale.Point(577, 6, 768, 8), bench_scale.Point(197, 6, 768, 32)]
    args = bench_scale.parse_args(["--batch", "8", "--sweep", "tokens", "depth=2,12"])
    assert args.point == base and args.sweeps == {"tokens": (65, 197, 577), "depth": (2, 12)}
    assert bench_scale.parse_args(["--sweep"]).sweeps == {}
    assert bench_scale.parse_args(["--quick"]).parts == ["split", "fusion", "checkpointing"]


def test_the_base_preset_is_the_real_size_preset_of_configs_base_224():
    import yaml

    from conftest import REPO

    preset = bench_scale.PRESETS["base"]
    config = bench_scale.architecture(preset, preset.base, "plain")
    written = yaml.safe_load((REPO / "configs" / "base_224.yaml").read_text())["model"]["architecture"]
    assert config.image.image_size == written["image"]["image_size"] == 224
    assert config.image.name == written["image"]["name"]
    for key, value in written["text"].items():
        assert getattr(config.text, key) == value, key
    assert config.fusion_dim == written["fusion_dim"]
    for key, value in written["fuser"].items():
        assert getattr(config.fuser, key) == value, key
    assert config.head.type == written["head"]["type"]


def test_the_page_fault_bench_times_both_variants_and_counts_their_faults(capsys):
    bench_page_faults = load_script("bench_page_faults")
    measured = bench_page_faults.main(["--preset", "tiny", "--batch", "2", "--repeats", "2", "--threads", "1"])
    assert set(measured) == {"plain", "checkpointed"}
    for runs in measured.values():
        assert len(runs) == 2
        assert all(seconds > 0 and faults.minor >= 0 and faults.kernel_s >= 0 for seconds, faults in runs)
    printed = capsys.readouterr().out
    assert "| plain |" in printed and "| checkpointed |" in printed and "checkpointed / plain, each pair:" in printed


def test_faults_count_the_pages_a_fresh_allocation_touches():
    before = bench_scale.Faults.now()
    buffer = torch.ones(16 * 2**20)  # 64 MiB: above malloc's largest mmap threshold (32 MiB), so fresh pages, each written
    faulted = bench_scale.Faults.now() - before
    assert faulted.minor >= buffer.nbytes // (2 * 2**20)  # at least one fault per page, were they 2 MiB huge pages
    assert faulted.kernel_s >= 0

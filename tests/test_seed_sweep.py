"""scripts/seed_sweep.py and the diagnostics it adds to every run (vlfuse/callbacks.py)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, load_script, tiny_overrides


def test_a_sweep_trains_each_variant_and_seed_and_tabulates_curves_and_groups(tmp_path):
    sweep = {
        "config": "configs/easy_vqa.yaml",
        "common": [*tiny_overrides(limit_images=6), "--trainer.max_epochs=2", "--trainer.log_every_n_steps=1", "--threads=1"],
        "variants": {"pool": ["--model.architecture.head.type=pooled"], "bilinear": []},
        "seeds": [3],
    }
    spec = tmp_path / "sweep.json"
    spec.write_text(json.dumps(sweep))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "scripts/seed_sweep.py", str(spec), "--out", str(out), "--parallel", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads((out / "sweep.json").read_text())
    assert sorted((r["variant"], r["seed"]) for r in runs) == [("bilinear", 3), ("pool", 3)]
    for run in runs:
        assert run["rc"] == 0 and 0.0 <= run["test"] <= 1.0
        assert len(run["epochs"]) == 2  # one validation per epoch, each with its groups
        assert "val/acc" in run["epochs"][-1]
        assert any(key.startswith("val_group/yes/no") for key in run["epochs"][-1])
    table = (out / "sweep.md").read_text()
    assert "| pool |" in table and "| bilinear |" in table and "median" in table
    for variant, head in (("pool", "pooled"), ("bilinear", "bilinear")):  # the variant's override reached the model
        saved = json.loads((out / f"{variant}_s3" / "latest" / "model" / "config.json").read_text())
        assert saved["config"]["head"]["type"] == head
    metrics = next((out / "pool_s3").rglob("metrics.csv")).read_text().splitlines()[0]
    assert "grad_norm/fuser" in metrics and "grad_norm/head" in metrics and "grad_norm/image_encoder" in metrics


@pytest.mark.parametrize(
    "content, message",
    [("{", "sweep.json: Expecting"), ('{"config": "c.yaml", "variants": [], "seeds": [0]}', "'variants' must be a dict")],
)
def test_a_bad_sweep_file_is_named(tmp_path, content, message):
    spec = tmp_path / "sweep.json"
    spec.write_text(content)
    with pytest.raises(SystemExit, match=message):
        load_script("seed_sweep").read_sweep(spec)


def test_gradient_norms_refuses_a_zero_interval():
    from vlfuse.callbacks import GradientNorms

    with pytest.raises(ValueError, match="every_n_steps must be at least 1"):
        GradientNorms(every_n_steps=0)


def test_the_variants_of_a_seed_run_together_so_that_their_times_compare():
    sweep = {"config": "c.yaml", "variants": {"a": [], "b": ["--x"]}, "seeds": [3, 1]}
    assert load_script("seed_sweep").run_order(sweep) == [("a", 3), ("b", 3), ("a", 1), ("b", 1)]

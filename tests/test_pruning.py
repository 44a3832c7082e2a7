"""Which heads go, the pruned copy and what it saves, and the ``vlfuse prune`` command end to end."""

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlfuse.analysis.data import build_datamodule, load_batches
from vlfuse.analysis.head_scores import evaluate, score_heads
from vlfuse.analysis.pruning import (
    Latency,
    count_parameters,
    heads_per_layer,
    heads_to_prune,
    measure_latency,
    prune_model,
    take_questions,
)
from vlfuse.cli import main as vlfuse_main
from vlfuse.cli import run_lightning
from vlfuse.data import IGNORE_INDEX, preprocess_image
from vlfuse.model import VLFuseModel
from vlfuse.inference import Predictor

from conftest import HEADS, REPO, SCORED_ANSWERS, logits, reader_config, tiny_cli_args
from test_analyze import SHAPES_FUSION, fit_shapes_fusion, needs_shapes

pytestmark = pytest.mark.usefixtures("one_thread")

NAN = float("nan")
SCORES = torch.tensor([[0.5, 0.1, 0.9, 0.3], [0.2, 0.8, 0.05, 0.7]])
EASY_VQA = REPO / "configs" / "easy_vqa.yaml"


# ------------------------------------------------------------------------------ which heads go
@pytest.mark.parametrize(
    "fraction, expected",
    [
        (0.0, {}),
        (0.25, {0: [1], 1: [2]}),  # 0.05 and 0.1
        (0.5, {0: [1, 3], 1: [0, 2]}),  # then 0.2 and 0.3
        (0.3, {0: [1], 1: [2]}),  # 2.4 heads: 2
        (0.3125, {0: [1], 1: [0, 2]}),  # 2.5 heads: rounded up to 3
        (0.75, {0: [0, 1, 3], 1: [0, 2, 3]}),  # 6 of 8: the most that can go
    ],
)
def test_a_fraction_prunes_the_lowest_scored_heads_over_all_layers(fraction, expected):
    assert heads_to_prune(SCORES, fraction=fraction) == expected


def test_a_layer_keeps_its_last_head_and_the_next_lowest_goes_instead():
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.9, 0.8, 0.7, 0.6]])
    assert heads_to_prune(scores, fraction=0.5) == {0: [0, 1, 2], 1: [3]}
    assert heads_to_prune(scores, threshold=0.5) == {0: [0, 1, 2]}  # layer 0 keeps its best head
    assert heads_to_prune(scores, threshold=1.0) == {0: [0, 1, 2], 1: [1, 2, 3]}


def test_a_threshold_prunes_every_head_scoring_at_most_tau():
    assert heads_to_prune(SCORES, threshold=0.3) == {0: [1, 3], 1: [0, 2]}
    assert heads_to_prune(SCORES, threshold=0.01) == {}


def test_removed_heads_and_ties():
    scores = torch.tensor([[NAN, 0.1, NAN, 0.3], [0.2, 0.2, 0.2, 0.7]])  # 6 heads present
    assert heads_to_prune(scores, fraction=0.5) == {0: [1], 1: [0, 1]}  # ties by (layer, head)
    with pytest.raises(ValueError, match="pruning 5 of 6 heads, but at most 4 can go"):
        heads_to_prune(scores, fraction=0.8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of fraction or threshold"),
        ({"fraction": 0.5, "threshold": 0.1}, "exactly one of fraction or threshold"),
        ({"fraction": 1.0}, r"fraction must be in \[0, 1\), got 1.0"),
        ({"fraction": -0.1}, r"fraction must be in \[0, 1\), got -0.1"),
        ({"fraction": 0.875}, "pruning 7 of 8 heads, but at most 6 can go"),
    ],
)
def test_bad_rules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        heads_to_prune(SCORES, **kwargs)
    with pytest.raises(ValueError, match="must be \\(layers, heads\\)"):
        heads_to_prune(SCORES[0], fraction=0.5)


@pytest.mark.parametrize("score", ["weight_norm", "gradient", "ablation"])
def test_pruning_by_each_score_removes_its_lowest_heads(model, batches, score):
    scores = score_heads(model, score, batches)
    pruned = prune_model(model, heads_to_prune(scores, fraction=0.25))
    lowest = torch.argsort(scores.flatten(), stable=True)[:8]  # 8 of 32; ties in (layer, head) order
    expected = {(int(i) // 16, int(i) % 16) for i in lowest}
    removed = {(layer, h) for layer, block in enumerate(pruned.fuser.stack.blocks) for h in block.cross_attn.pruned_heads}
    assert removed == expected
    assert sum(heads_per_layer(pruned)) == 24 and heads_per_layer(model) == [16, 16]


# ------------------------------------------------------------------------- the pruned model
def test_prune_model_copies_and_counts_the_removed_weights(model):
    pruned = prune_model(model, HEADS)
    assert heads_per_layer(pruned) == [13, 12] and heads_per_layer(model) == [16, 16]
    assert pruned.config.pruned_heads == {"0": [1, 5, 9], "1": [0, 2, 3, 15]}
    assert model.config.pruned_heads == {}
    # Per head (head_dim 2, dim = kv_dim = 32): q rows + bias, k and v rows + biases, out-projection columns.
    per_head = (32 * 2 + 2) + 2 * (32 * 2 + 2) + 32 * 2
    assert count_parameters(model) - count_parameters(pruned) == 7 * per_head


def test_a_pruned_model_saves_loads_and_predicts(model, tmp_path):
    pruned = prune_model(model, HEADS)
    directory = pruned.save_pretrained(tmp_path / "pruned")
    loaded = VLFuseModel.from_pretrained(directory)
    assert heads_per_layer(loaded) == [13, 12]
    head_ids = [block.cross_attn.head_ids for block in pruned.fuser.stack.blocks]
    assert [block.cross_attn.head_ids for block in loaded.fuser.stack.blocks] == head_ids
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40, 30, 3), dtype=np.uint8) for _ in range(3)]
    questions = ["what color is the shape?", "is there a red shape?", "what shape is it?"]
    results = Predictor.from_pretrained(directory).predict(images, questions)
    pixels = torch.stack([preprocess_image(image, 32) for image in images])
    with torch.no_grad():
        probs = pruned(pixels, **pruned.processor.tokenize(questions)).logits.softmax(-1)
    assert [r["answer"] for r in results] == [SCORED_ANSWERS[i] for i in probs.argmax(-1)]
    torch.testing.assert_close(torch.tensor([r["score"] for r in results]), probs.max(-1).values, atol=1e-5, rtol=0)


def test_take_questions_keeps_only_the_images_asked_about(batches):
    batch = take_questions(batches, 9)  # batch 0 has 1+2+3 questions about 3 images; then 3 of batch 1's first image
    assert batch["questions"] == batches[0]["questions"] + batches[1]["questions"][:3]
    assert batch["image_index"].tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3]
    torch.testing.assert_close(batch["pixel_values"][3], batches[1]["pixel_values"][0])
    assert len(take_questions(batches, 100)["questions"]) == 13


def test_measure_latency_times_every_model(model, batches, monkeypatch):
    # A clock that moves only in forward passes, by a cost per model and part: each sample must be one
    # model's own fuser or whole forward pass, warm-up left out, and speedup their paired ratio.
    from vlfuse.analysis import timing
    from vlfuse.analysis.pruning import speedup

    now = [0.0]
    monkeypatch.setattr(timing, "perf_counter", lambda: now[0])
    models = {"before": prune_model(model, {}), "after": prune_model(model, HEADS)}  # copies carry the hooks
    for name, (fusion_cost, rest_cost) in {"before": (4.0, 2.0), "after": (1.0, 1.0)}.items():
        models[name].fuser.register_forward_hook(lambda *_, cost=fusion_cost: now.__setitem__(0, now[0] + cost))
        models[name].register_forward_hook(lambda *_, cost=rest_cost: now.__setitem__(0, now[0] + cost))
    latency = measure_latency(models, take_questions(batches, 8), repeats=2, warmup=1)
    assert all(isinstance(t, Latency) for t in latency.values())
    assert {name: (t.fusion_times, t.model_times) for name, t in latency.items()} == {
        "before": ([4.0, 4.0], [6.0, 6.0]), "after": ([1.0, 1.0], [2.0, 2.0])}
    assert speedup(latency["before"], latency["after"]) == (4.0, 3.0)
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        measure_latency({"before": model}, batches[0], repeats=0)


# ---------------------------------------------------------------------------- vlfuse prune
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model exported by ``vlfuse fit`` (one fusion layer of 16 heads) on 8 easy-VQA images."""
    root = tmp_path_factory.mktemp("fit")
    run_lightning(["fit", "--config", str(EASY_VQA), *tiny_cli_args(root), "--trainer.fast_dev_run=true"])
    return root


def test_vlfuse_prune_end_to_end(trained, tmp_path, capsys):
    out = tmp_path / "pruned"
    code = vlfuse_main([
        "prune", "--model", str(trained / "model"), "--config", str(EASY_VQA), "--score", "gradient",
        "--fraction", "0.5", "--finetune-epochs", "1", "--limit-images", "8", "--eval-split", "test",
        "--latency-repeats", "2", "--out", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    for row in ("| heads per layer | 16 | 8 | 8 pruned |", "test accuracy, pruned", "then fine-tuned 1 epoch",
                "parameters, fuser", "latency, fuser (64 questions", "latency, whole model"):
        assert row in printed
    model = VLFuseModel.from_pretrained(out)
    assert heads_per_layer(model) == [8]
    original = VLFuseModel.from_pretrained(trained / "model")
    assert not torch.equal(model.head.classifier[2].weight, original.head.classifier[2].weight)  # fine-tuned
    [answer] = Predictor.from_pretrained(out).predict([np.zeros((64, 64, 3), np.uint8)], ["what color is the shape?"])
    assert answer["answer"] in model.answers

    # vlfuse test runs the saved model with the printed --model.pretrained line.
    datamodule = build_datamodule(EASY_VQA, ["--data.init_args.limit_images=8"])
    test_batches = load_batches(datamodule, model, "test")
    expected_accuracy = evaluate(model, test_batches)
    with torch.no_grad():
        labels = torch.cat([b["labels"] for b in test_batches])
        all_logits = torch.cat([logits(model, b) for b in test_batches])
    expected_loss = F.cross_entropy(all_logits, labels, ignore_index=IGNORE_INDEX)
    assert f"vlfuse test --config {EASY_VQA} --model.pretrained {out}" in printed
    cli = run_lightning([
        "test", "--config", str(EASY_VQA), *tiny_cli_args(tmp_path / "test"), f"--model.pretrained={out}",
    ])
    metrics = cli.trainer.callback_metrics
    assert abs(float(metrics["test/acc"]) - expected_accuracy) < 1e-6
    assert abs(float(metrics["test/loss"]) - float(expected_loss)) < 1e-4


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--threshold", "-1"], "nothing to prune: no weight_norm score is at most -1.0"),
        (["--fraction", "0.99"], "pruning 16 of 16 heads, but at most 15 can go"),
        (["--fraction", "0"], "nothing to prune: --fraction 0.0 of 16 heads rounds to 0 heads"),
        (["--fraction", "0.5", "--out", "SAME"], "--out must differ from --model"),
    ],
)
def test_vlfuse_prune_errors_are_one_line(trained, tmp_path, capsys, extra, message):
    out = str(trained / "model") if "SAME" in extra else str(tmp_path / "out")
    extra = [out if e == "SAME" else e for e in extra]
    args = ["prune", "--model", str(trained / "model"), "--config", str(EASY_VQA), "--score", "weight_norm",
            "--limit-images", "4", "--out", str(tmp_path / "out"), *extra]
    assert vlfuse_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_model_already_in_out_is_replaced_only_with_overwrite(trained, tmp_path, capsys):
    out = VLFuseModel.from_pretrained(trained / "model").save_pretrained(tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()
    args = ["prune", "--model", str(trained / "model"), "--config", str(EASY_VQA), "--score", "weight_norm",
            "--fraction", "0.5", "--limit-images", "4", "--latency-repeats", "1", "--out", str(out)]
    assert vlfuse_main(args) == 2
    assert capsys.readouterr().err == f"vlfuse: error: --out {out} is not empty: give a new folder, or --overwrite to replace the model saved there\n"
    assert (out / "model.safetensors").read_bytes() == before
    assert vlfuse_main([*args, "--overwrite"]) == 0
    assert heads_per_layer(VLFuseModel.from_pretrained(out)) == [8]


def test_a_model_whose_fuser_has_no_attention_heads_is_refused_in_one_line(tmp_path, capsys):
    torch.manual_seed(0)
    model = VLFuseModel.from_config(reader_config("map_program"), ["false", "true"], ["is a circle red"])
    directory = model.save_pretrained(tmp_path / "map_program")
    args = ["prune", "--model", str(directory), "--config", str(EASY_VQA), "--score", "weight_norm",
            "--fraction", "0.5", "--limit-images", "4", "--out", str(tmp_path / "out")]
    assert vlfuse_main(args) == 2
    assert capsys.readouterr().err == (
        f"vlfuse: error: {directory} has no attention heads to prune: its fuser 'map_program' scores the image "
        "without cross-attention\n"
    )
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_fraction_zero_with_fine_tuning_is_the_unpruned_control(trained, tmp_path, capsys):
    out = tmp_path / "control"
    code = vlfuse_main([
        "prune", "--model", str(trained / "model"), "--config", str(EASY_VQA), "--score", "weight_norm",
        "--fraction", "0", "--finetune-epochs", "1", "--limit-images", "4", "--latency-repeats", "1",
        "--out", str(out),
    ])
    assert code == 0
    assert "| heads per layer | 16 | 16 | 0 pruned |" in capsys.readouterr().out
    model = VLFuseModel.from_pretrained(out)
    original = VLFuseModel.from_pretrained(trained / "model")
    assert heads_per_layer(model) == [16]
    assert not torch.equal(model.head.classifier[2].weight, original.head.classifier[2].weight)  # fine-tuned all the same


# ------------------------------------------------------------- vlfuse prune on the cell readers (configs/shapes_fusion.yaml: cell_moves)
@pytest.fixture(scope="module")
def shapes_fusion_dir(tmp_path_factory):
    """A tiny cell_moves model (configs/shapes_fusion.yaml: one shared block of 16 heads) exported by ``vlfuse fit``."""
    return fit_shapes_fusion(tmp_path_factory.mktemp("shapes_fusion"))


@needs_shapes
def test_vlfuse_prune_removes_a_cell_readers_heads_and_the_smaller_model_answers(shapes_fusion_dir, tmp_path, capsys):
    out = tmp_path / "pruned"
    code = vlfuse_main([
        "prune", "--model", str(shapes_fusion_dir), "--config", str(SHAPES_FUSION), "--score", "gradient",
        "--fraction", "0.5", "--limit-images", "8", "--latency-repeats", "1", "--out", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    for row in ("| heads per layer | 16 | 8 | 8 pruned |", "parameters, fuser", "latency, fuser ("):
        assert row in printed
    original = VLFuseModel.from_pretrained(shapes_fusion_dir)
    model = VLFuseModel.from_pretrained(out)
    assert model.config.fuser.type == "cell_moves"
    assert heads_per_layer(original) == [16] and heads_per_layer(model) == [8]
    assert model.fuser.step.cross_attn.num_heads == 8

    # The heads that went are the 8 lowest gradient scores on the batches the command scored.
    datamodule = build_datamodule(SHAPES_FUSION, ["--data.init_args.limit_images=8"])
    heads = heads_to_prune(score_heads(original, "gradient", load_batches(datamodule, original, "val")), fraction=0.5)
    assert list(heads) == [0] and len(heads[0]) == 8
    assert model.config.pruned_heads == {"0": heads[0]}
    assert model.fusion_head_ids == [[h for h in range(16) if h not in heads[0]]]
    assert f"layer 0 pruned heads: {heads[0]}" in printed

    # The smaller model gives the logits of the original with those heads masked out, and Predictor
    # loads it and answers with them.
    records = datamodule.records("val")[:4]
    images, questions = [r.image for r in records], [r.questions[0] for r in records]
    inputs = model.processor(images, questions)
    head_mask = torch.ones(1, 16)
    head_mask[0, heads[0]] = 0.0
    with torch.no_grad():
        pruned_logits = model(**inputs).logits
        torch.testing.assert_close(pruned_logits, original(**inputs, head_mask=head_mask).logits, atol=1e-5, rtol=0)
        assert not torch.allclose(pruned_logits, original(**inputs).logits, atol=1e-4)  # the heads mattered
    probs = pruned_logits.softmax(-1)
    results = Predictor.from_pretrained(out).predict(images, questions)
    assert [r["answer"] for r in results] == [model.answers[i] for i in probs.argmax(-1)]
    torch.testing.assert_close(torch.tensor([r["score"] for r in results]), probs.max(-1).values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("argv0, typed", [(".venv/bin/vlfuse", ".venv/bin/vlfuse"), ("/srv/env/bin/vlfuse", "/srv/env/bin/vlfuse"),
                                          ("-c", "vlfuse"), ("/repo/vlfuse/cli.py", "vlfuse")])
def test_the_printed_test_command_starts_as_vlfuse_was_started(monkeypatch, argv0, typed):
    from vlfuse.commands.prune import typed_command

    monkeypatch.setattr(sys, "argv", [argv0, "prune"])
    assert typed_command() == typed

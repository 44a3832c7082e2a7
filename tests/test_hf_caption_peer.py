"""The transformers caption peer (vlfuse.baselines.hf_caption) and the scripts that set it beside vlfuse's."""

import csv

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlfuse.baselines.hf_caption import HFCaptionPeer
from vlfuse.captioning import CaptionConfig, CaptionModel, SceneCaptionScores, describe
from vlfuse.data import IGNORE_INDEX
from vlfuse.data.shapes import sample_scenes
from vlfuse.captioning.lit import training_captions
from vlfuse.encoders import ImageEncoderConfig, build_word_tokenizer

from conftest import load_script

compare = load_script("compare_caption_peers")
bench = load_script("bench_peers_speed")
trained_bench = load_script("bench_trained_generation")

TINY = CaptionConfig(
    image=ImageEncoderConfig(image_size=30, patch_size=10, width=16, depth=1, num_heads=2),
    dim=32, depth=1, heads=4, mlp_ratio=2.0, dropout=0.0, max_length=96,
)


def scenes_and_pixels(count: int):
    """``count`` SHAPES scenes, their grammar captions and their images (count, 3, 30, 30) in [0, 1]."""
    rng = np.random.default_rng(0)
    scenes = sample_scenes(count, rng)
    return scenes, [describe(s) for s in scenes], bench.scene_pixels(scenes, rng, 30)


def teacher_forced_loss(model: HFCaptionPeer, pixels: torch.Tensor, captions: list[str]) -> torch.Tensor:
    """CaptionLitModule's loss: the cross-entropy of every next token, padding ignored."""
    ids = model.tokenize(captions)  # (B, L)
    logits = model(pixels, ids[:, :-1])  # (B, L - 1, vocab)
    targets = ids[:, 1:].masked_fill(ids[:, 1:] == model.pad_id, IGNORE_INDEX)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def test_the_peer_trains_two_steps_and_its_loss_falls(one_thread):
    scenes, captions, pixels = scenes_and_pixels(4)
    torch.manual_seed(0)
    model = HFCaptionPeer.from_caption_config(TINY, captions).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = teacher_forced_loss(model, pixels, captions)
    for _ in range(2):
        optimizer.zero_grad()
        teacher_forced_loss(model, pixels, captions).backward()
        optimizer.step()
    assert teacher_forced_loss(model, pixels, captions) < before


def test_greedy_generate_writes_the_forced_length_and_vlfuses_scorer_reads_it(one_thread):
    scenes, captions, pixels = scenes_and_pixels(3)
    torch.manual_seed(0)
    model = HFCaptionPeer.from_caption_config(TINY, captions).eval()
    ids = model.generate_ids(pixels, max_new_tokens=5, min_new_tokens=5)
    assert ids.shape == (3, 6) and (ids[:, 0] == model.bos_id).all()
    written = model.caption(pixels, max_new_tokens=5, min_new_tokens=5)
    assert written == [model.detokenize(row[1:]) for row in ids.tolist()]
    scorer = SceneCaptionScores()
    scorer.update(written, scenes)
    untrained = scorer.compute()
    scorer.reset()
    scorer.update(captions, scenes)  # the grammar's own captions are all true and complete
    exact = scorer.compute()
    assert 0.0 <= float(untrained["fact_precision"]) <= 1.0
    assert float(exact["fact_precision"]) == 1.0 and float(exact["object_recall"]) == 1.0
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate_ids(pixels, max_new_tokens=TINY.max_length)


def test_the_peer_is_the_size_of_the_shapes_caption_model():
    config = bench.caption_architecture(bench.DEFAULT_CONFIG)
    words = [bench.GRAMMAR_WORDS]
    ours = sum(p.numel() for p in CaptionModel.from_config(config, words).parameters())
    peer = HFCaptionPeer.from_caption_config(config, words)
    theirs = sum(p.numel() for p in peer.parameters())
    assert abs(theirs / ours - 1) < 0.05
    decoder = peer.model.decoder.config
    assert decoder.is_decoder and decoder.add_cross_attention and decoder.num_attention_heads == config.heads


def test_compare_caption_peers_quick_trains_and_scores_both_and_the_trained_bench_reads_their_weights(tmp_path, one_thread, capsys):
    assert compare.main(["--quick", "--threads", "1", "--save-weights", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "caption_peers.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == ["vlfuse", "hf"]
    for row in rows:
        assert float(row["train_s"]) > 0 and int(row["parameters"]) > 0
        assert all(0.0 <= float(row[f"test_{s}"]) <= 1.0 for s in ("fact_precision", "object_recall"))
    assert "| vlfuse |" in (tmp_path / "caption_peers.md").read_text()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["hf_seed0_lr0.001.safetensors", "vlfuse_seed0_lr0.001.safetensors"]

    capsys.readouterr()
    weights = ["--weights", str(tmp_path / "weights"), "--lr", "1e-3"]
    assert trained_bench.main([*weights, "--threads", "1", "--images", "2", "--repeats", "1", "--warmup", "0", "--leave-at", "2"]) == 0
    table = capsys.readouterr().out
    assert all(f"| {case} |" in table for case in ("vlfuse greedy", "transformers generate", "vlfuse greedy, leave at 2"))
    config = trained_bench.caption_architecture(trained_bench.DEFAULT_CONFIG)
    args = trained_bench.parse_args(weights)
    trained_on = build_word_tokenizer(training_captions(compare.load_datamodule(compare.DEFAULT_CONFIG, compare.QUICK_DATA)), 96)
    for name in ("vlfuse", "hf"):  # the tokenizer of the run, saved with its weights
        assert trained_bench.load_trained(name, config, args).tokenizer.get_vocab() == trained_on.get_vocab()
    with pytest.raises(SystemExit, match="vlfuse_seed0_lr0.002.safetensors not found"):
        trained_bench.load_trained("vlfuse", config, trained_bench.parse_args(["--weights", str(tmp_path / "weights")]))


def test_compare_caption_peers_names_a_config_without_a_caption_model_before_training(tmp_path):
    vqa_config = compare.REPO / "configs" / "easy_vqa.yaml"
    with pytest.raises(SystemExit, match=r"--config .*easy_vqa.yaml: no usable model.init_args.caption_model"):
        compare.main(["--quick", "--config", str(vqa_config), "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_bench_peers_speed_quick_times_every_case_against_vlfuse(tmp_path, capsys):
    assert bench.main(["--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "peers_speed.csv") as f:
        rows = list(csv.DictReader(f))
    cases = [(r["what"], r["case"]) for r in rows]
    assert cases[:4] == [("generation", "vlfuse greedy"), ("generation", "transformers generate"),
                         ("training step", "vlfuse train step"), ("training step", "transformers train step")]
    for step in ("forward", "forward + backward"):
        assert [c for w, c in cases if w == step] == list(bench.layer_modules(8, 2))
    assert all(float(r["ratio_to_vlfuse_median"]) > 0 for r in rows)
    assert all(float(r["ratio_to_vlfuse_median"]) == 1.0 for r in rows if r["case"] in ("vlfuse greedy", "vlfuse train step", "vlfuse CrossAttention"))


def test_the_layer_with_one_key_value_product_computes_the_same_forward_and_gradients():
    modules = bench.layer_modules(32, 4)
    ours, one_product = modules["vlfuse CrossAttention"][0], modules["vlfuse, one k/v product"][0]
    text, image = torch.randn(2, 4, 32), torch.randn(2, 9, 32, requires_grad=True)
    torch.testing.assert_close(ours(text, image), one_product(text, image))
    grads = [torch.autograd.grad(m(text, image).square().sum(), [image, m.kv_proj.weight, m.kv_proj.bias]) for m in (ours, one_product)]
    torch.testing.assert_close(grads[0], grads[1])


def test_bench_peers_speed_times_only_the_parts_asked(tmp_path):
    assert bench.main(["--quick", "--threads", "1", "--parts", "layer", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "peers_speed.csv") as f:
        whats = {r["what"] for r in csv.DictReader(f)}
    assert whats == {"forward", "forward + backward"}


def test_bench_peers_speed_refuses_a_bad_layer_size():
    with pytest.raises(SystemExit):
        bench.parse_args(["--layer-size", "2", "4", "9", "30", "4"])

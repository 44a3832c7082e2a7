"""scripts/compare_baselines.py and its peers (vlfuse.baselines): shapes, gradients, FiLM, a tiny real run."""

import csv
import dataclasses

import pytest
import torch
import yaml

from vlfuse.baselines import BowCNN, FiLM, FiLMedResBlock, FiLMNet, coordinate_maps
from vlfuse.baselines.bow_cnn import bag_of_words

from conftest import REPO, load_script, parameters_without_gradient

compare = load_script("compare_baselines")

VOCAB, ANSWERS = 12, 5


def grouped_inputs(image_size: int, n_images: int = 3, per_image: int = 2):
    """Images (Bi, 3, S, S), right-padded word ids of different lengths (Bq, L), and each question's image."""
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(n_images, 3, image_size, image_size, generator=g)
    n = n_images * per_image
    lengths = torch.tensor([3 + i % 3 for i in range(n)])
    mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long()  # (Bq, L)
    ids = torch.randint(1, VOCAB, mask.shape, generator=g) * mask
    return pixels, ids, mask, torch.arange(n_images).repeat_interleave(per_image)


PEERS = {
    "bow_cnn": (lambda: BowCNN(VOCAB, ANSWERS, image_size=16, width=8), 16),
    "film": (lambda: FiLMNet(VOCAB, ANSWERS, width=8, blocks=2, classifier_channels=8, hidden=8, embed_dim=4, gru_hidden=6), 32),
}


@pytest.mark.parametrize("name", PEERS)
def test_each_peer_answers_every_question_and_trains_every_parameter(name, one_thread):
    build, size = PEERS[name]
    torch.manual_seed(0)
    model = build()
    inputs = grouped_inputs(size)
    logits = model(*inputs)
    assert logits.shape == (6, ANSWERS) and torch.isfinite(logits).all()
    logits.logsumexp(dim=-1).sum().backward()
    missing = parameters_without_gradient(model)
    assert not missing, f"no gradient: {missing}"


@pytest.mark.parametrize("name", PEERS)
def test_a_peers_answer_ignores_padding_and_the_other_questions(name, one_thread):
    build, size = PEERS[name]
    torch.manual_seed(0)
    model = build().eval()
    pixels, ids, mask, index = grouped_inputs(size)
    together = model(pixels, ids, mask, index)
    longer_pad = torch.nn.functional.pad(ids, (0, 2))
    alone = model(pixels[1:2], longer_pad[3:4], torch.nn.functional.pad(mask, (0, 2))[3:4], torch.zeros(1, dtype=torch.long))
    torch.testing.assert_close(alone[0], together[3])


def test_bag_of_words_marks_each_word_present_once_and_not_the_padding():
    ids = torch.tensor([[2, 5, 5, 7, 0], [2, 4, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    bags = bag_of_words(ids, mask, 8)
    assert bags.tolist() == [[0, 0, 1, 0, 0, 1, 0, 1], [0, 0, 1, 0, 1, 0, 0, 0]]


def test_film_with_unit_scale_and_zero_shift_is_the_identity():
    x = torch.randn(2, 3, 4, 5)
    torch.testing.assert_close(FiLM()(x, torch.ones(2, 3), torch.zeros(2, 3)), x)


def test_film_scales_and_shifts_each_channel_of_each_example_on_its_own():
    x = torch.ones(2, 3, 2, 2)
    gamma, beta = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 1.0]]), torch.tensor([[0.0, 1.0, 0.0], [5.0, 0.0, 0.0]])
    out = FiLM()(x, gamma, beta)
    assert out[:, :, 0, 0].tolist() == [[1.0, 3.0, 3.0], [5.0, -1.0, 1.0]]
    assert (out == out[:, :, :1, :1]).all()  # the same at every position


def test_a_filmed_block_depends_on_its_question_parameters():
    torch.manual_seed(0)
    block = FiLMedResBlock(4).eval()
    x = torch.randn(2, 4, 3, 3)
    neutral = block(x, torch.ones(2, 4), torch.zeros(2, 4))
    assert not torch.allclose(neutral, block(x, torch.ones(2, 4), torch.ones(2, 4)))


def test_coordinate_maps_run_from_minus_one_to_one_along_x_then_y():
    maps = coordinate_maps(2, 3, 5)
    assert maps.shape == (2, 2, 3, 5)
    assert maps[0, 0, 0].tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]  # x varies along a row
    assert maps[0, 1, :, 0].tolist() == [-1.0, 0.0, 1.0]  # y varies down a column


@pytest.fixture
def tiny_config(tmp_path):
    """configs/easy_vqa.yaml with a tiny vlfuse model and 8 images per split."""
    config = yaml.safe_load((REPO / "configs" / "easy_vqa.yaml").read_text())
    config["model"]["architecture"]["image"].update(image_size=32, patch_size=8, width=32, depth=1, num_heads=2)
    config["model"]["architecture"]["text"].update(width=32, depth=1, num_heads=2)
    config["model"]["architecture"]["fusion_dim"] = 32
    config["model"]["architecture"]["fuser"].update(depth=1)
    config["data"]["init_args"].update(limit_images=8)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_short_run_writes_the_table_the_points_and_the_plot(tiny_config, tmp_path, one_thread, capsys):
    out = tmp_path / "out"
    argv = ["--config", str(tiny_config), "--max-batches", "2", "--epochs", "1", "--threads", "1", "--out", str(out),
            "--set", *(f"{name}.batch_size=4" for name in compare.MODELS), "blip_vqa.width=32", "vilt.width=32"]
    assert compare.main(argv) == 0
    with (out / "peers.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["model"] for r in rows] == list(compare.MODELS)
    assert all(0.0 <= float(r["test_acc"]) <= 1.0 and float(r["train_seconds"]) > 0 for r in rows)
    table = (out / "peers.md").read_text()
    assert all(f"| {name} |" in table for name in compare.MODELS) and "Best peer:" in table
    assert (out / "peers.png").read_bytes().startswith(b"\x89PNG")
    assert "test acc (last)" in capsys.readouterr().out


@pytest.mark.parametrize("name", compare.HF_PEERS)
def test_a_transformers_peer_trains_on_its_loss_and_is_scored_on_its_answers(name, tiny_config, one_thread):
    config = yaml.safe_load(tiny_config.read_text())
    settings = dataclasses.replace(compare.PEER_DEFAULTS[name], batch_size=4, width=32)
    datamodule = compare.load_datamodule(tiny_config, ["--data.init_args.batch_size=4"])
    datamodule.image_size = settings.image_size
    datamodule.setup("fit")
    torch.manual_seed(0)
    module = compare.build_module(name, settings, datamodule, config)
    batch = next(iter(datamodule.train_dataloader()))
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    losses = []
    for _ in range(3):  # two steps, then the loss after them
        loss = module.training_step(batch, 0)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[2] < losses[0], losses
    module.eval()
    assert 0.0 <= compare.accuracy(module, [batch]) <= 1.0
    answers = module.answer(batch)
    assert answers.shape == batch["labels"].shape and (answers < len(datamodule.answers)).all()


def test_the_transformers_peers_are_the_vlfuse_defaults_size():
    config = yaml.safe_load((REPO / "configs" / "easy_vqa.yaml").read_text())
    datamodule = compare.load_datamodule(REPO / "configs" / "easy_vqa.yaml")
    datamodule.image_size = 32
    datamodule.setup("fit")
    sizes = {name: sum(p.numel() for p in compare.build_module(name, compare.PEER_DEFAULTS[name], datamodule, config).parameters())
             for name in compare.HF_PEERS}
    assert all(abs(size - 674_650) <= 0.15 * 674_650 for size in sizes.values()), sizes


def test_equal_time_scores_each_model_after_its_last_epoch_done_by_the_sooner_end():
    settings = compare.Settings(lr=1e-3, epochs=3, batch_size=1, image_size=32)
    ours = compare.Result("vlfuse", settings, 1, [(1, 10.0, 0.5), (2, 20.0, 0.8), (3, 30.0, 0.9)])
    slow = compare.Result("vilt", settings, 1, [(1, 25.0, 0.6), (2, 50.0, 0.7)])
    fast = compare.Result("film", settings, 1, [(1, 15.0, 0.4)])
    late = compare.Result("blip_vqa", settings, 1, [(1, 40.0, 0.95)])
    assert compare.equal_time([ours, slow, fast, late]) == (
        "At 30 s: vlfuse 90.00%, vilt 60.00%. At 15 s: vlfuse 50.00%, film 40.00%. At 30 s: vlfuse 90.00%, blip_vqa no epoch done."
    )


def test_settings_start_from_the_published_ones_and_change_by_model():
    settings = {"film": dataclasses.replace(compare.PEER_DEFAULTS["film"])}
    compare.apply_settings(settings, ["film.lr=1e-3", "film.width=32", "film.schedule=cosine"])
    assert (settings["film"].lr, settings["film"].width, settings["film"].schedule) == (1e-3, 32, "cosine")
    assert compare.PEER_DEFAULTS["film"].lr == 3e-4  # the defaults stay as published


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("film.depth=3", "film has no setting 'depth'"),
        ("vlfuse.width=64", "vlfuse has no setting 'width'"),
        ("bow_cnn.lr=1e-3", "no model 'bow_cnn' in this run"),
        ("film.epochs=two", "epochs takes a int, got 'two'"),
        ("film.schedule=step", "schedule is one of constant, cosine"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(assignment, message):
    settings = {"film": compare.Settings(lr=1e-3, epochs=1, batch_size=1, image_size=32), "vlfuse": compare.Settings(1e-3, 1, 1, 32)}
    with pytest.raises(SystemExit, match=f"^error: --set {assignment}: {message}"):
        compare.apply_settings(settings, [assignment])


def test_the_vlfuse_settings_are_the_configs():
    config = yaml.safe_load((REPO / "configs" / "easy_vqa.yaml").read_text())
    settings = compare.config_settings(config)
    assert (settings.lr, settings.epochs, settings.batch_size, settings.image_size) == (
        config["model"]["lr"], config["trainer"]["max_epochs"], config["data"]["init_args"]["batch_size"],
        config["model"]["architecture"]["image"]["image_size"],
    )

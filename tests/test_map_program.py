"""MapProgramReader: offsets, the three operations on hand-set weights, padding, and the map-program
fuser (``fuser: {type: map_program}`` with the existence head) in a model."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vlfuse.data.shapes import COLOURS, RELATIONS, SHAPES, evaluate, parse_query, sample_scenes, to_english
from vlfuse.data.shapes import _shift as shift  # the dataset's own relation semantics
from vlfuse.encoders import TextEncoderConfig
from vlfuse.fusers import OPERATIONS, FusionStackConfig, MapProgramConfig, MapProgramFuser, MapProgramReader, relative_offsets
from vlfuse.heads import ExistenceHead
from vlfuse.model import VLFuseModel

from conftest import REPO, reader_config, tiny_config

DIM = 8
SHARP = 60.0  # large enough that every softmax and sigmoid below is one-hot / 0-1 to float precision
# Token features (one-hot): what each dimension makes a token do in the hand-set reader.
FIND_X, FIND_Y, MOVE_RIGHT, MOVE_DOWN, KEEP = range(5)


def test_relative_offsets_index_source_minus_target():
    index = relative_offsets(3, 3)  # 5 x 5 offsets, (0, 0) is index 12
    assert index.shape == (9, 9)
    assert torch.all(index.diagonal() == 12)
    assert index[4, 5] == 13  # source one column right of the target
    assert index[4, 3] == 11  # one column left
    assert index[4, 1] == 7  # one row up
    assert index[0, 8] == 24 and index[8, 0] == 0  # the far corners
    assert relative_offsets(2, 4).max() == 3 * 7 - 1


def offset_index(d_row: int, d_col: int, rows: int = 3, cols: int = 3) -> int:
    return (d_row + rows - 1) * (2 * cols - 1) + d_col + cols - 1


def hand_set_reader() -> MapProgramReader:
    """A reader whose tokens do exactly one thing each (see the FIND_X... constants)."""
    reader = MapProgramReader(DIM, (3, 3))
    with torch.no_grad():
        for layer in (reader.find_query[0], reader.find_key[0], reader.operation, reader.move):
            layer.weight.zero_()
            layer.bias.zero_()
        # find: query dims (0, 1) score key dims (0, 1), (2, 3) score (2, 3); a patch's key is
        # (x, -x, y, -y, 0, ...) with x, y = +1 in the set X, Y, -1 out of it: zero mean, so the
        # QK-norm only rescales it, and its gain makes the score sharp
        reader.find_query[0].weight[0, FIND_X] = reader.find_query[0].weight[2, FIND_Y] = 1.0
        reader.find_query[0].weight[1, FIND_X] = reader.find_query[0].weight[3, FIND_Y] = -1.0
        reader.find_key[0].weight[0, 0] = reader.find_key[0].weight[2, 1] = 1.0
        reader.find_key[0].weight[1, 0] = reader.find_key[0].weight[3, 1] = -1.0
        reader.find_query[1].weight.fill_(SHARP)
        reader.find_key[1].weight.fill_(1.0)
        keep, intersect, move = (OPERATIONS.index(name) for name in ("keep", "intersect", "move"))
        reader.operation.weight[intersect, FIND_X] = reader.operation.weight[intersect, FIND_Y] = SHARP
        reader.operation.weight[move, MOVE_RIGHT] = reader.operation.weight[move, MOVE_DOWN] = SHARP
        reader.operation.weight[keep, KEEP] = SHARP
        # "right of Y" holds the patches whose left neighbour is in Y: the source is one column left
        reader.move.weight[offset_index(0, -1), MOVE_RIGHT] = SHARP
        reader.move.weight[offset_index(-1, 0), MOVE_DOWN] = SHARP
    return reader


def tokens_for(program: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(1, length, DIM)
    for t, kind in enumerate(program):
        tokens[0, t, kind] = 1.0
    mask = torch.zeros(1, length, dtype=torch.bool)
    mask[0, : len(program)] = True
    return tokens, mask


@pytest.mark.parametrize("seed", range(1, 7))
def test_hand_set_reader_runs_the_program_right_to_left(seed):
    """[find X, move down, find Y, move right, keep, find Y] = X and below(Y and right_of(Y)), step by step.

    The find between the two moves makes their order matter: run left to right, or with the moves
    swapped, the steps below would differ.
    """
    rng = np.random.default_rng(seed)
    x_cells, y_cells = rng.random((3, 3)) < 0.5, rng.random((3, 3)) < 0.5
    patches = torch.tensor(np.stack([x_cells.ravel(), y_cells.ravel()], -1), dtype=torch.float32) * 2 - 1
    patches = torch.cat([patches, torch.zeros(9, DIM - 2)], -1)[None]  # (1, 9, DIM)
    reader = hand_set_reader()
    program = [FIND_X, MOVE_DOWN, FIND_Y, MOVE_RIGHT, KEEP, FIND_Y]
    tokens, mask = tokens_for(program, length=8)  # 2 padding tokens
    with torch.no_grad():
        evidence, maps = reader(tokens, mask, reader.project_context(patches), return_maps=True)
    right_of_y = shift(y_cells, *RELATIONS["right_of"])
    below = shift(y_cells & right_of_y, *RELATIONS["below"])
    steps = [x_cells & below, below, y_cells & right_of_y, right_of_y, y_cells, y_cells]  # map after token t
    assert not np.array_equal(right_of_y, shift(y_cells, *RELATIONS["below"]))  # a swap of the moves would show
    assert maps.shape == (1, 8, 9)
    for t, expected in enumerate(steps):
        np.testing.assert_allclose(maps[0, t].numpy(), expected.ravel().astype(np.float32), atol=1e-4, err_msg=f"token {t}")
    assert torch.equal(maps[0, 6], torch.ones(9)) and torch.equal(maps[0, 7], torch.ones(9))  # padding: untouched
    # evidence: the log of the set's (soft) size
    assert math.exp(evidence.item()) == pytest.approx(steps[0].sum(), abs=1e-3)


def test_shared_images_give_the_same_evidence_as_copies():
    torch.manual_seed(0)
    reader = MapProgramReader(DIM, (3, 3))
    patches = torch.randn(2, 9, DIM)
    tokens, mask = torch.randn(3, 5, DIM), torch.ones(3, 5, dtype=torch.bool)
    index = torch.tensor([1, 0, 1])
    shared = reader(tokens, mask, reader.project_context(patches), index)
    copied = reader(tokens, mask, reader.project_context(patches[index]))
    torch.testing.assert_close(shared, copied)
    with pytest.raises(ValueError, match="pass image_index"):
        reader(tokens, mask, reader.project_context(patches))


def test_wrong_grid_is_named():
    reader = MapProgramReader(DIM, (3, 3))
    with pytest.raises(ValueError, match="3x3 patch grid"):
        reader.project_context(torch.randn(1, 10, DIM))


QUESTIONS = ["is a red shape a square", "is a circle left of a square", "is a circle red"]


def test_model_with_the_map_program_fuser_trains_saves_and_reloads(tmp_path):
    torch.manual_seed(0)
    model = VLFuseModel.from_config(reader_config(), ["false", "true"], QUESTIONS)
    assert isinstance(model.fuser, MapProgramFuser) and isinstance(model.head, ExistenceHead)
    assert model.fuser.reader.grid_size == (4, 4) and not model.has_fusion_heads and model.num_fusion_layers == 0
    batch = model.processor.tokenize(QUESTIONS)
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    out = model(pixels, batch["input_ids"], batch["attention_mask"], image_index=index)
    assert out.logits.shape == (3, 2)
    out.logits[:, 1].sum().backward()
    assert model.fuser.reader.find_key[0].weight.grad.abs().sum() > 0  # the image reaches the answer through the reader
    assert model.text_encoder.model.get_input_embeddings().weight.grad.abs().sum() > 0  # and the words
    assert model.image_encoder.vit.patch_embed.proj.weight.grad.abs().sum() > 0
    model.save_pretrained(tmp_path / "m")
    loaded = VLFuseModel.from_pretrained(tmp_path / "m")
    model.eval()
    torch.testing.assert_close(
        loaded(pixels, batch["input_ids"], batch["attention_mask"], image_index=index).logits,
        model(pixels, batch["input_ids"], batch["attention_mask"], image_index=index).logits,
    )
    assert loaded.config.fuser == MapProgramConfig() and loaded.config.head.type == "existence"


def test_a_fusion_head_the_wrong_text_encoder_and_other_answers_are_refused_with_the_reader():
    with pytest.raises(ValueError, match="head 'pooled' reads tokens, but fuser 'map_program' gives evidence: use a head of type 'existence'"):
        tiny_config(text=TextEncoderConfig(width=32, depth=0, num_heads=2), fuser={"type": "map_program"})
    with pytest.raises(ValueError, match="fuser 'map_program' reads the question's word embeddings.*set text.depth to 0 .*got 2"):
        tiny_config(text=TextEncoderConfig(width=32, depth=2, num_heads=2), fuser={"type": "map_program"}, head={"type": "existence"})
    with pytest.raises(ValueError, match="two answers"):
        VLFuseModel.from_config(reader_config(), ["red", "green", "blue"], QUESTIONS)


FUSION_STACK_OPTIONS = dict(
    depth=2, heads=8, mlp_ratio=4.0, dropout=0.0, attn_dropout=0.1, self_attention=False, gated=False,
    normalizer="leaky_relu", diversity_weight=0.5, output_gate=True, mlp="swiglu",
)
"""An option of the fusion stack each, none of which the map-program fuser has."""


def test_every_fusion_stack_option_is_tried_below():
    options = [spec.name for spec in dataclasses.fields(FusionStackConfig) if spec.name != "type"]
    assert sorted(FUSION_STACK_OPTIONS) == sorted(options)


@pytest.mark.parametrize("option", sorted(FUSION_STACK_OPTIONS))
def test_a_fuser_option_the_reader_does_not_have_is_refused_by_name(option):
    message = f"fuser: a fuser of type 'map_program' has no option {option} (its options: none)"
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        reader_config(**{option: FUSION_STACK_OPTIONS[option]})
    assert "\n" not in str(info.value)


def test_pruned_heads_of_a_reader_without_attention_layers_are_refused():
    with pytest.raises(ValueError, match="pruned_heads names layer 0, but fuser 'map_program' has 0 attention layers"):
        VLFuseModel.from_config(dataclasses.replace(reader_config(), pruned_heads={"0": [1]}), ["no", "yes"], QUESTIONS)


def test_a_format_1_reader_saved_with_options_it_ignored_loads_with_the_same_logits(tmp_path):
    """Format 1 accepted options the reader never read; loading resets them, the answers stay."""
    torch.manual_seed(0)
    model = VLFuseModel.from_config(reader_config(), ["false", "true"], QUESTIONS).eval()
    directory = model.save_pretrained(tmp_path / "m")
    meta = json.loads((directory / "config.json").read_text())
    meta["format_version"] = 1
    del meta["files"]  # format 1 recorded no digests
    architecture = meta["config"]
    assert architecture.pop("fuser") == {"type": "map_program"} and architecture.pop("head") == {"type": "existence"}
    # the flat architecture of format 1: no fusion blocks, the reader, and options it ignored
    architecture.update(fusion_depth=0, readout="map_program", diversity_weight=0.5, output_gate=True, dropout=0.0)
    (directory / "config.json").write_text(json.dumps(meta))
    state = load_file(directory / "model.safetensors")
    v1 = {key.replace("fuser.", ""): value for key, value in state.items()}  # format 1: the reader at the top level
    assert "head.bias" in v1 and "reader.find_key.0.weight" in v1 and "word_norm.weight" in v1
    save_file(v1, directory / "model.safetensors")
    loaded = VLFuseModel.from_pretrained(directory)
    assert loaded.config.fuser == MapProgramConfig() and loaded.config.head.type == "existence"
    assert loaded.config.to_dict() == model.config.to_dict()
    tokens = model.processor.tokenize(QUESTIONS)
    pixels = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixels, **tokens).logits, model(pixels, **tokens).logits, atol=0, rtol=0)


def test_reader_model_refuses_what_needs_fusion_heads():
    model = VLFuseModel.from_config(reader_config(), ["false", "true"], QUESTIONS)
    batch = model.processor.tokenize(QUESTIONS[:1])
    with pytest.raises(ValueError, match="this model has no attention heads to mask or draw: its fuser 'map_program'"):
        model(torch.rand(1, 3, 32, 32), batch["input_ids"], batch["attention_mask"], weights_from=[0])
    with pytest.raises(ValueError, match="no attention heads to mask or draw"):
        model(torch.rand(1, 3, 32, 32), batch["input_ids"], batch["attention_mask"], head_mask=torch.ones(1, 16))
    with pytest.raises(ValueError, match="no attention heads to prune"):
        model.prune_heads({0: [1]})


def test_predictor_answers_with_a_reader_model_and_refuses_attention_maps(tmp_path):
    from PIL import Image

    from vlfuse.data import preprocess_image
    from vlfuse.inference import Predictor

    torch.manual_seed(0)
    model = VLFuseModel.from_config(reader_config(), ["false", "true"], QUESTIONS)
    predictor = Predictor(model)
    images = [Image.new("RGB", (32, 32), colour) for colour in ("red", "blue")]
    answers = predictor.predict(images, QUESTIONS[:2])
    pixels = torch.stack([preprocess_image(image, 32) for image in images])
    tokens = model.processor.tokenize(QUESTIONS[:2])
    with torch.no_grad():
        probabilities = model(pixels, tokens["input_ids"], tokens["attention_mask"]).logits.softmax(-1)
    best = probabilities.max(-1)
    assert [a["answer"] for a in answers] == [model.answers[i] for i in best.indices.tolist()]
    assert [a["score"] for a in answers] == pytest.approx(best.values.tolist(), abs=1e-6)
    with pytest.raises(ValueError, match="no attention heads to draw attention maps"):
        predictor.predict(images, QUESTIONS[:2], attention_maps=tmp_path)


def test_evidence_is_the_log_size_of_the_set_and_keeps_a_gradient_when_nearly_empty():
    reader = MapProgramReader(DIM, (3, 3))
    with torch.no_grad():
        for layer in (reader.find_query[0], reader.find_key[0], reader.operation):
            layer.weight.zero_()
            layer.bias.zero_()
        reader.operation.bias[OPERATIONS.index("intersect")] = SHARP
    patches = torch.zeros(1, 9, DIM)
    for score in (0.0, -25.0):
        with torch.no_grad():  # every query and key normalises to (1, -1, 0, ...) * 2: score = gain * 8 / sqrt(8)
            reader.find_query[0].bias.copy_(torch.tensor([1.0, -1.0] + [0.0] * (DIM - 2)))
            reader.find_key[0].bias.copy_(torch.tensor([1.0, -1.0] + [0.0] * (DIM - 2)))
            reader.find_query[1].weight.fill_(1.0)
            reader.find_key[1].weight.fill_(score / (4 * 2 / DIM**0.5) if score else 0.0)
        reader.zero_grad()
        evidence = reader(torch.zeros(1, 4, DIM), torch.ones(1, 4, dtype=torch.bool), reader.project_context(patches))
        # four intersections with the same find on 9 patches: log(9 * sigmoid(score)^4)
        expected = math.log(9) + 4 * torch.nn.functional.logsigmoid(torch.tensor(score, dtype=torch.float64)).item()
        assert evidence.item() == pytest.approx(expected, rel=2e-4)  # LayerNorm eps: scores a hair short
        evidence.sum().backward()
        assert reader.find_key[1].weight.grad.abs().sum() > 0
    assert evidence.item() < -95  # a map of sigmoid(-25)^4 = 1e-43 per patch: below float32's normal range


def scene_cells(scene) -> torch.Tensor:
    """A SHAPES scene -> (9, 7) cell features: one-hot colour, one-hot shape, empty."""
    cells = torch.zeros(9, 7)
    for i, obj in enumerate(cell for row in scene for cell in row):
        if obj is None:
            cells[i, 6] = 1.0
        else:
            cells[i, COLOURS.index(obj.colour)] = cells[i, 3 + SHAPES.index(obj.shape)] = 1.0
    return cells


@pytest.mark.slow  # trains the reader for about 2 minutes on 2 cores (137 s in CI): run with -m slow
def test_reader_answers_new_compositions_of_known_words():
    """Trained on some SHAPES questions over exact cell features, it answers held-out ones.

    The held-out questions combine words that each occur in training, never together in this
    form: in training "above" moves colours but never a shape, and is never applied twice.
    """
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    words = COLOURS + SHAPES
    queries = [f"(is {a} {b})" for a in words for b in words]
    queries += [f"(is {a} ({r} {b}))" for a in words for r in RELATIONS for b in words]
    queries += [f"(is {a} ({r} ({s} {b})))" for a in words for r in RELATIONS for s in RELATIONS for b in COLOURS]
    held_out = [q for q in queries if "above" in q and any(f"({r} {s})" in q for r in RELATIONS for s in SHAPES)]
    held_out += [q for q in queries if "(above (above" in q]
    held_out = sorted(set(held_out))
    train = [q for q in queries if q not in held_out]

    vocab = {w: i for i, w in enumerate(sorted({w for q in queries for w in to_english(parse_query(q)).split()}))}

    def batch(qs: list[str], per_question: int):
        scenes = sample_scenes(len(qs) * per_question, rng)
        rows = [q for q in qs for _ in range(per_question)]
        english = [to_english(parse_query(q)).split() for q in rows]
        ids = torch.zeros(len(rows), max(map(len, english)), dtype=torch.long)
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        for i, sentence in enumerate(english):
            ids[i, : len(sentence)] = torch.tensor([vocab[w] for w in sentence])
            mask[i, : len(sentence)] = True
        cells = torch.stack([scene_cells(s) for s in scenes])
        labels = torch.tensor([evaluate(parse_query(q), s) for q, s in zip(rows, scenes)]).long()
        return ids, mask, cells, labels

    words_in = torch.nn.Embedding(len(vocab), 32)
    cells_in = torch.nn.Linear(7, 32)
    reader, head = MapProgramReader(32, (3, 3)), ExistenceHead()
    parts = torch.nn.ModuleList([words_in, cells_in, reader, head])
    optimiser = torch.optim.Adam(parts.parameters(), lr=3e-3)

    def scores(ids, mask, cells):
        return head(reader(words_in(ids), mask, reader.project_context(cells_in(cells))))

    for _ in range(800):
        ids, mask, cells, labels = batch(list(rng.choice(train, 64)), 1)
        loss = torch.nn.functional.cross_entropy(scores(ids, mask, cells), labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        ids, mask, cells, labels = batch(held_out, 16)
        accuracy = (scores(ids, mask, cells).argmax(-1) == labels).float().mean().item()
    assert len(held_out) == 36 and not set(held_out) & set(train)
    assert accuracy > 0.95, f"held-out accuracy {accuracy:.3f}"


@pytest.mark.parametrize(
    "command, message",
    [(["analyze"], "no attention heads to analyse"), (["prune", "--score", "weight_norm", "--fraction", "0.5"], "no attention heads to prune")],
)
def test_analyze_and_prune_refuse_a_reader_model_in_one_line(tmp_path, capsys, command, message):
    from vlfuse.cli import main as vlfuse_main

    model = VLFuseModel.from_config(reader_config(), ["false", "true"], QUESTIONS)
    model.save_pretrained(tmp_path / "model")
    args = [*command, "--model", str(tmp_path / "model"), "--config", str(REPO / "configs" / "easy_vqa.yaml")]
    args += ["--out", str(tmp_path / "out")]
    assert vlfuse_main(args) == 2
    error = capsys.readouterr().err
    assert error.startswith("vlfuse: error:") and message in error


def test_operations_and_offset_steps_describe_each_token():
    reader = hand_set_reader()
    tokens, _ = tokens_for([FIND_X, MOVE_RIGHT, MOVE_DOWN, KEEP], length=4)
    with torch.no_grad():
        weights, offsets = reader.operations(tokens)
    assert [OPERATIONS[i] for i in weights[0].argmax(-1).tolist()] == ["intersect", "move", "move", "keep"]
    steps = reader.offset_steps()
    assert len(steps) == 25 and steps[12] == (0, 0)
    assert steps[int(offsets[0, 1].argmax())] == (0, 1)  # "right of": the set moves one column right
    assert steps[int(offsets[0, 2].argmax())] == (1, 0)  # "below": one row down

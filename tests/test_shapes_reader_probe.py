"""scripts/shapes_reader_probe.py: the probes of a SHAPES cell reader (finds, keys, shifts, states)."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, SHARED, load_script, tiny_config
from vlfuse.data.shapes import parse_query, to_english
from vlfuse.encoders import ImageEncoderConfig, TextEncoderConfig
from vlfuse.model import VLFuseModel

probe = load_script("shapes_reader_probe")
needs_shapes = pytest.mark.skipif(not (SHARED / "data" / "shapes").exists(), reason="needs ../shared/data/shapes")


def shapes_reader(fuser: str, **options) -> VLFuseModel:
    config = tiny_config(
        image=ImageEncoderConfig(image_size=30, patch_size=10, width=32, depth=1, num_heads=2),
        text=TextEncoderConfig(width=32, depth=0, num_heads=2, max_length=24),
        fuser={"type": fuser, **options}, head={"type": "existence"},
    )
    torch.manual_seed(0)
    words = ["is a red shape right of right of a green shape above below a circle left of a blue square triangle"]
    return VLFuseModel.from_config(config, ["false", "true"], words)


def test_the_sets_a_double_move_passes_through_in_reading_order_and_the_tokens_that_complete_them():
    query = parse_query("(is green (right_of (right_of green)))")
    sets = probe.set_tokens(query)
    assert [expr for _, _, expr in sets] == [
        "green", ("right_of", "green"), ("right_of", ("right_of", "green")), ("and", "green", query[2]),
    ]
    tokens = ["[CLS]"] + to_english(query).split() + ["[SEP]"]
    assert [tokens[index] for _, index, _ in sets] == ["a", "right", "right", "a"]  # "... right of a green shape"
    assert [index for _, index, _ in sets] == [9, 7, 5, 2]


def test_a_question_without_a_relation_passes_through_its_word_and_the_intersection():
    query = parse_query("(is red square)")
    assert probe.query_sets(query) == [(2, "square"), (1, ("and", "red", "square"))]


def test_the_probes_refuse_a_model_without_a_cell_reader():
    with pytest.raises(SystemExit, match="cell_steps or cell_moves.*'fusion_stack'"):
        probe.reader_of(VLFuseModel.from_config(tiny_config(), ["no", "yes"], ["is it red"]))


def test_a_reader_that_holds_exactly_each_denoted_set_scores_1_on_it_and_0_elsewhere(monkeypatch):
    """The states' bookkeeping: with the true sets put in the reader's place, every part reads 1 / 0."""
    from vlfuse.data import shapes as S

    model = shapes_reader("cell_moves")
    queries = ["(is green (right_of (right_of green)))", "(is circle (below square))", "(is red red)"]
    split = S.generate_training_set([parse_query(q) for q in queries], seed=0, images_per_question=4)

    def true_states(text, mask, patches, image_index=None):
        states = torch.full((len(patches), mask.shape[1], 9), 0.5)
        for row, text_query in enumerate(split.queries):
            for _, token, expr in probe.set_tokens(parse_query(text_query)):
                states[row, token] = torch.from_numpy(probe._denoted(expr, split.scenes[row]).reshape(-1)).float()
        return states

    monkeypatch.setattr(model.fuser, "states", true_states)
    sums = probe.set_states(model, split, split.scenes)
    assert ("is C1 R1 R1 C1", "R1 R1 C1") in sums and ("is C1 C1", "C1 C1") in sums and len(sums) == 4 + 3 + 2
    for (n, inside, n_inside, outside) in sums.values():
        assert n == 4 and outside == 0.0 and inside == n_inside


def test_the_shifts_of_a_relation_are_those_of_its_words_in_a_question():
    """Each word of "right of" gets the shift the reader applies to it in a question; with the shift
    reading the previous word, "of" after "right" and after "left" can differ."""
    model = shapes_reader("cell_moves")
    shifts = probe.relation_shifts(model)
    assert [word for word, _, _ in shifts["right_of"]] == ["right", "of"] and [w for w, _, _ in shifts["above"]] == ["above"]
    for words in shifts.values():
        for _, moves, stay in words:
            assert sum(weight for _, weight in moves) <= 1 + 1e-6 and moves[0][0] == (0, 0) and moves[0][1] == stay
    reading_previous = shapes_reader("cell_moves", shift_reads="word_and_previous")
    with torch.no_grad():
        reading_previous.fuser.shift_previous.normal_(std=3.0)
    shifts = probe.relation_shifts(reading_previous)
    assert shifts["right_of"][1][1] != shifts["left_of"][1][1]  # "of" moves by the word before it


def test_a_word_is_read_as_the_model_reads_it_in_a_question():
    """The probes read single words through the model's own question encoding (its text_proj
    included): a word's features alone equal its features inside a question (the reader's words have
    no context)."""
    model = shapes_reader("cell_moves")
    question = "is a red shape right of a green shape"
    tokens = model.processor.tokenize([question])
    with torch.no_grad():
        in_question = model.encode_questions(tokens["input_ids"], tokens["attention_mask"])[0]  # (Lt, width)
    alone = probe.word_features(model, ["red", "right", "of"])
    words = ["[CLS]"] + question.split()
    for row, word in enumerate(["red", "right", "of"]):
        torch.testing.assert_close(alone[row], in_question[words.index(word)])


def test_the_states_end_in_the_set_whose_size_is_the_models_answer():
    """question_states reads each question as the model does: the soft size of its final set, through
    the existence head, gives the model's own logits."""
    from vlfuse.data import shapes as S

    model = shapes_reader("cell_moves").eval()
    queries = ["(is green (right_of (right_of green)))", "(is circle (below square))", "(is red red)"]
    split = S.generate_training_set([parse_query(q) for q in queries], seed=0, images_per_question=2)
    [(start, states, mask)] = probe.question_states(model, split.images, split.queries)
    assert start == 0 and states.shape == (6, mask.shape[1], 9)
    pixels = torch.stack([probe.preprocess_image(image, 30) for image in split.images])
    tokens = model.processor.tokenize([to_english(parse_query(q)) for q in split.queries])
    with torch.no_grad():
        logits = model(pixels, tokens["input_ids"], tokens["attention_mask"]).logits  # (6, 2)
    evidence = states[:, 0].sum(-1).log()  # the set once every word is read: row 0
    torch.testing.assert_close(evidence + model.head.bias, logits[:, 1], rtol=1e-4, atol=1e-4)


@needs_shapes
def test_the_command_probes_a_saved_cell_moves_model(tmp_path, one_thread):
    shapes_reader("cell_moves").save_pretrained(tmp_path / "model")
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "shapes_reader_probe.py"), "--model", str(tmp_path / "model"),
         "--scenes", "120", "--questions", "200", "--threads", "1"],
        capture_output=True, text=True, check=True, env={**os.environ, "VLFUSE_SHAPES_DIR": str(SHARED / "data" / "shapes")},
    ).stdout
    for section in ("finds (", "keys:", "shifts:", "states (val"):
        assert section in out
    right = next(line for line in out.splitlines() if line.startswith("  right_of  right "))
    moves, stay = right.split(None, 2)[2].split(" | no move ")
    assert moves.startswith("(0, 0) ") and float(stay) > 0.8  # untrained: the stay bias holds most of the kept set
    assert float(moves.split()[2]) == float(stay)  # the most weighted move is no move
    assert sum(line.startswith("  head ") for line in out.splitlines()) == 16  # the reader's 16 find heads
    tokens = next(line for line in out.splitlines() if line.startswith("  patch tokens"))
    assert 0 < float(tokens.split("shape ")[1].split("%")[0]) <= 100 and "colour " in tokens


def test_the_key_separation_is_large_for_keys_that_carry_the_shape_and_small_for_keys_that_do_not(monkeypatch):
    """key_separation compares a circle's and a square's keys of the same colour, per head: keys
    that hold the cell's shape (plus noise) are far apart, keys that hold only its colour are not."""
    from vlfuse.data import shapes as S

    model = shapes_reader("cell_moves")
    split = S.generate_training_set([parse_query("(is circle (below square))")], seed=0, images_per_question=200)
    colours, shapes = probe.cell_labels(split.scenes)
    noise = torch.Generator().manual_seed(0)
    heads, dh = model.fuser.heads, 4

    def keys_of(labels):
        code = torch.nn.functional.one_hot(labels, 4).float().repeat(1, dh // 4 or 1)[:, :dh]  # (N * 9, dh)
        keys = code[:, None, :].expand(-1, heads, -1) + 0.1 * torch.randn(len(labels), heads, dh, generator=noise)
        return keys.reshape(len(split.scenes), 9, heads, dh)

    patches = torch.zeros(len(split.scenes), 9, 1)
    monkeypatch.setattr(model.fuser, "find_keys", lambda _: keys_of(shapes))
    apart = probe.key_separation(model, patches, split.scenes)
    monkeypatch.setattr(model.fuser, "find_keys", lambda _: keys_of(colours))
    together = probe.key_separation(model, patches, split.scenes)
    assert len(apart) == len(together) == heads
    assert min(apart) > 100 and max(together) < 1  # one unit apart in noise of 0.1: d^2 = 2 / 0.01 = 200


def test_the_query_cosine_is_1_for_a_word_with_itself_and_symmetric_between_two_words():
    model = shapes_reader("cell_moves")
    same = probe.query_cosines(model, "circle", "circle")
    assert len(same) == model.fuser.heads and all(abs(c - 1) < 1e-5 for c in same)
    circle_square, square_circle = probe.query_cosines(model, "circle", "square"), probe.query_cosines(model, "square", "circle")
    assert circle_square == pytest.approx(square_circle)
    assert all(-1 <= c <= 1 for c in circle_square) and min(circle_square) < 0.9  # untrained: random queries per head

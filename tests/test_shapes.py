import logging
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from vlfuse.data import shapes as S
from vlfuse.data.shapes import ShapeObject
from vlfuse.datamodules.shapes import SHAPES_DIR_ENV, ShapesDataModule, find_shapes_dir

SHAPES_DIR = Path(__file__).parents[1] / ".." / "shared" / "data" / "shapes"
needs_released = pytest.mark.skipif(
    not (SHAPES_DIR / "val.query").is_file(), reason=f"released SHAPES files not found at {SHAPES_DIR}"
)


def scene_of(*rows: str) -> S.Scene:
    """A scene from rows like ``"rc . gs"``: colour letter + shape letter per cell, ``.`` empty."""
    colours = {c[0]: c for c in S.COLOURS}
    shapes = {s[0]: s for s in S.SHAPES}
    return tuple(
        tuple(None if cell == "." else ShapeObject(shapes[cell[1]], colours[cell[0]]) for cell in row.split())
        for row in rows
    )


def write_released(directory: Path, split: str, queries, answers, images_rgb=None) -> None:
    """Write a split in the released format (images stored BGR, files ending with a newline)."""
    (directory / f"{split}.query").write_text("".join(q + "\n" for q in queries))
    (directory / f"{split}.output").write_text("".join(a + "\n" for a in answers))
    if images_rgb is not None:
        np.save(directory / f"{split}.input.npy", np.ascontiguousarray(images_rgb[..., ::-1]))


def fixture_split(directory: Path, split: str, queries, seed=0):
    """Render one scene per query, answer it with the evaluator, write it; return (images, answers)."""
    rng = np.random.default_rng(seed)
    scenes = S.sample_scenes(len(queries), rng)
    images = S.render_scenes(scenes, rng)
    answers = [S.answer_word(S.evaluate(q, scene)) for q, scene in zip(queries, scenes)]
    write_released(directory, split, queries, answers, images)
    return images, answers


# ------------------------------------------------------------------------------------ queries


def test_parse_and_format_round_trip():
    query = S.parse_query("(is circle (left_of  (right_of square)))")
    assert query == ("is", "circle", ("left_of", ("right_of", "square")))
    assert S.format_query(query) == "(is circle (left_of (right_of square)))"
    assert S.query_words(query) == ["is", "circle", "left_of", "right_of", "square"]


@pytest.mark.parametrize(
    "text, reason",
    [
        ("(is green (right_of purple))", "unknown or misplaced word 'purple'"),
        ("(is green (right_of blue)", "missing ')'"),
        ("(is green blue))", "unexpected ')' after the query"),
        ("(is green)", "a query must be (is A B)"),
        ("(has green blue)", "a query must be (is A B)"),
        ("(is (beside green) blue)", "expected a relation"),
        ("(is green (above blue red))", "above takes one argument, got 2"),
        ("(is is blue)", "unknown or misplaced word 'is'"),
        ("", "unexpected end of query"),
        ("green", "a query must be (is A B)"),
    ],
)
def test_bad_queries_raise_naming_file_and_line(text, reason):
    with pytest.raises(ValueError, match=r"^data/x\.query:7: bad SHAPES query .*" + re.escape(reason)):
        S.parse_query(text, source="data/x.query", line=7)


@pytest.mark.parametrize(
    "query, english",
    [
        # the four examples of the dataset's README
        ("(is green (right_of blue))", "is a green shape right of a blue shape"),
        ("(is red square)", "is a red shape a square"),
        ("(is circle red)", "is a circle red"),
        ("(is circle (left_of (right_of square)))", "is a circle left of right of a square"),
        # a colour that is not the third word is "a COLOUR shape"
        ("(is circle (above red))", "is a circle above a red shape"),
        ("(is red red)", "is a red shape red"),
        ("(is blue (below (left_of triangle)))", "is a blue shape below left of a triangle"),
        ("(is square (left_of (right_of green)))", "is a square left of right of a green shape"),
        ("(is triangle blue)", "is a triangle blue"),
    ],
)
def test_english_follows_the_dataset_rule(query, english):
    assert S.to_english(query) == english


def test_query_depth_counts_relation_words():
    assert S.query_depth("(is red square)") == 0
    assert S.query_depth("(is green (right_of blue))") == 1
    assert S.query_depth(S.parse_query("(is circle (left_of (right_of square)))")) == 2


# ---------------------------------------------------------------------------------- semantics


def test_evaluator_on_hand_made_scenes():
    scene = scene_of(
        "bc gs .",
        ". rt .",
        "rs . bt",
    )
    assert S.denotation("red", scene).tolist() == [[0, 0, 0], [0, 1, 0], [1, 0, 0]]
    assert S.evaluate("(is green (right_of blue))", scene)  # green square right of the blue circle
    assert not S.evaluate("(is blue (right_of green))", scene)
    assert S.evaluate("(is green (above red))", scene)  # green square above the red triangle
    assert S.evaluate("(is red (below green))", scene)
    assert not S.evaluate("(is red (left_of blue))", scene)  # the red triangle is above-left, not left
    assert S.evaluate("(is red square)", scene) and not S.evaluate("(is blue square)", scene)
    assert S.evaluate("(is triangle (above blue))", scene) is False  # nothing above the blue triangle is a triangle
    # shifting right then left drops objects of the right column: the blue triangle (2, 2) is lost
    assert S.denotation(("left_of", ("right_of", "blue")), scene).tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert not S.evaluate("(is triangle (left_of (right_of blue)))", scene)


def test_relations_drop_cells_shifted_off_the_grid():
    scene = scene_of("rc . .", ". . .", ". . gs")
    assert not S.denotation(("left_of", "red"), scene).any()
    assert not S.denotation(("above", "red"), scene).any()
    assert not S.denotation(("right_of", "green"), scene).any()
    assert not S.denotation(("below", "green"), scene).any()
    assert S.denotation(("below", ("right_of", "red")), scene).tolist() == [[0, 0, 0], [0, 1, 0], [0, 0, 0]]


@needs_released
@pytest.mark.parametrize("split", ["val", "train.small", "train.tiny"])
def test_evaluator_on_read_scenes_agrees_with_released_answers(split):
    data = S.load_released_split(SHAPES_DIR, split)
    agreement = S.evaluator_agreement(data)
    assert agreement.total == len(data) > 0
    assert agreement.rate == 1.0, f"{split}: disagreements at rows {agreement.mismatches[:10]}"


@needs_released
def test_released_val_is_rgb_after_loading_and_disjoint_from_training_questions():
    val = S.load_released_split(SHAPES_DIR, "val")
    assert val.images.shape == (1024, 30, 30, 3) and val.images.dtype == np.uint8
    assert len(S.distinct_queries(val.queries)) == 16
    train = S.read_questions(SHAPES_DIR, "train.large")
    assert len(train) == 13568 and len(S.distinct_queries(train.queries)) == 212
    assert not set(val.queries) & set(train.queries)
    # without the BGR -> RGB flip the evaluator disagrees with the released answers on many rows
    flipped = S.ShapesSplit(np.ascontiguousarray(val.images[..., ::-1]), val.queries, val.answers)
    assert S.evaluator_agreement(flipped).rate < 0.9


# ---------------------------------------------------------------------------------- generator


def test_sampled_scenes_follow_the_spec():
    scenes = S.sample_scenes(2000, np.random.default_rng(0))
    cells = [obj for scene in scenes for row in scene for obj in row]
    assert abs(sum(obj is None for obj in cells) / len(cells) - 0.2) < 0.015
    objects = [obj for obj in cells if obj is not None]
    for values, attribute in ((S.SHAPES, "shape"), (S.COLOURS, "colour")):
        counts = Counter(getattr(obj, attribute) for obj in objects)
        assert set(counts) == set(values)
        assert max(abs(c / len(objects) - 1 / 3) for c in counts.values()) < 0.02


@pytest.mark.parametrize("radius", [2.25, 2.5, 3.0, 3.75, 4.125])
def test_shape_coverage_has_the_analytic_area(radius):
    areas = {"circle": math.pi * radius**2, "square": 4 * radius**2, "triangle": 2 * radius**2}
    for shape, area in areas.items():
        coverage = S._coverage(shape, np.array([radius]))[0]
        assert coverage.min() >= 0 and coverage.max() <= 1
        assert coverage.sum() == pytest.approx(area, rel=0.02)
        np.testing.assert_allclose(coverage, coverage[:, ::-1], atol=1e-9)  # centred left-right
    triangle_rows = S._coverage("triangle", np.array([radius]))[0].sum(axis=1)
    nonempty = triangle_rows[triangle_rows > 0]
    assert np.all(np.diff(nonempty[:-1]) > 0)  # widens downwards: points up (last row partly covered)


def test_rendered_objects_have_jittered_pure_colours_on_black():
    rng = np.random.default_rng(1)
    scenes = S.sample_scenes(200, rng)
    images = S.render_scenes(scenes, rng)
    assert images.shape == (200, 30, 30, 3) and images.dtype == np.uint8
    for image, scene in zip(images[:50], scenes[:50]):
        for row in range(3):
            for col in range(3):
                cell = image[row * 10 : row * 10 + 10, col * 10 : col * 10 + 10].reshape(-1, 3)
                obj = scene[row][col]
                if obj is None:
                    assert not cell.any()
                    continue
                peak = cell[cell.max(axis=1).argmax()]  # a fully covered pixel: the object's colour
                main = S.COLOURS.index(obj.colour)
                assert peak[main] >= 0.8 * 255 - 1
                assert all(peak[c] <= 0.2 * 255 + 1 for c in range(3) if c != main)


def test_generated_training_set_follows_the_protocol():
    queries = ["(is green (right_of blue))", "(is circle (left_of (right_of square)))", "(is red red)"]
    data = S.generate_training_set(queries, seed=3)
    assert data.images.shape == (3 * 64, 30, 30, 3)
    assert data.queries == [q for q in queries for _ in range(64)]
    for query, scene, answer in zip(data.queries, data.scenes, data.answers):
        first = S.parse_query(query)[1]
        assert S.denotation(first, scene).any(), "the first argument must match an object"
        assert answer == S.answer_word(S.evaluate(query, scene))
    # shapes and colours are recognisable: the scene reader recovers every generated scene
    assert [S.read_scene(image) for image in data.images] == data.scenes
    assert data.answers[128:] == ["true"] * 64  # a red object exists in every scene


def test_generation_is_deterministic_per_seed_and_extra_data_extends_it(caplog):
    queries = ["(is blue (above square))", "(is triangle green)"]
    first = S.generate_training_set(queries, seed=5)
    again = S.generate_training_set(queries, seed=5)
    other = S.generate_training_set(queries, seed=6)
    np.testing.assert_array_equal(first.images, again.images)
    assert first.answers == again.answers
    assert not np.array_equal(first.images, other.images)
    # a question's images do not depend on the other questions
    alone = S.generate_training_set(queries[1:], seed=5)
    np.testing.assert_array_equal(alone.images, first.images[64:])
    # the extra-data variant: more images per question, the official 64 first, and it says so
    with caplog.at_level(logging.INFO, logger="vlfuse.data.shapes"):
        extra = S.generate_training_set(queries, seed=5, images_per_question=80)
    assert "extra-data variant" in caplog.text
    assert len(extra) == 160
    np.testing.assert_array_equal(extra.images[:64], first.images[:64])
    np.testing.assert_array_equal(extra.images[80:144], first.images[64:])
    with pytest.raises(ValueError, match="images_per_question"):
        S.generate_training_set(queries, images_per_question=0)


@needs_released
def test_generated_answer_balance_matches_the_official_training_set():
    official = S.read_questions(SHAPES_DIR, "train.large")
    generated = S.generate_training_set(S.distinct_queries(official.queries), seed=0)
    assert len(generated) == 13568
    official_true = official.answers.count("true") / len(official)  # 4,985 of 13,568
    assert generated.answers.count("true") / len(generated) == pytest.approx(official_true, abs=0.015)


# ---------------------------------------------------------------------------- released format


def test_loader_flips_bgr_to_rgb_and_keeps_rows_aligned(tmp_path):
    queries = ["(is red square)", "(is blue (above green))", "(is circle red)"]
    images, answers = fixture_split(tmp_path, "val", queries)
    data = S.load_released_split(tmp_path, "val")
    np.testing.assert_array_equal(data.images, images)
    assert data.queries == queries and data.answers == answers and data.skipped == 0
    assert S.evaluator_agreement(data).rate == 1.0


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    fixture_split(tmp_path, "val", ["(is red square)"] * 3)
    (tmp_path / "val.output").write_text("true\nfalse\n")
    with pytest.raises(ValueError, match=r"val\.query has 3 lines but .*val\.output has 2"):
        S.load_released_split(tmp_path, "val")
    with pytest.raises(ValueError, match=r"val\.query has 3 lines but .*val\.output has 2"):
        S.load_released_split(tmp_path, "val", skip_bad_rows=True)  # never skipped: rows cannot be aligned


def test_image_count_mismatch_names_the_files_and_counts(tmp_path):
    images, _ = fixture_split(tmp_path, "val", ["(is red square)"] * 3)
    np.save(tmp_path / "val.input.npy", images[:2])
    with pytest.raises(ValueError, match=r"val\.input\.npy has 2 images but .*val\.query has 3 lines"):
        S.load_released_split(tmp_path, "val")


def test_bad_query_and_bad_answer_name_file_and_line(tmp_path):
    fixture_split(tmp_path, "val", ["(is red square)"] * 3)
    (tmp_path / "val.query").write_text("(is red square)\n(is red (left_of purple))\n(is blue red)\n")
    with pytest.raises(ValueError, match=r"val\.query:2: bad SHAPES query .*'purple'"):
        S.load_released_split(tmp_path, "val")
    fixture_split(tmp_path, "val", ["(is red square)"] * 3)
    (tmp_path / "val.output").write_text("true\nyes\nfalse\n")
    with pytest.raises(ValueError, match=r"val\.output:2: bad answer 'yes'"):
        S.load_released_split(tmp_path, "val")


def test_skip_bad_rows_skips_counts_logs_and_keeps_alignment(tmp_path, caplog):
    queries = ["(is red square)", "(is red (left_of red))", "(is blue red)", "(is green green)"]
    images, answers = fixture_split(tmp_path, "val", queries)
    queries[1] = "(is red (left_of purple))"
    write_released(tmp_path, "val", queries, answers[:3] + ["maybe"])
    with caplog.at_level(logging.WARNING, logger="vlfuse.data.shapes"):
        data = S.load_released_split(tmp_path, "val", skip_bad_rows=True)
    assert data.skipped == 2 and "skipped 2 bad rows of 4" in caplog.text
    assert data.queries == [queries[0], queries[2]] and data.answers == [answers[0], answers[2]]
    np.testing.assert_array_equal(data.images, images[[0, 2]])


def test_windows_line_ends_and_missing_files(tmp_path):
    fixture_split(tmp_path, "val", ["(is red square)", "(is blue red)"])
    (tmp_path / "val.output").write_text("true\r\nfalse\r\n")
    assert S.load_released_split(tmp_path, "val").answers == ["true", "false"]
    (tmp_path / "val.output").unlink()
    with pytest.raises(FileNotFoundError, match=r"val\.output"):
        S.load_released_split(tmp_path, "val")
    with pytest.raises(FileNotFoundError, match=r"train\.tiny\.input\.npy"):
        S.load_released_split(tmp_path, "train.tiny")


def test_the_test_split_is_never_read(tmp_path):
    for read in (S.load_released_split, S.read_questions):
        with pytest.raises(ValueError, match="held out"):
            read(tmp_path, "test")


# -------------------------------------------------------------------------------- data module


@pytest.fixture
def shapes_dir(tmp_path):
    """A tiny SHAPES folder: 2 training questions (3 lines each) and 4 val images."""
    train = ["(is green (right_of blue))"] * 3 + ["(is circle red)"] * 3
    write_released(tmp_path, "train.large", train, ["false"] * 6)
    fixture_split(tmp_path, "val", ["(is red square)", "(is blue (above green))", "(is circle red)", "(is red red)"])
    return tmp_path


def test_datamodule_loads_generated_train_and_released_val(shapes_dir):
    dm = ShapesDataModule(data_dir=str(shapes_dir), images_per_question=4, image_size=30, batch_size=3)
    assert dm.protocol == "extra data (4 images per training question)"
    train = dm.records("train")
    assert len(train) == 8 and all(len(r.questions) == 1 for r in train)
    assert train[0].questions == ["is a green shape right of a blue shape"]
    assert train[4].questions == ["is a circle red"]
    assert dm.queries("train") == ["(is green (right_of blue))"] * 4 + ["(is circle red)"] * 4
    for record, query in zip(train, dm.queries("train")):
        assert record.answers == [S.answer_word(S.evaluate(query, S.read_scene(record.image)))]
    val = dm.records("val")
    assert [r.questions[0] for r in val] == [
        "is a red shape a square",
        "is a blue shape above a green shape",
        "is a circle red",
        "is a red shape red",
    ]
    assert dm.answers == ["false", "true"]
    batch = next(iter(dm.val_dataloader()))
    assert batch["pixel_values"].shape == (3, 3, 30, 30) and batch["labels"].shape == (3,)
    with pytest.raises(ValueError, match="held out"):
        dm.records("test")


def test_datamodule_protocol_limit_and_queries_alignment(shapes_dir):
    assert ShapesDataModule(data_dir=str(shapes_dir)).protocol == "official"
    dm = ShapesDataModule(data_dir=str(shapes_dir), images_per_question=100, limit_images=2)
    assert dm.protocol == "extra data (100 images per training question)"
    assert len(dm.records("val")) == 2
    assert dm.queries("val") == ["(is red square)", "(is blue (above green))"]
    with pytest.raises(ValueError, match="images_per_question"):
        ShapesDataModule(images_per_question=0)


def test_data_folder_lookup(tmp_path, monkeypatch, shapes_dir):
    monkeypatch.setenv(SHAPES_DIR_ENV, str(shapes_dir))
    assert find_shapes_dir() == shapes_dir
    assert find_shapes_dir(shapes_dir) == shapes_dir
    monkeypatch.setenv(SHAPES_DIR_ENV, str(tmp_path / "nowhere"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"looked at: .*nowhere, .*shared/data/shapes.*VLFUSE_SHAPES_DIR"):
        find_shapes_dir()
    with pytest.raises(FileNotFoundError, match="missing"):
        ShapesDataModule(data_dir=str(tmp_path / "missing")).records("val")


@pytest.mark.parametrize(
    "query, pattern",
    [
        ("(is green (right_of (right_of green)))", "is C1 R1 R1 C1"),
        ("(is red (right_of (right_of blue)))", "is C1 R1 R1 C2"),
        ("(is square (left_of (right_of green)))", "is S1 R1 R2 C1"),
        ("(is triangle (above (right_of square)))", "is S1 R1 R2 S2"),
        ("(is red red)", "is C1 C1"),
        ("(is green triangle)", "is C1 S1"),
    ],
)
def test_question_pattern_is_the_same_for_the_query_and_its_english(query, pattern):
    assert S.question_pattern(query) == pattern
    assert S.question_pattern(S.to_english(S.parse_query(query))) == pattern

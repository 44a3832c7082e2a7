"""The SHAPES scene reader, the renderer against the released images, the released caption data and
``scripts/caption_errors.py --released`` (issue 39)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import load_script
from test_caption_model import tiny_caption_model
from test_shapes import SHAPES_DIR, needs_released, scene_of
from vlfuse.captioning.grammar import Sentence, describe, parse_leniently
from vlfuse.data import shapes as S
from vlfuse.datamodules.captions import ShapesCaptionsDataModule, released_captions


def rendered(count: int, seed: int) -> tuple[list[S.Scene], np.ndarray]:
    rng = np.random.default_rng(seed)
    scenes = S.sample_scenes(count, rng)
    return scenes, S.render_scenes(scenes, rng)


# ------------------------------------------------------------------------------------- reader


def test_rendered_scenes_read_back_exactly_and_unambiguously():
    scenes, images = rendered(600, seed=11)
    readings = S.read_scenes(images)
    assert [r.scene for r in readings] == scenes
    assert all(r.unambiguous for r in readings)
    assert min(r.margin for r in readings) > 0.7  # colour jitter bounds it: 1 - 0.2 / 0.8 = 0.75
    assert S.read_scene(images[0]) == scenes[0]


def test_an_unclear_cell_is_read_as_ambiguous():
    scene = scene_of("rc . .", ". gs .", ". . bt")
    image = S.render_scenes([scene], np.random.default_rng(0))[0]
    clear = S.read_scenes(image[None])[0]
    assert clear.scene == scene and clear.unambiguous
    assert clear.margins[0, 1] == 1.0  # an empty cell far below the threshold
    # a yellow-ish object: red and green nearly equal
    yellow = image.copy()
    yellow[:10, :10, 1] = (yellow[:10, :10, 0] * 0.95).astype(np.uint8)
    assert S.read_scenes(yellow[None])[0].margins[0, 0] < 0.1
    assert not S.read_scenes(yellow[None])[0].unambiguous
    # half a circle and half a square, drawn over each other
    blend = image.copy()
    circle, square = (S._coverage(shape, np.array([3.5]))[0] for shape in ("circle", "square"))
    blend[10:20, 10:20] = 0
    blend[10:20, 10:20, 1] = np.round((circle + square) / 2 * 255).astype(np.uint8)
    reading = S.read_scenes(blend[None])[0]
    assert reading.margins[1, 1] < S.UNAMBIGUOUS_MARGIN and not reading.unambiguous
    # a faint object, near the emptiness threshold
    faint = image.copy()
    faint[20:30, 20:30] = (faint[20:30, 20:30] * 0.32).astype(np.uint8)
    assert S.read_scenes(faint[None])[0].margins[2, 2] < 0.2 and not S.read_scenes(faint[None])[0].unambiguous


def test_reader_refuses_images_of_another_size():
    with pytest.raises(ValueError, match=r"read_scenes expects RGB images \(N, 30, 30, 3\), got shape \(2, 32, 32, 3\)"):
        S.read_scenes(np.zeros((2, 32, 32, 3), np.uint8))


@needs_released
def test_released_images_read_back_to_their_answers():
    data = S.load_released_split(SHAPES_DIR, "train.tiny")
    readings = S.read_scenes(data.images[:12])
    assert all(r.unambiguous for r in readings)
    for reading, query, answer in zip(readings, data.queries[:12], data.answers[:12]):
        assert S.answer_word(S.evaluate(query, reading.scene)) == answer
    agreement = S.evaluator_agreement(data)
    assert agreement.rate == 1.0 and agreement.ambiguous == []


# ------------------------------------------------------------------------------------ renderer


@pytest.mark.parametrize("radius", [2.25, 2.5, 3.375, 3.75, 4.125])
def test_circles_are_flattened_bezier_curves_as_cairo_draws_them(radius):
    # two half-circle Beziers bulge out by up to 1.85% of the radius between their ends; the
    # polygon that fills them cuts in by at most the tolerance of 0.1 px
    coverage = S._coverage("circle", np.array([radius]))[0]
    assert math.pi * (radius - S.ARC_TOLERANCE) ** 2 < coverage.sum() < math.pi * (radius * 1.0186) ** 2
    np.testing.assert_allclose(coverage, coverage[::-1], atol=1e-9)  # the lower half mirrors the upper
    np.testing.assert_allclose(coverage, coverage[:, ::-1], atol=1e-9)


@needs_released
def test_the_renderer_draws_the_released_objects_to_within_rounding():
    """Each released object is the renderer's drawing of its shape at some radius and brightness."""
    data = S.load_released_split(SHAPES_DIR, "train.tiny")
    radii = np.arange(2.2, 4.2, 0.0025)
    for shape in S.SHAPES:
        templates = S._coverage(shape, radii).reshape(len(radii), -1)
        masks = []
        for image, reading in zip(data.images, S.read_scenes(data.images)):
            for row in range(3):
                for col in range(3):
                    obj = reading.scene[row][col]
                    if obj is not None and obj.shape == shape:
                        cell = image[row * 10 : row * 10 + 10, col * 10 : col * 10 + 10, S.COLOURS.index(obj.colour)]
                        masks.append(cell.ravel() / 255.0)
        masks = np.array(masks)
        projection = masks @ templates.T
        residual = (masks**2).sum(axis=1)[:, None] - projection**2 / (templates**2).sum(axis=1)
        best = residual.min(axis=1)  # squared error of the best radius and brightness, summed over 100 pixels
        assert len(masks) > 100
        # 1e-3 is a pixel off by 0.003 on average; the drawing before issue 39 (an exact disc,
        # 8 sample rows) left circles 0.013
        assert np.median(best) < 1e-3 and best.max() < 0.01, shape


# ------------------------------------------------------------------------------ caption data


@needs_released
def test_released_captions_describe_each_distinct_image_from_its_read_scene():
    released = released_captions(SHAPES_DIR, "train.tiny")
    assert (released.rows, released.distinct, released.ambiguous) == (64, 64, 0)
    assert len(released.records) == 64
    for record in released.records[:10]:
        assert record.captions == [describe(S.read_scene(record.image))]
        assert record.scene == S.read_scene(record.image)
    assert released.records[3].image_id == "shapes/train.tiny/3"


@needs_released
def test_released_training_images_join_the_training_split_once_each_repeated():
    data = ShapesCaptionsDataModule(
        num_train_scenes=20, num_val_scenes=4, num_test_scenes=4, image_size=30,
        released_train_splits=["train.tiny", "train.small"], released_dir=str(SHAPES_DIR), released_repeats=2,
    )
    train = data.load_records("train")
    assert len(train) == 20 + 2 * 640  # train.tiny is the first 64 images of train.small
    released = train[20:660]
    assert len({r.image.tobytes() for r in released}) == 640
    assert [r.image_id for r in train[660:]] == [r.image_id for r in released]
    assert len(data.load_records("val")) == 4 and len(data.load_records("test")) == 4  # held-apart splits unchanged


def test_the_released_val_split_is_never_trained_on():
    with pytest.raises(ValueError, match=r"released_train_splits: 'val' is not a released training split"):
        ShapesCaptionsDataModule(released_train_splits=["val"])
    with pytest.raises(ValueError, match="released_repeats must be at least 1, got 0"):
        ShapesCaptionsDataModule(released_train_splits=["train.tiny"], released_repeats=0)


# --------------------------------------------------------------------------- caption_errors


def test_align_subjects_pairs_each_object_with_what_its_sentence_said():
    align = load_script("caption_errors").align_subjects
    scene = scene_of("rs bc .", ". gt .", ". . rs")  # objects: red square, blue circle, green triangle, red square
    right = parse_leniently(describe(scene))
    assert align(right, scene) == [(("red", "square"),) * 2, (("blue", "circle"),) * 2,
                                   (("green", "triangle"),) * 2, (("red", "square"),) * 2]
    # the circle called a square, the triangle left out, an extra sentence at the end, one unparsed
    said = [right[0], Sentence(("blue", "square"), "above", ("green", "triangle")), None, right[3],
            Sentence(("red", "circle"))]
    assert align(said, scene) == [(("red", "square"), ("red", "square")), (("blue", "circle"), ("blue", "square")),
                                  (("green", "triangle"), None), (("red", "square"), ("red", "square"))]
    assert align([], scene) == [(thing, None) for thing, _ in align(right, scene)]


@needs_released
def test_caption_errors_captions_released_images_and_prints_the_confusion(tmp_path, capsys, monkeypatch):
    model_dir = tiny_caption_model(seed=3).save_pretrained(tmp_path / "model")
    script = load_script("caption_errors")
    monkeypatch.setattr("sys.argv", ["caption_errors.py", "--model", str(model_dir), "--released", "train.tiny",
                                     "--shapes-dir", str(SHAPES_DIR), "--scenes", "6", "--examples", "1"])
    script.main()
    out = capsys.readouterr().out
    assert "released train.tiny: 64 rows, 64 distinct images, 0 left out as ambiguous readings; captioning 6" in out
    assert "6 released train.tiny images: fact precision" in out
    objects = sum(sum(cell is not None for row in r.scene for cell in row) for r in S.read_scenes(
        S.load_released_split(SHAPES_DIR, "train.tiny").images[:6]))
    for name in ("shape", "colour"):
        table = [line for line in out.splitlines() if line.startswith("| ") and line.split("|")[1].strip() in
                 (S.SHAPES if name == "shape" else S.COLOURS)]
        assert len(table) == 3
        assert sum(int(n) for line in table for n in line.split("|")[2:6]) == objects  # every object counted once
    monkeypatch.setattr("sys.argv", ["caption_errors.py", "--model", str(model_dir), "--released", "val",
                                     "--shapes-dir", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match=r"error: --released val: SHAPES data folder not found; looked at: .*nowhere"):
        script.main()

"""Bounded image decoding (too many pixels refused before decoding, JPEGs decoded at a reduced
scale) and imagefolder paths that stay inside their split's folder."""

import json
import shutil
import warnings
from pathlib import Path

import easy_vqa
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageFile, ImageOps

from vlfuse.cli import main as vlfuse_main
from vlfuse.data import GroupedVQADataset, ImageLoadError, ImageQuestions, load_image, preprocess_image
from vlfuse.data import transforms
from vlfuse.data.answers import AnswerVocab
from vlfuse.data.imagefolder import BadRowError, load_imagefolder_split, records_from_rows
from vlfuse.datamodules import ImageFolderDataModule
from vlfuse.model import VLFuseModel

from conftest import REPO, tiny_config

LIMIT = "over the limit of 40 MP (vlfuse.data.transforms.MAX_IMAGE_PIXELS)"


def old_preprocess(path: Path, size: int) -> torch.Tensor:
    """preprocess_image as it was before decoding was bounded: the whole file decoded, then resized."""
    with Image.open(path) as img:
        img.load()
        img = transforms.to_rgb(ImageOps.exif_transpose(img) or img)
    pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255.0)  # (3, H, W)
    return F.interpolate(pixels[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


@pytest.fixture
def no_decoding(monkeypatch):
    """Any pixel decoding of a file fails the test."""

    def load(self):
        raise AssertionError(f"decoded {self.size}")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


@pytest.fixture(scope="module")
def huge_png(tmp_path_factory) -> Path:
    """12000 x 12000 one-bit pixels, 18 KB on disk: 3.2 GB once decoded and converted."""
    path = tmp_path_factory.mktemp("huge") / "shape.png"
    Image.new("1", (12000, 12000)).save(path)
    return path


def gradient_jpeg(path: Path, size: tuple[int, int]) -> Path:
    """A smooth colour gradient (width, height) saved as JPEG."""
    width, height = size
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)  # (H, W)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None].repeat(width, 1)  # (H, W)
    rgb = np.stack([x, y, 255 - x], axis=-1).astype(np.uint8)  # (H, W, 3)
    Image.fromarray(rgb).save(path, quality=95)
    return path


# ------------------------------------------------------------------------- too many pixels
def test_a_huge_png_is_refused_in_one_line_before_decoding(huge_png, no_decoding):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's decompression-bomb warning does not escape either
        with pytest.raises(ImageLoadError) as error:
            preprocess_image(huge_png, 32)
    assert str(error.value) == f"{huge_png} is 12000x12000 pixels (144.0 MP), {LIMIT}"


def test_between_our_limit_and_pillows_an_image_is_refused_too(tmp_path, no_decoding):
    path = tmp_path / "wide.png"
    Image.new("1", (8000, 6000)).save(path)  # 48 MP: under Pillow's 89 MP warning
    assert 8000 * 6000 < Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageLoadError, match=rf"^{path} is 8000x6000 pixels \(48.0 MP\), over the limit of 40 MP"):
        load_image(path)


def test_over_pillows_hard_limit_the_message_still_names_the_file(tmp_path, no_decoding):
    path = tmp_path / "bomb.png"
    Image.new("1", (20000, 10000)).save(path)  # 200 MP: Pillow refuses it when opening
    with pytest.raises(ImageLoadError, match=rf"^{path} is too large to decode: Image size \(200000000 pixels\)"):
        preprocess_image(path, 32)


def test_a_16_bit_image_over_a_lowered_limit_is_refused(tmp_path, monkeypatch, no_decoding):
    path = tmp_path / "deep.png"
    Image.fromarray(np.zeros((40, 50), dtype=np.uint16)).save(path)
    monkeypatch.setattr(transforms, "MAX_IMAGE_PIXELS", 1999)
    with pytest.raises(ImageLoadError) as error:
        preprocess_image(path, 32)
    assert str(error.value) == (
        f"{path} is 50x40 pixels (0.0 MP), over the limit of 0.001999 MP (vlfuse.data.transforms.MAX_IMAGE_PIXELS)"
    )


def test_an_opened_pil_image_is_checked_before_it_is_decoded(huge_png, no_decoding):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # Pillow's, at this open
        img = Image.open(huge_png)
    with img, pytest.raises(ImageLoadError, match=rf"^{huge_png} is 12000x12000 pixels"):
        preprocess_image(img, 32)


def test_a_training_dataset_names_the_file(huge_png):
    vocab = AnswerVocab(["yes", "no"])
    dataset = GroupedVQADataset([ImageQuestions(str(huge_png), ["is it big?"], ["yes"])], vocab, 32)
    with pytest.raises(ImageLoadError) as error:
        dataset[0]
    assert str(error.value) == f"{huge_png} is 12000x12000 pixels (144.0 MP), {LIMIT}"


# ------------------------------------------------------------------------ reduced-scale JPEG
def test_a_large_jpeg_decodes_at_a_reduced_scale_keeping_twice_the_model_size(tmp_path, monkeypatch):
    path = gradient_jpeg(tmp_path / "photo.jpg", (4000, 3000))
    monkeypatch.setattr(transforms, "MAX_IMAGE_PIXELS", 1_000_000)  # the full size, 12 MP, is over it
    with pytest.raises(ImageLoadError, match=r"photo\.jpg is 4000x3000 pixels \(12.0 MP\), over the limit of 1 MP"):
        load_image(path)  # at full size
    assert load_image(path, 32).size == (500, 375)  # 1/8: both sides still at least 2 x 32
    assert load_image(path, 224).size == (1000, 750)  # 1/4: 1/8 would leave 375 < 2 x 224
    pixels = preprocess_image(path, 32)
    assert pixels.shape == (3, 32, 32)
    monkeypatch.setattr(transforms, "MAX_IMAGE_PIXELS", 40_000_000)
    torch.testing.assert_close(pixels, old_preprocess(path, 32), atol=2 / 255, rtol=0)  # as good as a full decode


def test_a_jpeg_near_the_model_size_decodes_at_full_size(tmp_path):
    path = gradient_jpeg(tmp_path / "small.jpg", (60, 45))
    assert load_image(path, 32).size == (60, 45)
    torch.testing.assert_close(preprocess_image(path, 32), old_preprocess(path, 32), atol=0, rtol=0)


# ------------------------------------------------------------------------- as before
def test_normal_images_give_exactly_the_tensor_of_before(tmp_path):
    paths = list(easy_vqa.get_train_image_paths().values())[:3]  # 64 x 64 RGB PNGs
    deep = tmp_path / "deep.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 65536, (50, 40), dtype=np.uint16)).save(deep)
    for path in [*paths, deep]:
        for size in (32, 64, 100):
            torch.testing.assert_close(preprocess_image(path, size), old_preprocess(path, size), atol=0, rtol=0)


# ------------------------------------------------------------------------- vlfuse predict
def test_predict_reports_the_oversized_row_and_answers_the_other(huge_png, tmp_path, capsys):
    torch.manual_seed(0)
    model_dir = VLFuseModel.from_config(tiny_config(), ["no", "yes"], ["is it big?"]).save_pretrained(tmp_path / "m")
    normal = next(iter(easy_vqa.get_train_image_paths().values()))
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"image": str(huge_png), "question": "is it big?"}, {"image": normal, "question": "is it big?"}]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "answers.jsonl"
    assert vlfuse_main(["predict", "--model", str(model_dir), "--input", str(pairs), "--output", str(output)]) == 1
    bad, good = [json.loads(line) for line in output.read_text().splitlines()]
    assert bad["error"] == f"line 1: {huge_png} is 12000x12000 pixels (144.0 MP), {LIMIT}"
    assert "answer" not in bad
    assert good["line"] == 2 and good["answer"] in ("no", "yes") and "error" not in good
    assert "1 of 2 rows failed" in capsys.readouterr().err


# --------------------------------------------------------------------------- imagefolder
@pytest.fixture
def split(tmp_path) -> Path:
    """DATA/train with photos/a.png; outside/secret.png next to DATA; a link inside to the secret."""
    train = tmp_path / "DATA" / "train"
    (train / "photos").mkdir(parents=True)
    Image.new("RGB", (20, 20), (200, 10, 10)).save(train / "photos" / "a.png")
    (tmp_path / "outside").mkdir()
    Image.new("RGB", (20, 20), (10, 10, 200)).save(tmp_path / "outside" / "secret.png")
    (train / "link.png").symlink_to(tmp_path / "outside" / "secret.png")
    return train


def write_rows(split: Path, file_names: list[str]) -> Path:
    metadata = split / "metadata.jsonl"
    rows = [{"file_name": name, "question": "what colour is it?", "answer": "red"} for name in file_names]
    metadata.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return metadata


OUTSIDE = {
    "climbing out": "../../outside/secret.png",
    "absolute": "{root}/outside/secret.png",
    "a link out": "link.png",
}


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_a_path_outside_the_split_folder_is_a_bad_row_naming_file_line_and_path(split, case):
    name = OUTSIDE[case].format(root=split.parents[1])
    metadata = write_rows(split, ["photos/a.png", name])
    with pytest.raises(BadRowError) as error:
        load_imagefolder_split(split)
    assert str(error.value) == (
        f"{metadata}:2: file_name {name!r} is outside the split folder {split} (allow_outside_paths reads it)"
    )
    assert load_imagefolder_split(split, skip_bad_rows=True).skipped == 1


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_allow_outside_paths_reads_them(split, case):
    name = OUTSIDE[case].format(root=split.parents[1])
    write_rows(split, ["photos/a.png", name])
    records = load_imagefolder_split(split, allow_outside_paths=True).records
    assert [r.image_id for r in records] == ["photos/a.png", name]
    assert load_image(records[1].image).getpixel((0, 0)) == (10, 10, 200)


def test_paths_inside_the_split_folder_still_load(split):
    write_rows(split, ["photos/a.png", "photos/../photos/a.png"])
    records = load_imagefolder_split(split).records
    assert [r.image for r in records] == [str(split / "photos/a.png"), str(split / "photos/../photos/a.png")]


def test_the_datamodule_option_and_its_command_line_flag(split, capsys):
    write_rows(split, ["photos/a.png", "../../outside/secret.png"])
    data_dir = str(split.parent)
    with pytest.raises(BadRowError, match="is outside the split folder"):
        ImageFolderDataModule(data_dir=data_dir).records("train")
    assert len(ImageFolderDataModule(data_dir=data_dir, allow_outside_paths=True).records("train")) == 2
    args = ["fit", "--config", str(REPO / "configs" / "imagefolder_vqa.yaml"), "--data.init_args.data_dir", data_dir]
    with pytest.raises(SystemExit) as exit_info:
        vlfuse_main([*args, "--data.init_args.allow_outside_paths", "true", "--print_config"])
    assert exit_info.value.code == 0
    assert "allow_outside_paths: true" in capsys.readouterr().out


def test_an_oversized_image_in_a_split_is_a_bad_row(split, huge_png):
    shutil.copy(huge_png, split / "shape.png")
    metadata = write_rows(split, ["photos/a.png", "shape.png"])
    with pytest.raises(BadRowError) as error:
        load_imagefolder_split(split)
    assert str(error.value) == f"{metadata}:2: {split / 'shape.png'} is 12000x12000 pixels (144.0 MP), {LIMIT}"


def test_an_oversized_image_in_a_datasets_row_is_a_bad_row(huge_png, no_decoding):
    rows = [{"image": {"bytes": huge_png.read_bytes(), "path": None}, "question": "big?", "answer": "yes"}]
    with pytest.raises(BadRowError) as error:
        records_from_rows(rows, source="user/vqa [train]")
    assert str(error.value) == f"user/vqa [train] row 0: the image is 12000x12000 pixels (144.0 MP), {LIMIT}"

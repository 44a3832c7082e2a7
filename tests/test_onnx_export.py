"""ONNX export (``vlfuse export``, :func:`vlfuse.inference.export_onnx`): onnxruntime answers as PyTorch
does, int8 exports answer, an export folder is checked before use and never replaced."""

import io
import json
import shutil
from contextlib import redirect_stdout

import numpy as np
import onnx
import pytest
import torch

from vlfuse import model_io
from vlfuse.cli import main as vlfuse_main
from vlfuse.inference import OnnxAnswerModel, Predictor, export_onnx
from vlfuse.inference import onnx_export
from vlfuse.inference.onnx_model import ONNX_FILE
from vlfuse.layers import MultiHeadAttention
from vlfuse.model import VLFuseModel

from conftest import reader_config, tiny_config
from test_predict import ANSWERS, QUESTIONS, images  # noqa: F401 (images: a fixture, three random PNGs of odd sizes)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    # Ungated, so that the image changes the answer even without training; the default model's parts.
    fuser = {"gated": False, "mlp": "swiglu", "output_gate": True, "self_attention": False}
    model = VLFuseModel.from_config(tiny_config(fuser=fuser, head={"type": "bilinear"}), ANSWERS, QUESTIONS)
    return model.save_pretrained(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def model(model_dir):
    return VLFuseModel.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def fp32_dir(model, tmp_path_factory):
    return export_onnx(model, tmp_path_factory.mktemp("exports") / "fp32").directory


@pytest.fixture(scope="module")
def int8_export(model_dir, tmp_path_factory):
    """An int8 export written by ``vlfuse export``: its folder and what the command printed."""
    out = tmp_path_factory.mktemp("exports") / "int8"
    printed = io.StringIO()
    with redirect_stdout(printed):
        status = vlfuse_main(["export", "--model", str(model_dir), "--format", "onnx", "--output", str(out), "--quantize", "int8"])
    assert status == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def int8_dir(int8_export):
    return int8_export[0]


@pytest.fixture
def quick_graph(fp32_dir, monkeypatch):
    """Exports that copy the float32 graph instead of tracing the model again (the rest runs as it does)."""
    monkeypatch.setattr(onnx_export, "write_graph", lambda model, path, quantize: shutil.copy(fp32_dir / ONNX_FILE, path))


def pairs(images):
    """Every question about every image: several questions share each image."""
    return [p for p in images for _ in QUESTIONS], QUESTIONS * len(images)


def copy_export(source, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(source, target)
    return target


def relist(folder):
    """Record the files of ``folder`` anew in its config.json, as a forger would."""
    config = folder / model_io.CONFIG_FILE
    meta = json.loads(config.read_text())
    meta["files"] = model_io.file_digests(folder)
    config.write_text(json.dumps(meta))


# ------------------------------------------------------------------------------ parity
def test_export_answers_as_pytorch_with_the_same_results(model_dir, fp32_dir, images):
    meta = json.loads((fp32_dir / model_io.CONFIG_FILE).read_text())
    parity = meta["parity"]
    assert parity["pairs"] == sum(q for q, _ in onnx_export.CHECK_SIZES) == parity["same_answers"]
    assert parity["max_logit_difference"] < onnx_export.TOLERANCE
    assert meta["quantization"] is None and sorted(p.name for p in fp32_dir.iterdir()) == [
        "answers.json", "config.json", "model.onnx", "tokenizer"]
    paths, questions = pairs(images)
    questions[1] = "is there a purple thing?"  # unknown words: the same warnings and flags
    with pytest.warns(UserWarning):
        expected = Predictor.from_pretrained(model_dir).predict(paths, questions, top_k=3)
    with pytest.warns(UserWarning):
        actual = Predictor.from_pretrained(fp32_dir).predict(paths, questions, top_k=3)
    assert [r.keys() for r in actual] == [r.keys() for r in expected]
    assert [r["answer"] for r in actual] == [r["answer"] for r in expected]
    assert [[e["answer"] for e in r["top_k"]] for r in actual] == [[e["answer"] for e in r["top_k"]] for r in expected]
    np.testing.assert_allclose([r["score"] for r in actual], [r["score"] for r in expected], atol=1e-5)
    assert actual[1]["unknown_words"] == expected[1]["unknown_words"] == ["purple", "thing"]


def test_dynamic_sizes_one_pair_and_many_questions_per_image(model, fp32_dir):
    exported = OnnxAnswerModel.from_pretrained(fp32_dir)
    g = torch.Generator().manual_seed(3)
    for questions, images, length in [(1, 1, 1), (9, 2, model.processor.max_length), (5, 5, 3)]:
        pixels = torch.rand(images, 3, 32, 32, generator=g)
        ids = torch.randint(0, len(model.tokenizer), (questions, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, length // 2 + 1:] = 0  # padding
        index = torch.randint(0, images, (questions,), generator=g)
        with torch.no_grad():
            expected = model(pixels, ids, mask, image_index=index).logits
        torch.testing.assert_close(exported.logits(pixels, ids, mask, index), expected, rtol=0, atol=onnx_export.TOLERANCE)


def test_int8_export_is_quantized_and_answers(int8_dir, fp32_dir, images):
    meta = json.loads((int8_dir / model_io.CONFIG_FILE).read_text())
    assert meta["quantization"] == "int8" and meta["parity"]["pairs"] > 0
    graph = onnx.load(int8_dir / ONNX_FILE).graph
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {node.op_type for node in graph.node}
    assert (int8_dir / ONNX_FILE).stat().st_size < (fp32_dir / ONNX_FILE).stat().st_size
    paths, questions = pairs(images)
    int8 = Predictor.from_pretrained(int8_dir).predict(paths, questions, top_k=2)
    fp32 = Predictor.from_pretrained(fp32_dir).predict(paths, questions, top_k=2)
    assert all(r["answer"] in ANSWERS and 0 < r["score"] <= 1 for r in int8)
    assert sum(a["answer"] == b["answer"] for a, b in zip(int8, fp32)) >= 0.75 * len(fp32)
    np.testing.assert_allclose([r["score"] for r in int8], [r["score"] for r in fp32], atol=0.1)


def float_products_with_a_stored_weight(graph: onnx.GraphProto) -> list[str]:
    """The names of the float matrix products of ``graph`` whose weight is one of its initializers."""
    stored = {init.name for init in graph.initializer}
    return [node.name for node in graph.node if node.op_type in ("MatMul", "Gemm") and node.input[1] in stored]


def test_every_linear_layer_is_a_product_with_a_stored_weight_and_int8_quantizes_each(model, fp32_dir, int8_dir):
    """onnxruntime quantizes only products whose weight is stored in the graph: a weight that reaches
    its product through an op run at inference (a split of ``kv_proj`` into keys and values, say)
    stays float32. Each attention layer's ``kv_proj`` is two products, its halves."""
    products = float_products_with_a_stored_weight(onnx.load(fp32_dir / ONNX_FILE).graph)
    linear_layers = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    attention_layers = sum(isinstance(m, MultiHeadAttention) for m in model.modules())
    assert attention_layers > 0 and len(products) == linear_layers + attention_layers
    int8 = onnx.load(int8_dir / ONNX_FILE).graph
    assert float_products_with_a_stored_weight(int8) == []
    assert sum(node.op_type == "MatMulInteger" for node in int8.node) >= len(products)


def test_cli_exports_and_predicts_on_the_export(model_dir, int8_export, images, capsys):
    out, printed = int8_export
    assert f"int8 ONNX export of {model_dir} to {out}" in printed and "answers the same as PyTorch's" in printed
    assert vlfuse_main(["predict", "--model", str(out), "--image", str(images[0]), "--question", QUESTIONS[3]]) == 0
    [expected] = Predictor.from_pretrained(out).predict([images[0]], [QUESTIONS[3]])
    assert capsys.readouterr().out.startswith(f"answer: {expected['answer']} (probability {expected['score']:.4f})")


def test_exporting_a_caption_model_says_it_is_one(tmp_path, capsys):
    from vlfuse.captioning import CaptionConfig, CaptionModel
    from vlfuse.encoders import ImageEncoderConfig

    config = CaptionConfig(image=ImageEncoderConfig(image_size=30, patch_size=10, width=16, depth=1, num_heads=2), dim=16, depth=1)
    folder = CaptionModel.from_config(config, ["there is a red square ."]).save_pretrained(tmp_path / "captions")
    assert vlfuse_main(["export", "--model", str(folder), "--output", str(tmp_path / "out")]) == 2
    assert f"{folder} is a caption model: only question-answering models are exported" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ never replaced
def test_an_export_replaces_nothing(model, fp32_dir, tmp_path, capsys, quick_graph):
    before = model_io.file_digests(fp32_dir)
    with pytest.raises(ValueError, match=f"{fp32_dir} exists: an export never replaces it"):
        export_onnx(model, fp32_dir)
    assert model_io.file_digests(fp32_dir) == before
    taken = tmp_path / "notes"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    assert vlfuse_main(["export", "--model", "no/such/model", "--output", str(taken)]) == 2
    assert f"{taken} exists" in capsys.readouterr().err  # checked before the model is read
    assert (taken / "mine.txt").read_text() == "keep"
    assert export_onnx(model, tmp_path / "empty_is_fine").directory.is_dir()


def test_a_failed_parity_check_leaves_nothing(model, tmp_path, monkeypatch, quick_graph):
    monkeypatch.setattr(onnx_export, "compare", lambda *args: onnx_export.Parity(10, 9, 0.5))
    with pytest.raises(ValueError, match=r"does not answer as the model does \(9/10 .*not written"):
        export_onnx(model, tmp_path / "bad")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging copy


def test_a_model_that_cannot_be_exported_is_one_line(model, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("Could not guard on data-dependent expression u0 > 1\nmore lines")

    monkeypatch.setattr(torch.onnx, "export", fail)
    with pytest.raises(ValueError, match="^fuser 'fusion_stack' could not be exported to ONNX: Could not guard .*u0 > 1$"):
        export_onnx(model, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_a_reader_that_loops_over_the_words_is_refused_not_exported_with_a_fixed_length(tmp_path):
    torch.manual_seed(0)
    reader = VLFuseModel.from_config(reader_config("map_program"), ["no", "yes"], QUESTIONS)
    with pytest.raises(ValueError, match="^fuser 'map_program' cannot be exported to ONNX with dynamic sizes: the "
                       "trace fixed axis 1 of input_ids to 5"):
        export_onnx(reader, tmp_path / "reader")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ untrusted folders
def test_missing_or_changed_files_are_named(fp32_dir, tmp_path):
    folder = copy_export(fp32_dir, tmp_path)
    with (folder / ONNX_FILE).open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match=f"{folder / ONNX_FILE} does not match"):
        Predictor.from_pretrained(folder)
    (folder / ONNX_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=f"{folder} is not an ONNX export of a vlfuse model: missing model.onnx"):
        OnnxAnswerModel.from_pretrained(folder)


def test_an_export_without_digests_is_refused(fp32_dir, tmp_path):
    folder = copy_export(fp32_dir, tmp_path)
    config = folder / model_io.CONFIG_FILE
    meta = json.loads(config.read_text())
    del meta["files"]
    config.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"{config} does not list the size and sha256 of model.onnx"):
        OnnxAnswerModel.from_pretrained(folder)


def test_a_graph_that_is_not_onnx_or_not_an_export_is_named(fp32_dir, tmp_path):
    folder = copy_export(fp32_dir, tmp_path)
    (folder / ONNX_FILE).write_bytes(b"not a protobuf \xff\xff\xff")
    relist(folder)
    with pytest.raises(ValueError, match=f"{folder / ONNX_FILE} is not a valid ONNX model"):
        OnnxAnswerModel.from_pretrained(folder)
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1])
    other = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["logits"])], "g", [x], [y]))
    onnx.save(other, folder / ONNX_FILE)
    relist(folder)
    with pytest.raises(ValueError, match=r"takes \['x'\] and gives \['logits'\]: an export takes \['pixel_values'"):
        OnnxAnswerModel.from_pretrained(folder)


def test_answers_that_do_not_fit_the_graph_are_named(fp32_dir, tmp_path):
    folder = copy_export(fp32_dir, tmp_path)
    (folder / model_io.ANSWERS_FILE).write_text(json.dumps(ANSWERS + ["square"]))
    relist(folder)
    with pytest.raises(ValueError, match=f"{folder / ONNX_FILE} gives 6 scores per question, but answers.json lists 7"):
        OnnxAnswerModel.from_pretrained(folder)


def test_bad_config_values_and_other_folders_are_named(fp32_dir, model_dir, tmp_path):
    folder = copy_export(fp32_dir, tmp_path)
    config = folder / model_io.CONFIG_FILE
    meta = json.loads(config.read_text())
    config.write_text(json.dumps({**meta, "image_size": "32"}))
    with pytest.raises(ValueError, match=f"{config}: image_size must be an integer from 1 to 8192, got '32'"):
        OnnxAnswerModel.from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match=f"{model_dir} is not an ONNX export of a vlfuse model: missing model.onnx"):
        OnnxAnswerModel.from_pretrained(model_dir)
    (folder / ONNX_FILE).rename(folder / "kept.onnx")
    shutil.copy(folder / "kept.onnx", model_dir / ONNX_FILE)  # a model folder with a graph beside it
    try:
        with pytest.raises(ValueError, match=f"{model_dir / 'config.json'} is not a vlfuse-onnx model of format 1"):
            OnnxAnswerModel.from_pretrained(model_dir)
    finally:
        (model_dir / ONNX_FILE).unlink()


def test_what_an_export_cannot_do_is_said(fp32_dir, images):
    predictor = Predictor.from_pretrained(fp32_dir)
    with pytest.raises(ValueError, match="is an ONNX export: it gives answer scores only, no attention heads"):
        predictor.predict(images[:1], QUESTIONS[:1], attention_maps="maps")
    with pytest.raises(ValueError, match="an ONNX export runs on the CPU"):
        OnnxAnswerModel.from_pretrained(fp32_dir, device="cuda")
    [result] = predictor.predict([images[0].parent / "missing.png"], QUESTIONS[:1], errors="report")
    assert "missing.png" in result["error"] and "answer" not in result

"""Activation checkpointing (issue 32): per part, the gradients of the unchecked run, fewer bytes kept
for backward; the config switch ``model.activation_checkpointing``; the real-size preset
configs/base_224.yaml."""

import copy
import dataclasses
import json

import pytest
import timm.layers.config
import torch
import torch.nn.functional as F
import yaml
from PIL import Image

from vlfuse.cli import main, run_lightning
from vlfuse.encoders import TextEncoderConfig
from vlfuse.layers import FusionStack, ProjectedContext
from vlfuse.layers.attention import ContextTokens
from vlfuse.lit import VLFuseLitModule
from vlfuse.model import VLFuseConfig, VLFuseModel

from conftest import COLOUR_ANSWERS, REPO, logits, make_model, reader_config, tiny_cli_args, tiny_config, toy_batch
from test_caption_model import CAPTIONS, tiny_caption_model
from test_lora import LORA, pretrained  # noqa: F401 (a fixture)
from test_vqa_v2 import vqa_dir  # noqa: F401 (a fixture)

EASY_VQA = REPO / "configs" / "easy_vqa.yaml"
BASE_224 = REPO / "configs" / "base_224.yaml"
VQA_V2 = REPO / "configs" / "vqa_v2.yaml"
SHAPES_CAPTIONS = REPO / "configs" / "shapes_captions.yaml"
DROPOUT = {"dropout": 0.1, "attn_dropout": 0.1}
"""Fuser dropout; the from-scratch BERT has its own (0.1): the recomputed forward must draw the same masks."""


def loss_and_gradients(model: VLFuseModel, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward and backward from seed 1: the loss and every parameter's gradient."""
    model.train().zero_grad()
    torch.manual_seed(1)
    loss = F.cross_entropy(logits(model, batch), batch["labels"])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def saved_bytes(model: VLFuseModel, batch: dict) -> int:
    """Bytes of the tensors (not parameters) that autograd keeps for backward in a training forward,
    each storage once: a checkpointed block adds its tensor inputs, not what it computes."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits(model, batch)
    return sum(kept.values())


def assert_same_training_step(model: VLFuseModel, batch: dict, parts, expected: list[str]) -> None:
    """Checkpointing ``parts`` of a copy of ``model`` sets ``expected``, keeps fewer bytes for backward
    and gives the same loss and gradients (fp32)."""
    checked = copy.deepcopy(model)
    assert checked.set_grad_checkpointing(True, parts) == expected
    assert saved_bytes(checked, batch) < saved_bytes(model, batch)
    loss, gradients = loss_and_gradients(model, batch)
    checked_loss, checked_gradients = loss_and_gradients(checked, batch)
    torch.testing.assert_close(checked_loss, loss, atol=1e-6, rtol=1e-6)
    assert checked_gradients.keys() == gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(checked_gradients[name], gradient, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize(
    "parts, expected",
    [(["image"], ["image"]), (["text"], ["text"]), (["fuser"], ["fuser"]), (None, ["image", "text", "fuser"])],
    ids=["image", "text", "fuser", "all"],
)
def test_checkpointed_parts_give_the_gradients_of_the_unchecked_run(parts, expected, dropout, one_thread):
    model, batch = make_model(fuser=DROPOUT if dropout else {})
    assert_same_training_step(model, batch, parts, expected)


def test_the_cell_steps_fuser_checkpoints_each_word_step(one_thread):
    config = reader_config("cell_steps", dropout=0.1)
    torch.manual_seed(0)
    records, batch = toy_batch()
    batch["labels"] = torch.arange(len(batch["questions"])) % 2
    model = VLFuseModel.from_config(config, ["no", "yes"], [q for r in records for q in r.questions])
    assert_same_training_step(model, batch, ["fuser"], ["fuser"])


def test_an_image_adapter_gets_the_gradients_of_the_unchecked_run(pretrained, one_thread):  # noqa: F811
    image = dataclasses.replace(tiny_config().image, weights_file=pretrained["image"], adapter={**LORA, "target_modules": ["qkv"]})
    text = TextEncoderConfig(name=pretrained["text"], max_length=16, adapter=LORA)
    torch.manual_seed(0)
    records, batch = toy_batch()
    model = VLFuseModel.from_config(tiny_config(image=image, text=text), COLOUR_ANSWERS, [q for r in records for q in r.questions])
    assert_same_training_step(model, batch, None, ["image", "text", "fuser"])
    lora = [name for name, p in model.named_parameters() if p.requires_grad and "lora_" in name]
    assert any(name.startswith("image_encoder.") for name in lora) and any(name.startswith("text_encoder.") for name in lora)


def test_in_training_each_block_projects_its_keys_and_values_inside_its_checkpoint(one_thread):
    model, batch = make_model()
    model.set_grad_checkpointing(True, ["fuser"])
    pixels = model.processor.batch(batch)["pixel_values"]
    context = model.train().encode_images(pixels).features
    assert len(context) == 2 and all(isinstance(kv, ContextTokens) for kv in context)
    assert all(isinstance(kv, ProjectedContext) for kv in model.eval().encode_images(pixels).features)
    with torch.no_grad():  # no backward: nothing to checkpoint
        assert all(isinstance(kv, ProjectedContext) for kv in model.train().encode_images(pixels).features)


def test_a_stack_given_the_image_tokens_or_their_keys_and_values_computes_the_same(one_thread):
    torch.manual_seed(0)
    stack = FusionStack(2, 32, 16, **DROPOUT)
    text, image = torch.randn(3, 5, 32), torch.randn(2, 7, 32, requires_grad=True)
    text_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    index = torch.tensor([0, 1, 1])
    results = []
    for checkpointing, given in [(False, "kvs"), (True, "kvs"), (True, "context")]:
        stack.set_grad_checkpointing(checkpointing)
        image.grad = None
        stack.zero_grad()
        torch.manual_seed(1)
        inputs = {"kvs": stack.project_context(image)} if given == "kvs" else {"context": image}
        out, weights = stack(text, text_mask=text_mask, image_index=index, weights_from=[1], **inputs)
        (out.sum() + weights[1].square().sum()).backward()
        results.append([out, weights[1], image.grad, *(p.grad for p in stack.parameters())])
    for other in results[1:]:
        for got, expected in zip(other, results[0], strict=True):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("parts", [["image"], ["decoder"], None], ids=["image", "decoder", "both"])
def test_a_caption_model_checkpoints_with_the_gradients_of_the_unchecked_run(parts, one_thread):
    model = tiny_caption_model(dropout=0.1, attn_dropout=0.1)
    checked = copy.deepcopy(model)
    assert checked.set_grad_checkpointing(True, parts) == (parts or ["image", "decoder"])
    pixels, ids = torch.rand(3, 3, 30, 30), model.tokenize(CAPTIONS)
    results = []
    for caption_model in (model, checked):
        caption_model.train()
        torch.manual_seed(1)
        loss = caption_model(pixels, ids).logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in caption_model.named_parameters() if p.grad is not None}))
    (loss, gradients), (checked_loss, checked_gradients) = results
    torch.testing.assert_close(checked_loss, loss, atol=1e-6, rtol=1e-6)
    assert checked_gradients.keys() == gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(checked_gradients[name], gradient, atol=1e-6, rtol=1e-6, msg=name)
    if parts != ["image"]:  # in training the blocks project their keys/values inside their checkpoints
        assert isinstance(checked.encode_images(pixels).features[0], ContextTokens)


def test_the_caption_config_switch_reaches_the_model(tmp_path):
    cli = run_lightning(["fit", "--config", str(SHAPES_CAPTIONS), *tiny_cli_args(tmp_path, caption=True),
                         "--trainer.fast_dev_run=true", "--model.init_args.activation_checkpointing=[decoder]"])
    model = cli.model.model
    assert (model.image_encoder.vit.grad_checkpointing, model.decoder.grad_checkpointing) == (False, True)
    assert cli.model.hparams.activation_checkpointing == ["decoder"]


def test_a_compiled_stack_checkpoints_on_the_padded_layout(one_thread):
    """Under torch.compile the blocks run on the padded layout, each row its image's tokens copied
    (``ContextTokens.rows``); the checkpoints compile (aot_eager: no C++ build) and the gradients
    are the eager unchecked run's within float rounding (the layouts sum in different orders)."""
    torch.manual_seed(0)
    stack = FusionStack(2, 32, 16)
    text, image = torch.randn(3, 5, 32), torch.randn(2, 7, 32, requires_grad=True)
    text_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    results = []
    for run in (stack, torch.compile(stack, backend="aot_eager")):
        stack.set_grad_checkpointing(run is not stack)
        stack.zero_grad()
        image.grad = None
        out, _ = run(text, context=image, text_mask=text_mask, image_index=torch.tensor([0, 1, 1]))
        out.sum().backward()
        results.append([out, image.grad, *(p.grad for p in stack.parameters())])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ what is left out or refused
def test_frozen_encoders_are_left_out_even_when_named():
    config = tiny_config()
    config.image.freeze = config.text.freeze = True
    model = VLFuseModel.from_config(config, COLOUR_ANSWERS, ["what color is it?"])
    assert model.set_grad_checkpointing(True, ["image", "text", "fuser"]) == ["fuser"]
    assert not model.image_encoder.vit.grad_checkpointing
    assert not model.text_encoder.model.is_activation_checkpointing


def test_a_fuser_without_blocks_is_left_out_unless_named():
    model = VLFuseModel.from_config(reader_config("map_program"), ["no", "yes"], ["is a circle red"])
    assert model.set_grad_checkpointing(True) == ["image", "text"]
    with pytest.raises(ValueError, match="^activation checkpointing: fuser 'map_program' has no blocks to checkpoint "
                                         r"\(fusion_stack, cell_steps and cell_moves have\): leave fuser out of the parts$"):
        model.set_grad_checkpointing(True, ["fuser"])


def test_an_unknown_part_is_named():
    model, _ = make_model()
    with pytest.raises(ValueError, match=r"^activation checkpointing: unknown parts \['head'\]; the parts are \['image', 'text', 'fuser'\]$"):
        model.set_grad_checkpointing(True, ["image", "head"])


def test_timm_set_to_reentrant_checkpointing_is_refused(monkeypatch):
    model, _ = make_model()
    monkeypatch.setattr(timm.layers.config, "_USE_REENTRANT_CKPT", True)
    with pytest.raises(ValueError, match=r"^image: timm is set to reentrant activation checkpointing \(TIMM_REENTRANT_CKPT\): unset it$"):
        model.set_grad_checkpointing(True, ["image"])


def test_switching_it_off_switches_every_part_off():
    model, _ = make_model()
    model.set_grad_checkpointing(True)
    assert model.set_grad_checkpointing(False) == ["image", "text", "fuser"]
    assert not model.image_encoder.vit.grad_checkpointing
    assert not model.text_encoder.model.is_activation_checkpointing
    assert not model.fuser.stack.grad_checkpointing


# ------------------------------------------------------------------------------ the config switch
def checkpointing_of(model: VLFuseModel) -> dict[str, bool]:
    return {
        "image": model.image_encoder.vit.grad_checkpointing,
        "text": model.text_encoder.model.is_activation_checkpointing,
        "fuser": model.fuser.stack.grad_checkpointing,
    }


def test_the_cli_option_reaches_the_model_and_a_pretrained_one_but_not_its_folder(tmp_path):
    first = tmp_path / "first"
    cli = run_lightning(["fit", "--config", str(EASY_VQA), *tiny_cli_args(first), "--trainer.fast_dev_run=true",
                         "--model.activation_checkpointing=[image, fuser]"])
    assert checkpointing_of(cli.model.model) == {"image": True, "text": False, "fuser": True}
    assert cli.model.hparams.activation_checkpointing == ["image", "fuser"]
    saved = json.loads((first / "model" / "config.json").read_text())  # its run record has the command line
    assert "checkpointing" not in json.dumps([saved["config"], saved["text_encoder_config"]])
    assert checkpointing_of(VLFuseModel.from_pretrained(first / "model")) == {"image": False, "text": False, "fuser": False}
    second = tmp_path / "second"
    cli = run_lightning(["fit", "--config", str(EASY_VQA), *tiny_cli_args(second), "--trainer.fast_dev_run=true",
                         f"--model.pretrained={first / 'model'}", "--model.activation_checkpointing=true"])
    assert checkpointing_of(cli.model.model) == {"image": True, "text": True, "fuser": True}


def test_print_config_shows_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(BASE_224), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["model"]["activation_checkpointing"] is False


@pytest.mark.parametrize("value", ["[image, head]", "images"])
def test_a_bad_option_value_is_one_line_naming_it(tmp_path, capsys, value):
    args = ["fit", "--config", str(EASY_VQA), *tiny_cli_args(tmp_path), f"--model.activation_checkpointing={value}"]
    assert main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "activation_checkpointing" in line


def test_the_lightning_module_checks_the_option():
    with pytest.raises(ValueError, match=r"^model.activation_checkpointing must be true, false or a list of parts among "
                                         r"\['image', 'text', 'fuser'\], got \['head'\]$"):
        VLFuseLitModule(activation_checkpointing=["head"])


# ------------------------------------------------------------------------------ the real-size preset
def test_the_preset_is_vit_b_at_224_a_bert_base_text_encoder_and_six_fusion_blocks_of_768():
    config = VLFuseConfig.from_dict(yaml.safe_load(BASE_224.read_text())["model"]["architecture"])
    model = VLFuseModel.from_config(config, ["no", "yes"], ["what is in the image?"])
    vit, bert = model.image_encoder.vit, model.text_encoder.model.config
    assert (vit.embed_dim, len(vit.blocks), model.image_encoder.grid_size, model.image_encoder.num_prefix_tokens) == (768, 12, (14, 14), 1)
    assert (bert.hidden_size, bert.num_hidden_layers, bert.num_attention_heads) == (768, 12, 12)
    assert len(model.fuser.stack) == 6
    assert all((layer.dim, layer.num_heads) == (768, 16) for layer in model.attention_layers)
    with torch.no_grad():
        tokens = model.image_encoder(torch.rand(1, 3, 224, 224))
    assert tokens.shape == (1, 197, 768)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    assert 200 < millions < 230  # ViT-B 86 M, BERT-base without its 30,522-word vocabulary 85 M, fusion 43 M


def imagefolder_224(root):
    """train/validation/test folders of 224-px images, three of each colour per split, two questions each."""
    colours = {"red": (220, 30, 30), "blue": (30, 30, 220)}
    for split in ("train", "validation", "test"):
        folder = root / split
        folder.mkdir(parents=True)
        rows = []
        for i, (colour, rgb) in enumerate(list(colours.items()) * 2):
            name = f"{i}.png"
            Image.new("RGB", (224, 224), rgb).save(folder / name)
            rows.append({"file_name": name, "question": "what colour is it?", "answer": colour})
            rows.append({"file_name": name, "question": "is it red?", "answer": "yes" if colour == "red" else "no"})
        (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def quiet_run_args(root) -> list[str]:
    """Where a test's run writes (under ``root``), no logger, checkpoint files or progress bar; batches of 2 images."""
    return [
        f"--trainer.default_root_dir={root}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--checkpoint.save_top_k=0", "--checkpoint.save_last=false",
        f"--export.dirpath={root / 'model'}", "--data.init_args.batch_size=2", "--data.init_args.num_workers=0",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True], ids=["trained-encoders", "frozen-encoders"])
def test_the_preset_fits_three_steps_on_cpu_with_checkpointing(tmp_path, frozen):
    data = imagefolder_224(tmp_path / "DATA")
    args = ["fit", "--config", str(BASE_224), "--data.init_args.data_dir", str(data), "--trainer.max_steps", "3"]
    freeze = ["--model.architecture.image.freeze=true", "--model.architecture.text.freeze=true"] if frozen else []
    cli = run_lightning([*args, "--model.activation_checkpointing=true", *freeze, *quiet_run_args(tmp_path)])
    assert cli.trainer.global_step == 3
    assert checkpointing_of(cli.model.model) == {"image": not frozen, "text": not frozen, "fuser": True}
    assert VLFuseModel.from_pretrained(tmp_path / "model").config.fuser.depth == 6


@pytest.mark.slow
def test_the_vqa_v2_config_starts_on_cpu_with_encoders_from_scratch(tmp_path, vqa_dir):  # noqa: F811
    scratch = [
        "--model.architecture.image.pretrained=false", "--model.architecture.text.name=null",
        "--model.architecture.text.width=768", "--model.architecture.text.depth=12", "--model.architecture.text.num_heads=12",
    ]
    on_cpu = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.strategy", "auto",
              "--trainer.devices", "1", "--trainer.max_steps", "2"]
    cli = run_lightning(["fit", "--config", str(VQA_V2), f"--data.init_args.data_dir={vqa_dir}", *scratch, *on_cpu,
                         *quiet_run_args(tmp_path), "--test_after_fit=false"])
    assert cli.trainer.global_step == 2
    assert len(cli.model.model.fuser.stack) == 6

import copy
import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F

from vlfuse.encoders import ImageEncoderConfig, TextEncoderConfig
from vlfuse.fusers import FUSERS, FusionStackConfig
from vlfuse.heads import HEADS, PooledConfig, PooledHead
from vlfuse.model import ImageContext, VLFuseModel

from conftest import COLOUR_ANSWERS, logits, make_model, tiny_config

ANSWERS = COLOUR_ANSWERS


def test_forward_shapes_and_attention_weights():
    model, batch = make_model()
    tokens = model.processor.tokenize(batch["questions"])
    out = model.eval()(batch["pixel_values"], **tokens, image_index=batch["image_index"], weights_from=[0, 1])
    assert out.logits.shape == (8, len(ANSWERS))
    grid = model.image_encoder.grid_size
    assert grid == (4, 4)
    lt = tokens["input_ids"].shape[1]
    assert out.attentions[1].shape == (8, 16, lt, 1 + 16)
    torch.testing.assert_close(out.attentions[1].sum(-1), torch.ones(8, 16, lt))


def test_the_processor_gives_what_forward_takes():
    """``model(**model.processor.batch(batch))`` is the forward of the batch's tensors."""
    model, batch = make_model()
    model.eval()
    inputs = model.processor.batch(batch)
    assert torch.equal(inputs.pixel_values, batch["pixel_values"])
    assert torch.equal(inputs.image_index, batch["image_index"])
    tokens = model.processor.tokenize(batch["questions"])
    direct = model(batch["pixel_values"], **tokens, image_index=batch["image_index"]).logits
    assert torch.equal(model(**inputs).logits, direct)


def test_shared_images_give_the_same_logits_as_repeated_images():
    model, batch = make_model()
    model.eval()
    shared = logits(model, batch)
    tokens = model.processor.tokenize(batch["questions"])
    repeated = model(batch["pixel_values"][batch["image_index"]], **tokens).logits
    torch.testing.assert_close(shared, repeated, atol=1e-5, rtol=0)


def test_save_and_load_give_identical_logits(tmp_path):
    model, batch = make_model()
    model.prune_heads({1: [0, 5]})
    model.eval()
    directory = model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in directory.iterdir()) == ["README.md", "answers.json", "config.json", "model.safetensors", "tokenizer"]
    meta = json.loads((directory / "config.json").read_text())
    assert meta["format_version"] == 3
    assert meta["config"]["pruned_heads"] == {"1": [0, 5]}
    assert meta["config"]["fuser"]["type"] == "fusion_stack" and meta["config"]["head"] == {"type": "pooled", "dropout": 0.0}
    loaded = VLFuseModel.from_pretrained(directory)
    assert loaded.answers == ANSWERS
    assert loaded.config == model.config
    assert loaded.fuser.stack.blocks[1].cross_attn.num_heads == 14
    torch.testing.assert_close(logits(loaded, batch), logits(model, batch), atol=0, rtol=0)


def test_loading_reports_missing_files_other_versions_and_answer_mismatch(tmp_path):
    model, _ = make_model()
    directory = model.save_pretrained(tmp_path / "m")
    answers = directory / "answers.json"
    answers.write_text(json.dumps(ANSWERS + ["green"]))
    with pytest.raises(ValueError, match=r"answers.json does not match .*config.json: it is not the file that was saved"):
        VLFuseModel.from_pretrained(directory)
    meta = json.loads((directory / "config.json").read_text())
    del meta["files"]  # as a folder written before digests were recorded: the shapes still tell
    (directory / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"\(5 answers\): head.classifier.2.bias is \(4,\) in the file, \(5,\) in the model"):
        VLFuseModel.from_pretrained(directory)
    answers.unlink()
    with pytest.raises(FileNotFoundError, match="missing answers.json"):
        VLFuseModel.from_pretrained(directory)
    model.save_pretrained(directory)
    meta = json.loads((directory / "config.json").read_text())
    meta["format_version"] = 99
    (directory / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="another vlfuse version"):
        VLFuseModel.from_pretrained(directory)


def test_overfits_one_small_batch():
    model, batch = make_model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        loss = F.cross_entropy(logits(model, batch), batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    assert loss.item() < 0.05
    assert torch.equal(logits(model, batch).argmax(-1), batch["labels"])


def test_frozen_encoders_get_no_gradient():
    image = ImageEncoderConfig(image_size=32, patch_size=8, width=32, depth=1, num_heads=2, freeze=True)
    text = TextEncoderConfig(width=32, depth=1, num_heads=2, freeze=True)
    model, batch = make_model(image=image, text=text)
    logits(model.train(), batch).sum().backward()
    assert all(p.grad is None for p in model.image_encoder.parameters())
    assert all(p.grad is None for p in model.text_encoder.parameters())
    assert model.head.classifier[-1].weight.grad is not None
    assert all(p.grad is not None for p in model.fuser.parameters())


def test_unknown_encoder_names_give_one_line_errors():
    with pytest.raises(ValueError, match="timm does not know the image encoder 'vit_nonexistent'"):
        make_model(image=ImageEncoderConfig(name="vit_nonexistent"))
    with pytest.raises(ValueError, match="transformers does not know the text encoder type 'nonexistent'") as info:
        make_model(text=TextEncoderConfig(model_type="nonexistent"))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="cannot load a tokenizer from '/no/such/dir'"):
        make_model(text=TextEncoderConfig(name="/no/such/dir"))


def test_repeated_questions_are_encoded_once_with_the_same_result():
    model, batch = make_model()
    model.eval()
    tokens = model.processor.tokenize(batch["questions"])
    calls = []
    hook = model.text_encoder.register_forward_hook(lambda m, args, out: calls.append(len(args[0])))
    deduplicated = model.encode_questions(**tokens)
    hook.remove()
    assert calls == [len(set(batch["questions"]))] and calls[0] < len(batch["questions"])
    direct = model.text_proj(model.text_encoder(tokens["input_ids"], tokens["attention_mask"]))
    torch.testing.assert_close(deduplicated, direct, atol=1e-5, rtol=0)


def test_forward_is_the_composition_of_the_four_stages():
    model, batch = make_model()
    model.prune_heads({0: [3]})
    model.eval()
    tokens = model.processor.tokenize(batch["questions"])
    out = model(batch["pixel_values"], **tokens, image_index=batch["image_index"], weights_from=[1])
    context = model.encode_images(batch["pixel_values"])
    text_mask = tokens["attention_mask"].bool()
    text = model.encode_questions(**tokens)
    fused = model.fuse(text, text_mask, context, batch["image_index"], weights_from=[1])
    assert fused.output.shape == text.shape  # fused question tokens, for a head that reads tokens
    staged = model.read_out(fused.output, text_mask)
    assert torch.equal(staged, out.logits)
    assert torch.equal(fused.attentions[1], out.attentions[1])
    assert torch.equal(out.text_mask, text_mask)


def test_head_mask_zero_gives_the_logits_of_the_pruned_model():
    model, batch = make_model()
    model.prune_heads({1: [2]})  # head 2 of layer 1 is gone: its entry is ignored
    model.eval()
    pruned = copy.deepcopy(model)
    pruned.prune_heads({0: [0, 7], 1: [5]})
    mask = torch.ones(2, 16)
    mask[0, [0, 7]] = 0.0
    mask[1, 5] = 0.0
    mask[1, 2] = float("nan")
    torch.testing.assert_close(logits(model, batch, head_mask=mask), logits(pruned, batch), atol=1e-5, rtol=0)
    per_question = mask.expand(len(batch["questions"]), 2, 16).clone()
    per_question[1:] = 1.0  # only the first question loses the heads
    mixed = logits(model, batch, head_mask=per_question)
    torch.testing.assert_close(mixed[0], logits(pruned, batch)[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1:], logits(model, batch)[1:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"head_mask must be \(layers, heads\) \(2, 16\)"):
        logits(model, batch, head_mask=torch.ones(16))


def test_a_registered_head_is_chosen_by_its_config_type():
    class MaxHead(PooledHead):
        def pool(self, tokens, text_mask):
            return tokens.masked_fill(~text_mask[..., None], float("-inf")).amax(1)

    @HEADS.register
    @dataclasses.dataclass
    class MaxConfig(PooledConfig):
        type: str = "max_for_test"

        def build(self, dim, answers):
            return MaxHead(dim, len(answers), dropout=self.dropout)

    try:
        model, batch = make_model(head={"type": "max_for_test"})
        model.eval()
        assert isinstance(model.config.head, MaxConfig) and isinstance(model.head, MaxHead)
        tokens = model.processor.tokenize(batch["questions"])
        mask = tokens["attention_mask"].bool()
        fused = model.fuse(model.encode_questions(**tokens), mask, model.encode_images(batch["pixel_values"]),
                           batch["image_index"]).output
        expected = model.head.classifier(fused.masked_fill(~mask[..., None], -1e9).amax(1))
        torch.testing.assert_close(logits(model, batch), expected, atol=1e-6, rtol=0)
        with pytest.raises(ValueError, match="already registered"):
            HEADS.register(MaxConfig)
    finally:
        del HEADS.configs["max_for_test"]


def test_unknown_head_and_a_fusion_stack_without_blocks_are_refused():
    assert {"bilinear", "existence", "pooled"} <= set(HEADS.configs)
    assert {"cell_steps", "fusion_stack", "map_program"} <= set(FUSERS.configs)
    with pytest.raises(ValueError, match=re.escape(f"head.type must be one of {sorted(HEADS.configs)}, got 'max'")):
        make_model(head={"type": "max"})
    with pytest.raises(ValueError, match="fuser.depth must be between 1 and 1024, got 0"):
        make_model(fuser={"depth": 0})
    with pytest.raises(ValueError, match="fuser.diversity_weight must be >= 0, got -0.1"):
        make_model(fuser={"diversity_weight": -0.1})


def test_every_fusion_option_reaches_the_fusion_stack():
    """Every option of the fusion stack changes the model it builds: none is accepted without effect."""
    changed = dict(depth=1, heads=8, mlp_ratio=1.0, dropout=0.2, attn_dropout=0.1, self_attention=False,
                   gated=False, normalizer="leaky_relu", diversity_weight=0.5, output_gate=True, mlp="swiglu")
    options = [spec.name for spec in dataclasses.fields(FusionStackConfig) if spec.name != "type"]
    assert sorted(changed) == sorted(options)
    model, _ = make_model(fuser=changed, pruned_heads={"0": [1]})
    assert model.config.fuser == FusionStackConfig(**changed)
    stack = model.fuser.stack
    assert len(stack.blocks) == 1 and model.num_heads_built == 8
    assert model.fuser.stack.blocks[0].cross_attn.num_heads == 7  # pruned_heads, of the model config
    assert model.fuser.diversity_weight == 0.5


def test_image_context_rows_selected_and_concatenated_equal_encoding_those_images():
    model, batch = make_model()
    model.eval()
    pixels = batch["pixel_values"]  # (4, 3, 32, 32)
    with torch.no_grad():
        context = model.encode_images(pixels)
        parts = ImageContext.cat([context.select(slice(2, 3)), context.select(torch.tensor([0, 3]))])
        direct = model.encode_images(pixels[[2, 0, 3]])
    assert len(direct.features) == 2  # the fusion stack's context: one ProjectedContext per block
    for got, want in zip(parts.features, direct.features, strict=True):
        torch.testing.assert_close(got.key, want.key, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.value, want.value, atol=1e-6, rtol=0)


def test_a_contiguous_image_context_holds_the_same_keys_laid_out_head_by_head():
    model, batch = make_model()
    with torch.no_grad():
        context = model.eval().encode_images(batch["pixel_values"])
    laid_out = context.contiguous()
    assert not context.features[0].key.is_contiguous()  # the projection's layout: token by token
    for got, want in zip(laid_out.features, context.features, strict=True):
        assert got.key.is_contiguous() and got.value.is_contiguous()
        assert torch.equal(got.key, want.key) and torch.equal(got.value, want.value)

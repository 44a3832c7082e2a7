"""The caption model: causal decoding, the cache, the tied head, gradients, save and load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vlfuse.captioning import CaptionConfig, CaptionDecoder, CaptionModel, greedy
from vlfuse.captioning.model import caption_processor
from vlfuse.encoders import ImageEncoderConfig
from vlfuse.heads import caption_decoder
from vlfuse.layers import CausalSelfAttention as ExportedCausalSelfAttention
from vlfuse.layers import ProjectedContext
from vlfuse.layers.causal import CausalSelfAttention, KVCache, causal_mask
from vlfuse.model import ImageContext

from conftest import parameters_without_gradient

CAPTIONS = [
    "a red square is left of a blue circle . there is a blue circle .",
    "a green triangle is above a red circle . there is a red circle .",
    "there is a blue square .",
]


def tiny_caption_model(seed: int = 0, **overrides) -> CaptionModel:
    """A decoder of width 32 with 16 heads over a 3x3 patch grid; dropout off."""
    torch.manual_seed(seed)
    fields = dict(
        image=ImageEncoderConfig(image_size=30, patch_size=10, width=32, depth=1, num_heads=2),
        dim=32, depth=2, heads=16, dropout=0.0, max_length=24,
    )
    fields.update(overrides)
    return CaptionModel.from_config(CaptionConfig(**fields), CAPTIONS).eval()


def test_teacher_forced_logits_equal_step_by_step_cached_decoding():
    model = tiny_caption_model()
    pixels = torch.rand(3, 3, 30, 30)
    ids = model.tokenize(CAPTIONS)  # (3, L)
    with torch.no_grad():
        teacher_forced = model(pixels, ids)  # (3, L, vocab)
        context, cache = model.encode_images(pixels), model.new_cache()
        steps = [model.decode(ids[:, t : t + 1], context, cache=cache).logits for t in range(ids.shape[1])]
    assert cache.length == ids.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), teacher_forced, atol=1e-5, rtol=1e-5)


def test_cached_decoding_of_a_prefix_then_the_rest_equals_teacher_forcing():
    model = tiny_caption_model(seed=1)
    pixels, ids = torch.rand(3, 3, 30, 30), model.tokenize(CAPTIONS)
    with torch.no_grad():
        context, cache = model.encode_images(pixels), model.new_cache()
        first = model.decode(ids[:, :4], context, cache=cache).logits  # several tokens at once, with the cache
        rest = model.decode(ids[:, 4:], context, cache=cache).logits
        torch.testing.assert_close(torch.cat([first, rest], dim=1), model(pixels, ids), atol=1e-5, rtol=1e-5)


def test_a_token_never_sees_the_tokens_after_it():
    model = tiny_caption_model()
    pixels, ids = torch.rand(3, 3, 30, 30), model.tokenize(CAPTIONS)
    changed = ids.clone()
    changed[:, 5:] = model.tokenizer.convert_tokens_to_ids("circle")
    with torch.no_grad():
        before, after = model(pixels, ids), model(pixels, changed)
    torch.testing.assert_close(after[:, :5], before[:, :5])
    assert not torch.allclose(after[:, 5:], before[:, 5:])


def test_captions_depend_on_the_image():
    model = tiny_caption_model()
    ids = model.tokenize(CAPTIONS[:1]).expand(2, -1)
    with torch.no_grad():
        logits = model(torch.stack([torch.zeros(3, 30, 30), torch.ones(3, 30, 30)]), ids)
    assert not torch.allclose(logits[0], logits[1])


def test_the_language_model_head_is_the_word_embedding():
    model = tiny_caption_model()
    names = set(model.state_dict())
    assert "decoder.embed.weight" in names
    assert not any("head" in name for name in names)  # no second vocabulary matrix
    with torch.no_grad():
        model.decoder.embed.weight[7].zero_()
        logits = model(torch.rand(1, 3, 30, 30), model.tokenize(CAPTIONS[:1]))
    assert torch.all(logits[..., 7] == 0)


def test_every_parameter_gets_a_gradient():
    model = tiny_caption_model().train()
    ids = model.tokenize(CAPTIONS)
    logits = model(torch.rand(3, 3, 30, 30), ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    missing = parameters_without_gradient(model)
    assert missing == []


def test_captions_are_wrapped_in_begin_and_end_tokens_and_read_back():
    model = tiny_caption_model()
    ids = model.tokenize(CAPTIONS)
    assert ids[:, 0].tolist() == [model.bos_id] * 3
    assert model.eos_id in ids[2].tolist() and ids[2, -1] == model.pad_id
    assert [model.detokenize(row.tolist()[1:]) for row in ids] == CAPTIONS


def test_a_caption_model_saves_loads_and_captions_identically(tmp_path):
    model = tiny_caption_model()
    pixels = torch.rand(4, 3, 30, 30)
    model.save_pretrained(tmp_path / "model")
    loaded = CaptionModel.from_pretrained(tmp_path / "model")
    ids = model.tokenize(CAPTIONS)
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixels[:3], ids), model(pixels[:3], ids), rtol=0, atol=0)
        original = greedy(model, model.encode_images(pixels))
        again = greedy(loaded, loaded.encode_images(pixels))
    assert [c.ids for c in again] == [c.ids for c in original]
    assert loaded.tokenizer.get_vocab() == model.tokenizer.get_vocab()
    assert loaded.config == model.config


def test_loading_an_answering_model_folder_as_a_caption_model_names_the_file(tmp_path):
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"format_version": 2, "model_type": "vlfuse"}))
    with pytest.raises(ValueError, match=r"config\.json is not a vlfuse-caption model of format 1 \(model_type 'vlfuse', format 2\)"):
        CaptionModel.from_pretrained(tmp_path)


def test_a_caption_model_is_its_config_and_processor():
    """CaptionModel(config, processor): the processor holds the tokenizer, the image size and the longest caption."""
    model = tiny_caption_model()
    processor = model.processor
    assert (processor.image_size, processor.max_length) == (30, 24) and model.tokenizer is processor.tokenizer
    twin = CaptionModel(model.config, caption_processor(model.config, model.tokenizer)).eval()
    twin.load_state_dict(model.state_dict())
    pixels, ids = torch.rand(2, 3, 30, 30), model.tokenize(CAPTIONS[:2])
    assert torch.equal(ids, processor.tokenize(CAPTIONS[:2])["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(twin(pixels, ids), model(pixels, ids), rtol=0, atol=0)
        image = processor.image(np.full((40, 50, 3), 200, dtype=np.uint8))  # any size, resized to the model's
        assert image.shape == (3, 30, 30)
        context = model.encode_images(image[None])
    # The image context's features: each decoder block's keys/values, (Bi, H, prefix + 9 patches, hd).
    assert isinstance(context, ImageContext) and len(context.features) == model.num_layers == 2
    assert all(isinstance(kv, ProjectedContext) and kv.key.shape == (1, 16, 10, 2) for kv in context.features)
    assert CaptionDecoder is caption_decoder.CaptionDecoder and ExportedCausalSelfAttention is CausalSelfAttention


def test_a_caption_longer_than_the_positions_is_refused():
    model = tiny_caption_model(max_length=8)
    with pytest.raises(ValueError, match="the decoder has 8 positions, asked for position 9"):
        model.decode(torch.zeros(1, 10, dtype=torch.long), model.encode_images(torch.rand(1, 3, 30, 30)))


def test_causal_self_attention_with_need_weights_gives_zero_weight_to_later_tokens():
    torch.manual_seed(0)
    attention = CausalSelfAttention(32, 16).eval()
    x = torch.randn(2, 5, 32)
    out, weights = attention(x, need_weights=True)  # (2, 16, 5, 5)
    assert torch.all(weights.triu(diagonal=1) == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 16, 5))
    torch.testing.assert_close(out, attention(x), atol=1e-6, rtol=1e-5)  # the SDPA path agrees


def test_causal_mask_lets_each_new_token_see_the_cached_ones():
    assert causal_mask(1, 4) is None
    assert causal_mask(2, 3).tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_kv_cache_select_reorders_the_rows():
    cache = KVCache()
    key = torch.arange(3.0).view(3, 1, 1, 1)
    cache.append(key, key + 10)
    cache.select(torch.tensor([2, 2, 0]))
    assert cache.key.flatten().tolist() == [2.0, 2.0, 0.0] and cache.value.flatten().tolist() == [12.0, 12.0, 10.0]

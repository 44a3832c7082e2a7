"""Greedy decoding and beam search: the cache, beams, lengths, attention weights."""

from __future__ import annotations

import pytest
import torch

from test_caption_model import tiny_caption_model
from vlfuse.captioning import beam_search, generate, greedy


def trained_to_say(caption: str, steps: int = 60):
    """A tiny caption model fitted to write ``caption`` for every image (so that its captions end)."""
    model = tiny_caption_model().train()
    ids = model.tokenize([caption] * 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(torch.rand(4, 3, 30, 30), ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def trained_to_tell_apart(short: str, long: str, steps: int = 80):
    """A tiny caption model fitted to write ``short`` for a black image and ``long`` for a white one."""
    model = tiny_caption_model().train()
    pixels = torch.cat([torch.zeros(2, 3, 30, 30), torch.ones(2, 3, 30, 30)])
    ids = model.tokenize([short, short, long, long])  # (4, L), the short ones padded
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(pixels, ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), ignore_index=model.pad_id)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_caption_model(seed=3)


@pytest.fixture(scope="module")
def context(model):
    torch.manual_seed(5)
    return model.encode_images(torch.rand(5, 3, 30, 30))


def test_greedy_with_the_cache_writes_the_captions_it_writes_without(model, context):
    cached = greedy(model, context, max_length=12)
    recomputed = greedy(model, context, max_length=12, use_cache=False)
    assert [c.ids for c in cached] == [c.ids for c in recomputed]
    assert [c.score for c in cached] == pytest.approx([c.score for c in recomputed], abs=1e-4)


def test_beam_size_one_equals_greedy(model, context):
    beams = beam_search(model, context, beam_size=1, max_length=12, length_penalty=0.0)
    greedy_captions = greedy(model, context, max_length=12)
    assert [c.ids for c in beams] == [c.ids for c in greedy_captions]
    assert [c.score for c in beams] == pytest.approx([c.score for c in greedy_captions], abs=1e-4)


def test_beam_search_finds_a_caption_at_least_as_probable_as_greedy_on_a_tiny_vocabulary(model, context):
    # With every hypothesis kept (beam >= vocab ** length), beam search is exhaustive over 2 tokens.
    vocab = len(model.tokenizer)
    best = beam_search(model, context, beam_size=vocab**2, max_length=2, length_penalty=0.0)
    first = greedy(model, context, max_length=2)
    assert all(b.score >= g.score - 1e-5 for b, g in zip(best, first))


def test_generation_stops_at_the_end_token_and_reads_back_the_caption():
    caption = "there is a blue square ."
    model = trained_to_say(caption)
    context = model.encode_images(torch.rand(2, 3, 30, 30))
    for captions in (greedy(model, context), beam_search(model, context, beam_size=3)):
        assert [c.text for c in captions] == [caption, caption]
        assert captions[0].ids[-1] == model.eos_id and len(captions[0].ids) == len(caption.split()) + 1


def test_max_length_bounds_the_caption(model, context):
    assert all(len(c.ids) <= 3 for c in greedy(model, context, max_length=3))
    assert all(len(c.ids) <= 3 for c in beam_search(model, context, beam_size=2, max_length=3))
    with pytest.raises(ValueError, match=r"max_length must be in \[1, 23\]"):
        greedy(model, context, max_length=24)
    with pytest.raises(ValueError, match="beam_size must be at least 1, got 0"):
        beam_search(model, context, beam_size=0)


def test_each_generated_word_has_each_heads_attention_over_the_image(model, context):
    for captions in (greedy(model, context, max_length=6, attention_layers=[1]),
                     beam_search(model, context, beam_size=2, max_length=6, attention_layers=[0, 1])):
        weights = captions[0].attentions[1]  # (H, words, prefix + 9 patches)
        assert weights.shape == (16, len(captions[0].ids), 10)
        torch.testing.assert_close(weights.sum(-1), torch.ones(16, len(captions[0].ids)))


def test_beam_search_keeps_each_images_attention_with_its_own_caption(model, context):
    together = beam_search(model, context, beam_size=3, max_length=5, attention_layers=[0])
    alone = beam_search(model, context.select(slice(2, 3)), beam_size=3, max_length=5, attention_layers=[0])
    assert together[2].ids == alone[0].ids
    torch.testing.assert_close(together[2].attentions[0], alone[0].attentions[0], atol=1e-5, rtol=1e-4)


def greedy_counting_rows(model, context, **options):
    """:func:`greedy`'s captions and the number of rows the decoder ran at each step."""
    rows_run = []
    hook = model.decoder.register_forward_pre_hook(lambda module, args: rows_run.append(args[0].shape[0]))
    try:
        return greedy(model, context, **options), rows_run
    finally:
        hook.remove()


def test_ended_captions_leave_the_batch_and_every_caption_is_written_as_alone(monkeypatch):
    short, long = "there is a blue square .", "a red square is left of a blue circle . there is a blue circle ."
    model = trained_to_tell_apart(short, long)
    context = model.encode_images(torch.tensor([0.0, 1.0, 0.0, 1.0])[:, None, None, None].expand(4, 3, 30, 30))
    together, rows_run = greedy_counting_rows(model, context, attention_layers=[1])
    assert [c.text for c in together] == [short, long, short, long]
    short_steps, long_steps = len(short.split()) + 1, len(long.split()) + 1  # the end token included
    assert rows_run == [4] * short_steps + [2] * (long_steps - short_steps)  # the short captions left
    for row, caption in enumerate(together):
        [alone] = greedy(model, context.select(slice(row, row + 1)), attention_layers=[1])
        assert caption.ids == alone.ids and caption.ids[-1] == model.eos_id
        assert caption.score == pytest.approx(alone.score, abs=1e-4)
        torch.testing.assert_close(caption.attentions[1], alone.attentions[1], atol=1e-5, rtol=1e-4)
    recomputed = greedy(model, context, use_cache=False)
    assert [c.ids for c in recomputed] == [c.ids for c in together]

    monkeypatch.setattr(generate, "LEAVE_AT", 0.75)  # two ended captions of four are too few to leave
    staying, rows_run = greedy_counting_rows(model, context, attention_layers=[1])
    assert rows_run == [4] * long_steps
    assert [c.ids for c in staying] == [c.ids for c in together]
    assert [c.score for c in staying] == pytest.approx([c.score for c in together], abs=1e-4)
    for caption, other in zip(staying, together):
        torch.testing.assert_close(caption.attentions[1], other.attentions[1], atol=1e-5, rtol=1e-4)

"""vlfuse.baselines.hf_vqa: transformers' BLIP-VQA and ViLT on vlfuse's batches, tiny and from scratch."""

import pytest
import torch

from vlfuse.baselines.hf_vqa import NO_ANSWER, BlipVQA, ViltVQA, after_first, blip_vqa_config, vilt_config
from vlfuse.data import IGNORE_INDEX
from vlfuse.encoders.tokenizer import build_word_tokenizer

QUESTIONS = ["what colour is the shape?", "is there a red shape?", "what shape is it?", "is it a circle?"]
ANSWERS = ["red", "blue", "circle", "yes", "no"]
SIZE, PATCH = 16, 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_word_tokenizer(QUESTIONS + ANSWERS, max_length=16)


def batch(tokenizer, n_images: int = 3, per_image: int = 2):
    """Images (Bi, 3, S, S) in [0, 1], tokenised questions (Bq, L), each question's image and its label."""
    g = torch.Generator().manual_seed(0)
    n = n_images * per_image
    tokens = tokenizer([QUESTIONS[i % len(QUESTIONS)] for i in range(n)], padding=True, return_tensors="pt")
    return (
        torch.rand(n_images, 3, SIZE, SIZE, generator=g), tokens["input_ids"], tokens["attention_mask"],
        torch.arange(n_images).repeat_interleave(per_image), torch.randint(0, len(ANSWERS), (n,), generator=g),
    )


def tiny_blip(tokenizer) -> BlipVQA:
    torch.manual_seed(0)
    config = blip_vqa_config(len(tokenizer), image_size=SIZE, patch_size=PATCH, width=32, heads=4, max_length=16,
                             pad_id=tokenizer.pad_token_id, bos_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id)
    answers = tokenizer(ANSWERS, padding=True, return_tensors="pt")
    return BlipVQA(config, answers["input_ids"], answers["attention_mask"])


def tiny_vilt(tokenizer) -> ViltVQA:
    torch.manual_seed(0)
    return ViltVQA(vilt_config(len(tokenizer), len(ANSWERS), image_size=SIZE, patch_size=PATCH, width=32, heads=4,
                               layers=1, max_length=16, pad_id=tokenizer.pad_token_id))


PEERS = {"blip_vqa": tiny_blip, "vilt": tiny_vilt}


@pytest.mark.parametrize("name", PEERS)
def test_each_peer_trains_two_steps_and_its_loss_falls(name, tokenizer, one_thread):
    model = PEERS[name](tokenizer).train()
    inputs = batch(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(3):  # two steps, then the loss after them
        loss = model.loss(*inputs)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[2] < losses[1] < losses[0], losses


@pytest.mark.parametrize("name", PEERS)
def test_each_peer_answers_each_question_with_an_index_of_the_list(name, tokenizer, one_thread):
    model = PEERS[name](tokenizer).eval()
    *inputs, _ = batch(tokenizer)
    answers = model.answer(*inputs)
    assert answers.shape == (6,) and ((answers >= NO_ANSWER) & (answers < len(ANSWERS))).all()


def test_blips_loss_equals_the_classs_forward_on_one_image_copy_per_question(tokenizer, one_thread):
    model = tiny_blip(tokenizer).eval()
    pixels, ids, mask, index, labels = batch(tokenizer)
    targets, target_mask = model.answer_ids[labels], model.answer_mask[labels]
    expected = model.hf(
        input_ids=ids, pixel_values=model.normalize(pixels)[index], attention_mask=mask, decoder_input_ids=targets,
        decoder_attention_mask=target_mask, labels=targets.masked_fill(target_mask == 0, IGNORE_INDEX),
    ).loss
    torch.testing.assert_close(model.loss(pixels, ids, mask, index, labels), expected)


def test_blips_answer_is_the_generated_texts_place_in_the_list(tokenizer, monkeypatch):
    model = tiny_blip(tokenizer)
    cls, sep, pad = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
    word = tokenizer.convert_tokens_to_ids
    generated = torch.tensor([
        [cls, word("circle"), sep],  # an answer
        [cls, word("no"), sep],  # another, with nothing after it
        [cls, word("red"), word("blue")],  # two words: no answer
        [cls, word("what"), sep],  # a word that is no answer
    ])
    monkeypatch.setattr(model, "generate", lambda *inputs: generated)
    assert model.answer(None, None, None, None).tolist() == [ANSWERS.index("circle"), ANSWERS.index("no"), NO_ANSWER, NO_ANSWER]
    generated = torch.tensor([[cls, word("yes"), sep, word("red")], [cls, word("yes"), sep, pad]])  # longer than an answer
    assert model.answer(None, None, None, None).tolist() == [ANSWERS.index("yes")] * 2


def test_after_first_marks_what_follows_each_rows_first_stop():
    tokens = torch.tensor([[1, 5, 2, 7, 2], [1, 5, 6, 7, 8]])
    assert after_first(tokens, 2).tolist() == [[False, False, False, True, True], [False] * 5]


@pytest.mark.parametrize("name", PEERS)
def test_a_questions_loss_reaches_its_own_image_only(name, tokenizer, one_thread):
    model = PEERS[name](tokenizer).eval()
    pixels, ids, mask, index, labels = batch(tokenizer)
    pixels.requires_grad_(True)
    first_image_only = labels.masked_fill(index != 0, IGNORE_INDEX)  # the questions of image 0
    model.loss(pixels, ids, mask, index, first_image_only).backward()
    reached = pixels.grad.flatten(1).abs().sum(dim=1)  # (Bi,)
    assert reached[0] > 0 and (reached[1:] == 0).all(), reached


@pytest.mark.parametrize("name", PEERS)
def test_unlabelled_questions_are_left_out_of_the_loss(name, tokenizer, one_thread):
    model = PEERS[name](tokenizer).eval()
    pixels, ids, mask, index, labels = batch(tokenizer)
    ignored = labels.clone()
    ignored[:2] = IGNORE_INDEX
    torch.testing.assert_close(model.loss(pixels, ids, mask, index, ignored),
                               model.loss(pixels[1:], ids[2:], mask[2:], index[2:] - 1, labels[2:]))


@pytest.mark.parametrize("build", [blip_vqa_config, vilt_config])
def test_a_width_the_heads_do_not_split_is_named(build):
    size = dict(image_size=SIZE, patch_size=PATCH, width=30, heads=16, pad_id=0)
    extra = dict(bos_id=1, sep_id=2) if build is blip_vqa_config else dict(num_answers=5)
    with pytest.raises(ValueError, match=r"width \(30\) must be a multiple of heads \(16\)"):
        build(10, **size, **extra)


def test_an_image_the_patches_do_not_tile_is_named():
    with pytest.raises(ValueError, match=r"image_size \(18\) must be a multiple of patch_size \(4\)"):
        vilt_config(10, 5, image_size=18, patch_size=PATCH, pad_id=0)

"""Frozen encoders keep their outputs per distinct image and question while the model trains."""

import dataclasses

import torch

from vlfuse.encoders import FeatureCache
from vlfuse.model import VLFuseModel

from conftest import tiny_config

ANSWERS = ["yes", "no", "red"]
QUESTIONS = ["is it red?", "what colour is it?", "is there a circle?"]


def frozen_model(cache: bool, freeze_text: bool = True) -> VLFuseModel:
    base = tiny_config()
    config = dataclasses.replace(
        base,
        image=dataclasses.replace(base.image, freeze=True, cache_features=cache),
        text=dataclasses.replace(base.text, freeze=freeze_text, cache_features=cache),
    )
    torch.manual_seed(0)
    return VLFuseModel.from_config(config, ANSWERS, QUESTIONS)


def batches(model: VLFuseModel):
    """Two batches sharing an image and questions: the second is partly served by the cache."""
    torch.manual_seed(1)
    images = torch.rand(3, 3, 32, 32)
    pairs = [
        (images[[0, 1]], ["is it red?", "what colour is it?", "is it red?"], torch.tensor([0, 0, 1])),
        (images[[1, 2]], ["is it red?", "is there a circle?"], torch.tensor([0, 1])),
    ]
    for pixels, questions, index in pairs:
        tokens = model.tokenize(questions)
        yield pixels, tokens["input_ids"], tokens["attention_mask"], index


def train_logits(model: VLFuseModel) -> list[torch.Tensor]:
    model.train()
    return [model(p, ids, mask, image_index=i).logits for p, ids, mask, i in batches(model)]


def test_the_cache_gives_the_same_logits_as_no_cache_and_runs_each_input_once(one_thread):
    cached, plain = frozen_model(cache=True), frozen_model(cache=False)
    assert plain.image_encoder.cache is None and plain.text_encoder.cache is None
    for _ in range(2):  # the second pass reads everything from the cache
        for with_cache, without in zip(train_logits(cached), train_logits(plain)):
            torch.testing.assert_close(with_cache, without)
    assert len(cached.image_encoder.cache) == 3  # distinct images
    assert len(cached.text_encoder.cache) == 3  # distinct questions
    assert cached.image_encoder.cache.misses == 3 and cached.image_encoder.cache.hits == 5


def test_frozen_encoders_drop_nothing_in_training_and_match_eval(one_thread):
    model = frozen_model(cache=False)  # dropout 0 in the fusion stack; the text encoder's is 0.1
    training = train_logits(model)
    model.eval()
    with torch.no_grad():
        evaluated = [model(p, ids, mask, image_index=i).logits for p, ids, mask, i in batches(model)]
    for a, b in zip(training, evaluated):
        torch.testing.assert_close(a, b)


def test_eval_mode_leaves_the_cache_alone_and_training_still_reaches_the_learning_layers(one_thread):
    model = frozen_model(cache=True)
    model.eval()
    for p, ids, mask, i in batches(model):
        model(p, ids, mask, image_index=i)
    assert len(model.image_encoder.cache) == 0  # predictors and validation do not fill memory
    loss = sum(logits.sum() for logits in train_logits(model))
    loss.backward()
    assert model.image_proj.weight.grad is not None and model.text_proj.weight.grad is not None
    assert all(p.grad is None for p in model.image_encoder.parameters())


def test_a_trainable_encoder_has_no_cache():
    model = frozen_model(cache=True, freeze_text=False)
    assert model.image_encoder.cache is not None and model.text_encoder.cache is None


def test_feature_cache_computes_each_new_key_once_per_call():
    cache = FeatureCache()
    calls = []

    def compute(rows):
        calls.append(rows)
        return [torch.tensor(float(r)) for r in rows]

    assert [t.item() for t in cache.get(["a", "b", "a"], compute)] == [0.0, 1.0, 0.0]
    assert [t.item() for t in cache.get(["b", "c"], compute)] == [1.0, 1.0]  # c computed at row 1
    assert calls == [[0, 1], [1]]
    assert (cache.hits, cache.misses, len(cache)) == (2, 3, 3)
    cache.clear()
    assert len(cache) == 0


def test_a_full_cache_still_returns_every_output_and_stores_what_fits():
    cache = FeatureCache(max_bytes=2 * 4)  # room for two float32 scalars

    def compute(rows):
        return [torch.tensor(float(r)) for r in rows]

    assert [t.item() for t in cache.get(["a", "b", "c"], compute)] == [0.0, 1.0, 2.0]
    assert (len(cache), cache.nbytes) == (2, 8)
    assert [t.item() for t in cache.get(["c", "a"], compute)] == [0.0, 0.0]  # c is computed again, at row 0
    assert cache.misses == 4 and cache.hits == 1

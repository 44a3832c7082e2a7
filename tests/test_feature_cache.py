"""Frozen encoders keep their outputs per distinct image and question while the model trains; the
loader then stops decoding images, and each distinct question is tokenized once."""

import dataclasses
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from transformers import BertConfig, BertModel

from vlfuse.data import GroupedVQADataset, ImageQuestions, collate_grouped
from vlfuse.data.answers import AnswerVocab
from vlfuse.datamodules import EasyVQADataModule
from vlfuse.encoders import FeatureCache, TextEncoder, TextEncoderConfig, TokenCache, load_tokenizer
from vlfuse.lit import VLFuseLitModule
from vlfuse.model import VLFuseModel

from conftest import tiny_config, toy_batch
from test_minilm import MINILM, needs_minilm

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
        tokens = model.processor.tokenize(questions)
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


# ------------------------------------------------------------ the loader and the tokenizer
def image_files(folder: Path, n: int) -> list[ImageQuestions]:
    """``n`` random PNG images in ``folder``, each with one question."""
    g = torch.Generator().manual_seed(2)
    records = []
    for i in range(n):
        path = folder / f"{i}.png"
        Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()).save(path)
        records.append(ImageQuestions(str(path), [QUESTIONS[i % 3]], ["yes"], image_id=str(i)))
    return records


def one_epoch(model: VLFuseModel, dataset: GroupedVQADataset) -> list[dict]:
    """The batches of one training pass over ``dataset``, each image encoded as the training step does."""
    batches = list(DataLoader(dataset, batch_size=2, collate_fn=collate_grouped))
    for batch in batches:
        model.encode_images(batch["pixel_values"], batch["image_keys"])
    return batches


def test_the_loader_stops_decoding_once_every_image_is_cached_and_decodes_when_one_is_not(tmp_path, one_thread):
    model = frozen_model(cache=True).train()
    records = image_files(tmp_path, 4)
    dataset = GroupedVQADataset(records[:3], AnswerVocab(ANSWERS), 32)
    dataset.decode_only_uncached(model.image_encoder.cache)
    assert dataset.decode_images  # nothing cached yet
    first = one_epoch(model, dataset)
    assert all(batch["pixel_values"] is not None for batch in first)
    assert first[0]["image_keys"] == [str(tmp_path / "0.png"), str(tmp_path / "1.png")]

    dataset.decode_only_uncached(model.image_encoder.cache)
    assert not dataset.decode_images
    second = one_epoch(model, dataset)
    assert all(batch["pixel_values"] is None for batch in second)
    for cached, decoded in zip(second, first):  # the cached features are the encoder's
        with_cache = model.embed_images(None, cached["image_keys"])
        model.eval()
        torch.testing.assert_close(with_cache, model.embed_images(decoded["pixel_values"]))
        model.train()
    assert model.image_encoder.cache.misses == 3

    with_new_image = GroupedVQADataset(records, AnswerVocab(ANSWERS), 32)
    with_new_image.decode_only_uncached(model.image_encoder.cache)
    assert with_new_image.decode_images
    dataset.decode_only_uncached(FeatureCache())  # e.g. the cache was cleared
    assert dataset.decode_images


def test_the_dataset_decodes_each_image_once_while_its_budget_lasts(tmp_path, monkeypatch):
    from vlfuse.data import dataset as dataset_module

    records = image_files(tmp_path, 4)
    decoded = []
    real = dataset_module.preprocess_image
    monkeypatch.setattr(dataset_module, "preprocess_image", lambda source, *how: decoded.append(source) or real(source, *how))
    one_image = 3 * 32 * 32 * 4  # bytes of a (3, 32, 32) float32 tensor
    for budget, decodes_per_epoch in [(4 * one_image, [4, 0]), (2 * one_image, [4, 2]), (0, [4, 4])]:
        dataset = GroupedVQADataset(records, AnswerVocab(ANSWERS), 32, keep_decoded_bytes=budget)
        epochs = []
        for expected in decodes_per_epoch:
            decoded.clear()
            epochs.append([dataset[i]["pixel_values"] for i in range(4)])
            assert len(decoded) == expected, budget
        for record, first, second in zip(records, *epochs):
            assert torch.equal(first, real(record.image, 32)) and torch.equal(second, first)


def test_images_held_in_memory_are_always_decoded_and_cached_by_their_pixels(one_thread):
    model = frozen_model(cache=True).train()
    records, batch = toy_batch(n_images=2)
    dataset = GroupedVQADataset(records, AnswerVocab(ANSWERS), 32)
    assert batch["image_keys"] == [None, None]
    model.encode_images(batch["pixel_values"], batch["image_keys"])
    dataset.decode_only_uncached(model.image_encoder.cache)
    assert dataset.decode_images and len(model.image_encoder.cache) == 2


def test_an_image_neither_cached_nor_given_is_an_error_naming_it(one_thread):
    model = frozen_model(cache=True).train()
    with pytest.raises(ValueError, match=r"needs pixel_values: the features of image '/data/a\.png' are not cached"):
        model.encode_images(None, ["/data/a.png"])
    with pytest.raises(ValueError, match="needs pixel_values"):
        model.eval().encode_images(None, ["/data/a.png"])


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_the_token_cache_pads_each_batch_as_the_tokenizer_does_and_tokenizes_each_question_once(padding_side):
    processor = frozen_model(cache=True).processor
    processor.tokenizer.padding_side = padding_side
    processor.token_cache.padding_side = padding_side
    batches = [["is it red?", "what colour is it?"], ["is it red?", "is it?", "is there a circle?", "is it red?"]]
    for questions in batches:
        tokens = processor.tokenize(questions, cache=True)
        expected = processor.tokenize(questions)  # no cache: the tokenizer itself
        assert tokens.keys() == expected.keys()
        for name in tokens:
            assert torch.equal(tokens[name], expected[name]), name
    assert processor.token_cache.tokens.misses == 4  # distinct questions


@needs_minilm
def test_the_token_cache_pads_as_the_minilm_tokenizer_does():
    tokenizer = load_tokenizer(MINILM)

    def tokenize(questions):
        return dict(tokenizer(list(questions), padding=True, return_tensors="pt", return_token_type_ids=False))

    cache = TokenCache(tokenize, tokenizer.pad_token_id, tokenizer.padding_side)
    for questions in (["what colour is the shape?", "is there a red circle in the image?"], ["is it?", "what colour is the shape?"]):
        tokens, expected = cache(questions), tokenize(questions)
        assert tokens.keys() == expected.keys()
        for name in tokens:
            assert torch.equal(tokens[name], expected[name]), name


def test_training_keeps_the_tokens_of_each_question_cache_or_not_and_inference_keeps_none():
    model = frozen_model(cache=False, freeze_text=False)
    assert model.text_encoder.cache is None
    lit = VLFuseLitModule(model.config)
    lit.use_model(model)
    tokens = model.processor.token_cache.tokens

    def batch(questions: list[str]) -> dict:
        return {"pixel_values": torch.rand(1, 3, 32, 32), "questions": questions,
                "image_index": torch.zeros(len(questions), dtype=torch.long)}

    lit.train()(batch(QUESTIONS + QUESTIONS[:1]))  # a training step's forward
    assert len(tokens) == len(set(QUESTIONS)) and tokens.misses == len(set(QUESTIONS))
    with torch.no_grad():
        lit.eval()(batch(["a question asked once, at inference"]))
    assert len(tokens) == len(set(QUESTIONS))
    model.processor.tokenize(["asked by a predictor"])  # the processor's default: no cache
    assert len(tokens) == len(set(QUESTIONS))


class StepLosses(Callback):
    """Test helper: the training loss of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def fit_two_epochs(cache: bool) -> tuple[L.Trainer, list[float]]:
    """Two epochs on 8 easy-VQA images, both encoders frozen, with or without the cache, and
    learning rate 0: every step sees the same weights, so the losses of both runs must agree
    (with a learning rate, Adam turns the last-bit differences of features computed in other
    batches into steps of the size of the learning rate)."""
    L.seed_everything(0, verbose=False)
    base = tiny_config()
    architecture = dataclasses.replace(
        base,
        image=dataclasses.replace(base.image, freeze=True, cache_features=cache),
        text=dataclasses.replace(base.text, freeze=True, cache_features=cache),
    )
    losses = StepLosses()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
    )
    trainer.fit(VLFuseLitModule(architecture, lr=0.0), datamodule=EasyVQADataModule(limit_images=8, batch_size=4))
    return trainer, losses.losses


def test_training_with_the_cache_stops_decoding_after_the_first_epoch_and_gives_the_same_losses(one_thread):
    trainer, with_cache = fit_two_epochs(cache=True)
    _, without = fit_two_epochs(cache=False)
    assert not trainer.train_dataloader.dataset.decode_images
    cache = trainer.lightning_module.model.image_encoder.cache
    assert (cache.misses, cache.hits) == (8, 8)  # the second epoch's batches came without pixels
    assert len(with_cache) == len(without) == 4
    assert with_cache == pytest.approx(without, rel=1e-5)


def test_frozen_encoders_are_in_eval_mode_from_the_start_as_lightning_never_calls_train():
    model = frozen_model(cache=False, freeze_text=True)  # built, never .train()-ed: as in `vlfuse fit`
    assert model.training and model.fuser.training and model.head.training
    assert not model.image_encoder.vit.training and not model.text_encoder.model.training


@pytest.mark.parametrize("freeze", [False, True])
def test_a_pretrained_text_encoder_trains_with_its_dropout_unless_frozen(tmp_path, freeze):
    """transformers' from_pretrained returns a model in eval mode, and Lightning never calls train():
    an encoder that is fine-tuned must start in training mode (dropout on), a frozen one in eval mode."""
    tiny_bert = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertModel(tiny_bert).save_pretrained(tmp_path)
    encoder = TextEncoder(TextEncoderConfig(name=str(tmp_path), freeze=freeze))
    modes = {module.training for module in encoder.model.modules()}
    assert modes == {not freeze}

"""LoRA adapters (peft) on the pretrained encoders: only the adapters train, a saved model has them merged."""

import dataclasses
import json
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel

from vlfuse.encoders import ImageEncoder, ImageEncoderConfig, TextEncoder, TextEncoderConfig, build_word_tokenizer
from vlfuse.encoders.text import layer_stack
from vlfuse.model import VLFuseModel

from conftest import COLOUR_ANSWERS, load_script, logits, tiny_config, toy_batch
from test_optimizer import optimizer_of

LORA = {"type": "lora", "rank": 4, "alpha": 8, "target_modules": ["query", "value"]}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, str]:
    """A 'pretrained' 2-layer BERT folder (with its tokenizer) and a timm weights file of the tiny
    config's ViT, both made here: their weights are random, but they load as pretrained ones do."""
    folder = tmp_path_factory.mktemp("pretrained")
    records, _ = toy_batch()
    tokenizer = build_word_tokenizer([q for r in records for q in r.questions], 16)
    torch.manual_seed(0)
    bert = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      vocab_size=len(tokenizer), max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id)
    BertModel(bert, add_pooling_layer=False).save_pretrained(folder / "bert")
    tokenizer.save_pretrained(folder / "bert")
    vit = ImageEncoder(tiny_config().image).vit
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, folder / "vit.safetensors")
    return {"text": str(folder / "bert"), "image": str(folder / "vit.safetensors")}


def lora_model(pretrained, text_adapter=LORA, image_adapter=None) -> tuple[VLFuseModel, dict]:
    image = dataclasses.replace(tiny_config().image, weights_file=pretrained["image"], adapter=image_adapter)
    text = TextEncoderConfig(name=pretrained["text"], max_length=16, adapter=text_adapter)
    torch.manual_seed(0)
    records, batch = toy_batch()
    model = VLFuseModel.from_config(tiny_config(image=image, text=text), COLOUR_ANSWERS, [q for r in records for q in r.questions])
    return model, batch


def train_steps(model: VLFuseModel, batch: dict, steps: int = 2, lr_ratios=None) -> None:
    optimizer = optimizer_of(model, lr_ratios)
    model.train()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(logits(model, batch), batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def test_the_adapters_are_the_only_trainable_weights_of_the_encoders(pretrained, one_thread):
    model, _ = lora_model(pretrained, image_adapter={"type": "lora", "rank": 2, "target_modules": ["qkv"]})
    for encoder in ("text_encoder", "image_encoder"):
        trainable = [n for n, p in model.named_parameters() if n.startswith(encoder + ".") and p.requires_grad]
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    text_lora = [n for n, p in model.text_encoder.named_parameters() if p.requires_grad]
    assert len(text_lora) == 2 * 2 * 2  # 2 layers x (query, value) x (A, B)
    scratch = [n for n, p in model.named_parameters() if not n.startswith(("text_encoder.", "image_encoder."))]
    assert scratch and all(p.requires_grad for n, p in model.named_parameters() if n in scratch)


def test_a_step_changes_the_adapters_and_the_new_layers_not_the_pretrained_weights(pretrained, one_thread):
    model, batch = lora_model(pretrained)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_steps(model, batch, steps=1, lr_ratios={"text_encoder": 0.5})
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and not changed & frozen
    assert any(".lora_B." in n for n in changed)  # B starts at zero and gets the first gradient
    assert any(n.startswith("head.") for n in changed) and any(n.startswith("image_encoder.") for n in changed)


def test_lr_ratios_set_the_rate_of_the_adapters(pretrained):
    model, _ = lora_model(pretrained)
    rates = {id(p): group["initial_lr"] for group in optimizer_of(model, {"text_encoder": 0.25}).param_groups for p in group["params"]}
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert rates[id(param)] == pytest.approx(1e-3 * (0.25 if name.startswith("text_encoder.") else 1.0)), name
        else:
            assert id(param) not in rates, name


@pytest.mark.parametrize("text_adapter", [LORA, {**LORA, "layers": [1]}], ids=["every layer", "layer 1, layer 0 cached"])
def test_a_saved_model_has_its_adapters_merged_and_answers_the_same_without_peft(pretrained, text_adapter, tmp_path, monkeypatch, one_thread):
    model, batch = lora_model(pretrained, text_adapter, image_adapter={"type": "lora", "rank": 2, "target_modules": ["qkv", "fc1"]})
    train_steps(model, batch)
    expected = logits(model, batch).detach()
    saved = model.save_pretrained(tmp_path / "model")
    assert model.config.text.adapter is not None and ".lora_A." in "".join(n for n, _ in model.named_parameters())  # still adapted
    config = json.loads((saved / "config.json").read_text())["config"]
    assert config["text"]["adapter"] is None and config["image"]["adapter"] is None
    monkeypatch.setitem(sys.modules, "peft", None)  # any import of peft now fails
    reloaded = VLFuseModel.from_pretrained(saved)
    assert not any("lora" in n or "base_layer" in n for n in reloaded.state_dict())
    assert sorted(reloaded.state_dict()) == sorted(VLFuseModel.from_pretrained(saved).state_dict())
    got = logits(reloaded, batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(
    "adapter, message",
    [
        ({"type": "loha"}, r"text.adapter.type must be one of \['lora'\], got 'loha'"),
        ({"rank": 0}, r"text.adapter.rank must be between 1 and"),
        ({"rank": "8"}, r"text.adapter.rank must be int, got '8'"),
        ({"alpha": -1}, r"text.adapter.alpha must be positive"),
        ({"dropout": 1.0}, r"text.adapter.dropout must be in \[0, 1\)"),
        ({"target_modules": []}, r"text.adapter.target_modules must be a non-empty list"),
        ({"layers": []}, r"text.adapter.layers must name at least one layer"),
        ({"r": 8}, r"text.adapter: a adapter of type 'lora' has no option r \(its options: rank, alpha"),
        (8, r"text.adapter must be a mapping with a type and its options, got 8"),
    ],
)
def test_a_bad_adapter_option_is_named(adapter, message):
    with pytest.raises(ValueError, match=message):
        TextEncoderConfig(name="some/encoder", adapter=adapter)


def test_an_adapter_needs_a_pretrained_encoder_that_is_not_frozen():
    with pytest.raises(ValueError, match="text.adapter adapts a pretrained encoder: set text.name"):
        TextEncoderConfig(adapter=LORA)
    with pytest.raises(ValueError, match="text.adapter trains the encoder through its adapter, text.freeze keeps it fixed"):
        TextEncoderConfig(name="some/encoder", freeze=True, adapter=LORA)
    with pytest.raises(ValueError, match="image.adapter adapts pretrained weights: set image.pretrained or image.weights_file"):
        ImageEncoderConfig(adapter=LORA)


@pytest.mark.parametrize(
    "adapter, message",
    [
        ({**LORA, "target_modules": ["querry"]}, r"text.adapter.target_modules \['querry'\] match no linear layer .* \['dense', 'key', 'query', 'value'\]"),
        ({**LORA, "layers": [2]}, r"text.adapter.layers names layers \[2\], but the encoder has layers 0..1"),
    ],
)
def test_adapter_options_that_match_nothing_in_the_encoder_are_named(pretrained, adapter, message):
    with pytest.raises(ValueError, match=message):
        lora_model(pretrained, text_adapter=adapter)


def test_a_vit_needs_its_target_modules_named(pretrained):
    with pytest.raises(ValueError, match=r"image.adapter.target_modules: peft knows no default for this encoder.*'qkv'"):
        lora_model(pretrained, image_adapter={"type": "lora"})


def test_adapting_only_the_upper_layers_trains_only_theirs(pretrained, one_thread):
    model, _ = lora_model(pretrained, text_adapter={**LORA, "layers": [1]})
    trainable = [n for n, p in model.text_encoder.named_parameters() if p.requires_grad]
    assert trainable and all(".layer.1." in n for n in trainable), trainable


def test_the_benchmark_table_sets_each_seeds_wall_clock_against_full_fine_tuning():
    bench = load_script("bench_lora")
    assert bench.ALL_ROW.search("| exists shape | 10 | 90.0% | 80.0% |\n| all | 3000 | **99.69%** | **93.64%** |")["reworded"] == "93.64"
    runs = [dict(variant="full", seed=0, seconds=600.0, test=0.99, reworded=0.94), dict(variant="lora", seed=0, seconds=300.0, test=0.98, reworded=0.95),
            dict(variant="full", seed=1, seconds=500.0, test=0.97, reworded=0.92), dict(variant="lora", seed=1, seconds=400.0, test=0.99, reworded=0.90)]
    table = bench.report(runs)
    assert "| lora | 0 | 98.00% | 95.00% | 5 min 00 s | 0.50 |" in table
    assert "| lora | 1 | 99.00% | 90.00% | 6 min 40 s | 0.80 |" in table
    assert "| lora | 2 | 98.50% / 98.00% | 92.50% / 90.00% | 0.65 / 0.80 |" in table
    alone = bench.report(runs[1::2])  # --variants lora: no full fine-tuning in the run, no ratio
    assert "| lora | 1 | 99.00% | 90.00% | 6 min 40 s | - |" in alone
    assert "| lora | 2 | 98.50% / 98.00% | 92.50% / 90.00% | - |" in alone and "| full |" not in alone


def no_dropout(module: torch.nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def test_the_layers_below_the_adapted_ones_run_once_per_question_and_give_what_the_whole_encoder_gives(pretrained, one_thread):
    model, batch = lora_model(pretrained, text_adapter={**LORA, "layers": [1]})
    encoder = model.text_encoder
    assert encoder.frozen_layers == 1 and encoder.cache is not None
    model.train()
    embeddings, layers = layer_stack(encoder.model, "text.adapter.layers")
    assert not embeddings.training and not layers[0].training and layers[1].training
    assert not any(name.startswith(("_embeddings", "_layers")) for name in encoder.state_dict())
    no_dropout(encoder)
    inputs = model.processor.batch(batch)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    trained = encoder(ids, mask)
    distinct = len({tuple(row[keep].tolist()) for row, keep in zip(ids, mask.bool())})
    assert (encoder.cache.misses, len(encoder.cache)) == (distinct, distinct)
    again = encoder(ids, mask)
    assert encoder.cache.misses == distinct and encoder.cache.hits == 2 * len(ids) - distinct
    model.eval()
    whole = encoder(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(trained[real], whole[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again[real], whole[real], atol=1e-5, rtol=1e-5)


def test_with_the_lower_layers_cached_the_gradient_still_reaches_the_adapters_and_a_step_lowers_the_loss(pretrained, one_thread):
    model, batch = lora_model(pretrained, text_adapter={**LORA, "layers": [1]})
    model.train()
    loss = torch.nn.functional.cross_entropy(logits(model, batch), batch["labels"])
    loss.backward()
    grads = {n: p.grad for n, p in model.text_encoder.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for n, g in grads.items() if ".lora_A." in n or ".lora_B." in n)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)
    losses = []
    optimizer = optimizer_of(model, {"text_encoder": 1.0})
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(logits(model, batch), batch["labels"])
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("adapter, cache_features", [(LORA, True), ({**LORA, "layers": [0, 1]}, True), ({**LORA, "layers": [1]}, False)])
def test_nothing_is_cached_when_every_layer_is_adapted_or_caching_is_off(pretrained, adapter, cache_features):
    text = TextEncoderConfig(name=pretrained["text"], max_length=16, adapter=adapter, cache_features=cache_features)
    encoder = TextEncoder(text)
    assert encoder.frozen_layers == 0 and encoder.cache is None
    assert all(m.training for m in encoder.model.modules())


def test_caching_the_lower_layers_of_an_encoder_that_is_not_bert_like_is_an_error_naming_the_option(tmp_path):
    config = DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=50, max_position_embeddings=32)
    DistilBertModel(config).save_pretrained(tmp_path / "distil")
    text = TextEncoderConfig(name=str(tmp_path / "distil"), adapter={**LORA, "target_modules": ["q_lin", "v_lin"], "layers": [1]})
    with pytest.raises(ValueError, match=r"text\.adapter\.layers: caching .* BERT-like .* not DistilBertModel; set text\.cache_features false"):
        TextEncoder(text)
    assert TextEncoder(dataclasses.replace(text, cache_features=False)).cache is None

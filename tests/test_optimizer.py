"""AdamW groups: weight decay by parameter kind, learning rate by part of the model (lr_ratios)."""

from types import SimpleNamespace

import pytest
from lightning.pytorch.utilities import AttributeDict

from vlfuse.lit import adamw_warmup_cosine

from conftest import make_model

HPARAMS = AttributeDict(lr=1e-3, weight_decay=0.05, warmup_ratio=0.1, min_lr_ratio=0.01)


def optimizer_of(model, lr_ratios=None):
    module = SimpleNamespace(hparams=HPARAMS, trainer=SimpleNamespace(estimated_stepping_batches=100))
    return adamw_warmup_cosine(module, model, lr_ratios)["optimizer"]


def settings_by_parameter(optimizer) -> dict[int, tuple[float, float]]:
    """``{id(parameter): (peak learning rate, weight decay)}``, each parameter in exactly one group."""
    settings = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert id(param) not in settings
            settings[id(param)] = (group["initial_lr"], group["weight_decay"])
    return settings


def test_a_named_part_learns_at_its_ratio_of_the_rate_and_the_rest_at_the_rate():
    model, _ = make_model()
    settings = settings_by_parameter(optimizer_of(model, {"text_encoder": 0.025}))
    for name, param in model.named_parameters():
        lr, decay = settings[id(param)]
        assert lr == pytest.approx(1e-3 * (0.025 if name.startswith("text_encoder.") else 1.0)), name
        assert decay == (0.0 if param.ndim <= 1 or name.endswith(("pos_embed", "cls_token")) else 0.05), name
    assert len(settings) == sum(1 for p in model.parameters() if p.requires_grad)


def test_without_ratios_every_parameter_learns_at_the_rate():
    model, _ = make_model()
    assert {lr for lr, _ in settings_by_parameter(optimizer_of(model)).values()} == {1e-3}


def test_a_ratio_for_a_part_the_model_lacks_is_refused_with_its_parts():
    model, _ = make_model()
    with pytest.raises(ValueError, match=r"lr_ratios names no submodule of the model: \['text_encodr'\]; its parts are .*'text_encoder'"):
        optimizer_of(model, {"text_encodr": 0.1})


def test_where_named_parts_nest_the_inner_one_sets_the_rate_whatever_the_order():
    model, _ = make_model()
    inner = "text_encoder.model.embeddings"
    for ratios in ({"text_encoder": 0.1, inner: 0.5}, {inner: 0.5, "text_encoder": 0.1}):
        settings = settings_by_parameter(optimizer_of(model, ratios))
        for name, param in model.named_parameters():
            expected = 0.5 if name.startswith(inner + ".") else 0.1 if name.startswith("text_encoder.") else 1.0
            assert settings[id(param)][0] == pytest.approx(1e-3 * expected), name


def test_the_whole_model_is_not_a_named_part():
    model, _ = make_model()
    with pytest.raises(ValueError, match=r"lr_ratios names no submodule of the model: \[''\]"):
        optimizer_of(model, {"": 0.1})

"""The attention options of the fusion blocks: dropout, the LeakyReLU normaliser, head diversity."""

import json

import pytest
import torch
import torch.nn.functional as F

from vlfuse import CrossAttention, FusionStack
from vlfuse.layers import OutputGate, attention_core, head_diversity, leaky_relu_normalize, softmax_normalize
from vlfuse.layers.attention import LEAKY_SLOPE
from vlfuse.model import VLFuseConfig, VLFuseModel
from vlfuse.model_io import parts_of_flat

from conftest import REPO, logits, make_model, tiny_cli_args, tiny_config


def inputs(b=3, lq=5, lk=7, dim=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, lq, dim, generator=g), torch.randn(b, lk, dim, generator=g)


def make(**kw):
    torch.manual_seed(0)
    return CrossAttention(32, 4, **kw)


# ----------------------------------------------------------------------------- the LeakyReLU normaliser
def test_leaky_relu_normaliser_follows_its_definition():
    scores = torch.tensor([[2.0, 0.5, -1.0, -3.0]])
    a = torch.tensor([2.0, 0.5, -LEAKY_SLOPE, -3 * LEAKY_SLOPE])
    lifted = 1 + a - a.min()
    torch.testing.assert_close(leaky_relu_normalize(scores), (lifted / lifted.sum())[None])
    # Masked keys get exactly 0, and the floor is the lowest *allowed* score.
    mask = torch.tensor([[True, True, False, False]])
    torch.testing.assert_close(leaky_relu_normalize(scores, mask), torch.tensor([[2.5 / 3.5, 1 / 3.5, 0.0, 0.0]]))


@pytest.mark.parametrize(
    "scores",
    [torch.full((1, 5), -4.0), torch.full((1, 5), 3.0), torch.tensor([[-9.0, -2.0, -5.0, -0.1, -7.0]])],
    ids=["all equal negative", "all equal positive", "all negative"],
)
def test_leaky_relu_normaliser_is_well_defined_for_awkward_rows(scores):
    w = leaky_relu_normalize(scores)
    assert torch.all(w >= 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(1))
    if torch.all(scores == scores[0, 0]):
        torch.testing.assert_close(w, torch.full_like(w, 0.2))


def test_leaky_relu_normaliser_gives_zero_weights_and_finite_gradients_for_a_row_without_keys():
    scores = torch.randn(2, 3, 6, requires_grad=True)
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    mask[1] = False
    w = leaky_relu_normalize(scores, mask)
    assert torch.all(w[1] == 0)
    torch.testing.assert_close(w[0].sum(-1), torch.ones(3))
    (w * torch.randn_like(w)).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert scores.grad[0].abs().sum() > 0


def test_negative_scores_keep_a_gradient():
    """Unlike a ReLU, the normaliser's weights still move when only negative scores change."""
    scores = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    leaky_relu_normalize(scores)[0, 0].backward()
    assert scores.grad.abs().sum() > 0


@pytest.mark.parametrize("use_sdpa", [True, False])
def test_leaky_relu_attention_uses_its_weights_and_never_nans(use_sdpa):
    attn = make(normalizer="leaky_relu").train()
    attn.use_sdpa = use_sdpa  # ignored: the LeakyReLU normaliser always takes the explicit path
    x, ctx = inputs()
    x.requires_grad_(True)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2] = False  # a row with nothing to attend
    out, w = attn(x, ctx, context_mask=mask, need_weights=True)
    assert torch.all(w[0, :, :, 4:] == 0) and torch.all(w[2] == 0)
    torch.testing.assert_close(w[:2].sum(-1), torch.ones(2, 4, 5))
    # The output is these weights applied to the values (no softmax anywhere).
    kv = attn.project_context(ctx, mask)
    heads = (w @ kv.value).transpose(1, 2).reshape(3, 5, 32)  # (B, Lq, H * hd)
    expected = attn.out_proj(heads).masked_fill(~mask.any(-1)[:, None, None], 0.0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    assert torch.all(out[2] == 0)
    out.pow(2).sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_softmax_default_is_unchanged_and_stays_on_sdpa(monkeypatch):
    attn = make().eval()
    assert attn.normalizer == "softmax"
    x, ctx = inputs()
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    out = attn(x, ctx)
    assert calls == [1]
    kv = attn.project_context(ctx)
    q = attn.split_heads(attn.q_proj(x))
    core, _ = attention_core(q, kv.key, kv.value)  # the default core: SDPA, bit for bit
    assert torch.equal(out, attn.out_proj(core.transpose(1, 2).reshape(3, 5, 32)))


def test_unknown_normaliser_is_refused():
    with pytest.raises(ValueError, match=r"normalizer must be one of \('softmax', 'leaky_relu'\), got 'sparsemax'"):
        CrossAttention(32, 4, normalizer="sparsemax")
    with pytest.raises(ValueError, match="normalizer must be one of"):
        FusionStack(1, 32, 4, attention_normalizer="relu")
    with pytest.raises(ValueError, match=r"fuser\.normalizer must be one of \['softmax', 'leaky_relu'\], got 'relu'"):
        tiny_config(fuser={"normalizer": "relu"})


def test_the_normaliser_is_chosen_once_and_only_softmax_keeps_sdpa(monkeypatch):
    """The layer holds its normaliser function; the explicit path applies it, SDPA only replaces softmax."""
    assert make().normalize is softmax_normalize and make(normalizer="leaky_relu").normalize is leaky_relu_normalize
    q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)
    mask = torch.rand(2, 1, 1, 5, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[..., 0] = True
    scores = q @ k.transpose(-2, -1) / 8**0.5
    for normalize in (softmax_normalize, leaky_relu_normalize):
        out, w = attention_core(q, k, v, mask, need_weights=True, normalize=normalize)
        torch.testing.assert_close(w, normalize(scores, mask))
        torch.testing.assert_close(out, w @ v)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    fast, none = attention_core(q, k, v, mask)
    assert calls == [1] and none is None
    torch.testing.assert_close(fast, softmax_normalize(scores, mask) @ v)
    attention_core(q, k, v, mask, normalize=leaky_relu_normalize)
    assert calls == [1]  # a normaliser SDPA does not compute takes the explicit path


# ----------------------------------------------------------------------------- attention dropout
@pytest.mark.parametrize("normalizer", ["softmax", "leaky_relu"])
@pytest.mark.parametrize("use_sdpa", [True, False])
def test_attention_dropout_is_active_in_training_unbiased_and_nan_free(use_sdpa, normalizer):
    attn = make(dropout=0.5, normalizer=normalizer)
    attn.use_sdpa = use_sdpa
    x, ctx = inputs()
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1] = False
    clean = attn.eval()(x, ctx, context_mask=mask)
    attn.train()
    torch.manual_seed(0)
    first, second = attn(x, ctx, context_mask=mask), attn(x, ctx, context_mask=mask)
    assert not torch.allclose(first, second)
    mean = torch.stack([attn(x, ctx, context_mask=mask) for _ in range(200)]).mean(0)
    assert torch.isfinite(mean).all() and torch.all(mean[1] == 0)
    # Inverted dropout: the expectation is the clean output (the mean of 200 draws is close to it).
    assert (mean - clean).abs().max() < 0.15 * clean.abs().max()
    torch.testing.assert_close(attn.eval()(x, ctx, context_mask=mask), clean)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.3, 0.5])
def test_attention_dropout_and_normaliser_reach_every_attention_of_the_model(p):
    model, batch = make_model(fuser={"attn_dropout": p, "normalizer": "leaky_relu", "self_attention": True})
    for block in model.fuser.stack.blocks:
        for attn in (block.self_attn, block.cross_attn):
            assert attn.dropout == p and attn.normalizer == "leaky_relu"
    out = logits(model.train(), batch)
    assert torch.isfinite(out).all()


def test_new_options_are_saved_and_old_configs_load_with_defaults(tmp_path):
    model, batch = make_model(fuser={"attn_dropout": 0.3, "normalizer": "leaky_relu", "diversity_weight": 0.2})
    directory = model.eval().save_pretrained(tmp_path / "m")
    loaded = VLFuseModel.from_pretrained(directory)
    assert loaded.config.fuser.normalizer == "leaky_relu" and loaded.config.fuser.diversity_weight == 0.2
    assert loaded.config.fuser.attn_dropout == 0.3
    torch.testing.assert_close(logits(loaded, batch), logits(model, batch), atol=0, rtol=0)
    current = tiny_config().to_dict()
    del current["fuser"]["normalizer"], current["fuser"]["diversity_weight"]  # a fuser that does not set them
    config = VLFuseConfig.from_dict(json.loads(json.dumps(current)))
    assert config.fuser.normalizer == "softmax" and config.fuser.diversity_weight == 0.0
    # A flat config.json (formats 1 and 2) from before these options.
    old = {"fusion_dim": 32, "fusion_depth": 2, "fusion_heads": 16, "readout": "pool"}
    config = VLFuseConfig.from_dict(parts_of_flat(old))
    assert config.fuser.type == "fusion_stack"
    assert config.fuser.normalizer == "softmax" and config.fuser.diversity_weight == 0.0


# ----------------------------------------------------------------------------- head diversity
def test_diversity_is_zero_for_orthogonal_heads_and_one_for_identical_heads():
    orthogonal = torch.eye(4)[None, :, None, :].expand(2, 4, 3, 4)  # head h attends key h only
    assert head_diversity(orthogonal).item() == 0.0
    disjoint = torch.zeros(1, 2, 1, 6)
    disjoint[0, 0, 0, :3], disjoint[0, 1, 0, 3:] = 1 / 3, 1 / 3
    assert head_diversity(disjoint).item() == 0.0
    identical = torch.rand(2, 1, 3, 5).softmax(-1).expand(2, 4, 3, 5)
    torch.testing.assert_close(head_diversity(identical), torch.tensor(1.0))


def test_diversity_is_the_mean_pairwise_cosine_over_real_queries():
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(2, 3, 4, 5, generator=g).softmax(-1)
    query_mask = torch.tensor([[True, True, False, True], [True, False, False, False]])
    values = []
    for b in range(2):
        for q in range(4):
            if query_mask[b, q]:
                pairs = [
                    F.cosine_similarity(weights[b, h, q], weights[b, other, q], dim=0)
                    for h in range(3)
                    for other in range(h + 1, 3)
                ]
                values.append(torch.stack(pairs).mean())
    torch.testing.assert_close(head_diversity(weights, query_mask), torch.stack(values).mean())


def test_diversity_skips_rows_without_keys_keeps_gradients_finite_and_checks_arguments():
    weights = torch.rand(2, 3, 4, 5).softmax(-1)
    weights[1, :, 2] = 0  # a query with no key to attend
    weights.requires_grad_(True)
    kept = torch.ones(2, 4, dtype=torch.bool)
    kept[1, 2] = False
    value = head_diversity(weights)
    torch.testing.assert_close(value, head_diversity(weights.detach(), kept))
    value.backward()
    assert torch.isfinite(weights.grad).all() and weights.grad.abs().sum() > 0
    assert head_diversity(torch.rand(2, 1, 3, 4)).item() == 0.0  # one head: no pair
    with pytest.raises(ValueError, match="weights must be"):
        head_diversity(torch.rand(3, 4, 5))
    with pytest.raises(ValueError, match="query_mask must be"):
        head_diversity(torch.rand(2, 3, 4, 5), torch.ones(2, 4))


def test_the_model_returns_the_diversity_only_when_training_with_a_weight():
    model, batch = make_model(fuser={"diversity_weight": 0.5})
    inputs = model.processor.batch(batch)
    out = model.train()(**inputs, weights_from=[1])
    assert out.head_diversity.shape == () and 0 <= out.head_diversity.item() <= 1
    # The fuser's auxiliary loss (which the training loss adds) is the weighted penalty.
    torch.testing.assert_close(out.auxiliary_loss, 0.5 * out.head_diversity)
    assert list(out.attentions) == [1]  # the layers asked for, not every layer the penalty read
    out.head_diversity.backward()
    grads = [block.cross_attn.q_proj.weight.grad for block in model.fuser.stack.blocks]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    evaluated = model.eval()(**inputs)
    assert evaluated.head_diversity is None and evaluated.auxiliary_loss is None
    plain, _ = make_model()
    trained = plain.train()(**inputs)
    assert trained.head_diversity is None and trained.auxiliary_loss is None
    with pytest.raises(ValueError, match=r"fuser\.diversity_weight must be >= 0"):
        make_model(fuser={"diversity_weight": -1.0})


def test_stack_of_leaky_relu_blocks_trains():
    torch.manual_seed(0)
    stack = FusionStack(2, 32, 4, kv_dim=24, gated=False, attention_normalizer="leaky_relu").train()
    x, img = torch.randn(2, 6, 32), torch.randn(2, 9, 24)
    out, weights = stack(x, img, weights_from=[0])
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(2, 4, 6))
    out.pow(2).sum().backward()
    for name, p in stack.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_training_logs_the_head_diversity(tmp_path):
    from vlfuse.cli import run_lightning

    args = [
        "fit", "--config", str(REPO / "configs" / "easy_vqa.yaml"), *tiny_cli_args(tmp_path),
        "--test_after_fit=false", "--trainer.fast_dev_run=true",
        "--model.architecture.fuser.diversity_weight=0.1", "--model.architecture.fuser.normalizer=leaky_relu",
        "--model.architecture.fuser.attn_dropout=0.3",
    ]
    cli = run_lightning(args)
    metrics = cli.trainer.callback_metrics
    assert 0 <= float(metrics["train/head_diversity_step"]) <= 1
    assert cli.model.model.fuser.stack.blocks[0].cross_attn.normalizer == "leaky_relu"
    assert cli.model.model.fuser.stack.blocks[0].cross_attn.dropout == 0.3


# ----------------------------------------------------------------------------- the output gate
def concatenated_heads(attn, x, ctx, zeroed_heads=()):
    """Reference: the heads' outputs by hand, ``zeroed_heads`` set to 0, concatenated: (B, Lq, H * hd)."""
    q = attn.split_heads(attn.q_proj(x))
    kv = attn.project_context(ctx)
    per_head, _ = attention_core(q, kv.key, kv.value)  # (B, H, Lq, hd)
    per_head[:, list(zeroed_heads)] = 0
    b, h, lq, hd = per_head.shape
    return per_head.transpose(1, 2).reshape(b, lq, h * hd)


def test_output_gate_multiplies_each_channel_by_a_sigmoid_of_the_query():
    gated = make(output_gate=True)
    x, ctx = inputs()
    plain = make()
    shared = {k: v for k, v in gated.state_dict().items() if not k.startswith("gate_proj")}
    plain.load_state_dict(shared)  # the same q/kv/out projections, no gate
    assert gated.gate_proj is not None and plain.gate_proj is None
    # Reference: the heads' concatenated outputs times sigmoid(x W_g + b_g), then out_proj.
    merged = concatenated_heads(plain, x, ctx)
    expected = plain.out_proj(merged * torch.sigmoid(x @ gated.gate_proj.weight.T + gated.gate_proj.bias))
    torch.testing.assert_close(gated(x, ctx), expected, atol=1e-5, rtol=0)
    # A zero gate projection halves every channel: out_proj(0.5 m) = 0.5 (W m) + b.
    torch.nn.init.zeros_(gated.gate_proj.weight)
    half = plain.out_proj(0.5 * merged)
    torch.testing.assert_close(gated(x, ctx), half, atol=1e-5, rtol=0)
    assert "output_gate=True" in repr(gated)


def test_parameter_names_are_those_of_saved_models():
    """Saved models (format version 1) name these parameters; the refactored layer must too."""
    names = ["q_proj.weight", "q_proj.bias", "kv_proj.weight", "kv_proj.bias", "out_proj.weight", "out_proj.bias"]
    assert list(make().state_dict()) == names
    assert list(make(output_gate=True, normalizer="leaky_relu").state_dict()) == names + ["gate_proj.weight", "gate_proj.bias"]


def test_output_gate_works_on_every_path_and_trains():
    attn = make(output_gate=True)
    x, ctx = inputs()
    sdpa = attn(x, ctx)
    attn.use_sdpa = False
    explicit, weights = attn(x, ctx, need_weights=True)
    torch.testing.assert_close(sdpa, explicit, atol=1e-5, rtol=0)
    index = torch.tensor([0, 0, 1])  # three query rows over two shared contexts
    shared = attn(x, ctx[:2], context_index=index)
    torch.testing.assert_close(shared, attn(x, ctx[index]), atol=1e-5, rtol=0)
    attn(x, ctx).square().sum().backward()
    assert attn.gate_proj.weight.grad is not None and attn.gate_proj.weight.grad.abs().sum() > 0


def test_pruning_a_gated_attention_removes_those_heads_and_their_gates():
    attn = make(output_gate=True)
    x, ctx = inputs()
    gate = torch.sigmoid(x @ attn.gate_proj.weight.T + attn.gate_proj.bias)
    expected = attn.out_proj(concatenated_heads(attn, x, ctx, zeroed_heads=[1, 3]) * gate)
    attn.prune_heads([1, 3])
    assert attn.gate_proj.weight.shape == (16, 32) and isinstance(attn.gate_proj, OutputGate)
    torch.testing.assert_close(attn(x, ctx), expected, atol=1e-5, rtol=0)


def test_output_gate_and_swiglu_reach_the_model_and_survive_save_and_load(tmp_path):
    model, batch = make_model(fuser={"output_gate": True, "mlp": "swiglu", "self_attention": True})
    for block in model.fuser.stack.blocks:
        assert block.self_attn.gate_proj is not None and block.cross_attn.gate_proj is not None
    directory = model.eval().save_pretrained(tmp_path / "m")
    loaded = VLFuseModel.from_pretrained(directory)
    assert loaded.config.fuser.output_gate and loaded.config.fuser.mlp == "swiglu"
    torch.testing.assert_close(logits(loaded, batch), logits(model, batch), atol=0, rtol=0)
    loaded.prune_heads({0: [1, 5], 1: [0]})  # the gate rows go with their heads, and stay gone
    pruned = loaded.save_pretrained(tmp_path / "pruned")
    reloaded = VLFuseModel.from_pretrained(pruned)
    cross_attn = reloaded.fuser.stack.blocks[0].cross_attn
    assert cross_attn.gate_proj.weight.shape[0] == 14 * cross_attn.head_dim
    torch.testing.assert_close(logits(reloaded, batch), logits(loaded, batch), atol=0, rtol=0)
    # A flat config.json (formats 1 and 2) from before these options: the model it was, ungated GELU MLPs.
    old = {"fusion_dim": 32, "fusion_depth": 2, "fusion_heads": 16, "readout": "bilinear"}
    config = VLFuseConfig.from_dict(parts_of_flat(old))
    assert not config.fuser.output_gate and config.fuser.mlp == "gelu"

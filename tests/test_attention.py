import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from vlfuse import CrossAttention
from vlfuse.layers import CausalSelfAttention, LocalSelfAttention, MultiHeadAttention, SelfAttention, sliding_window
from vlfuse.layers.attention import attention_core

ATOL = 1e-5


def make(dim=32, heads=4, kv_dim=None, seed=0, **kw):
    torch.manual_seed(seed)
    attn = CrossAttention(dim, heads, kv_dim=kv_dim, **kw)
    # Non-zero biases, so bias handling is exercised too.
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return attn.eval()


def inputs(b=3, lq=5, lk=7, dim=32, kv_dim=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, lq, dim, generator=g), torch.randn(b, lk, kv_dim, generator=g)


@pytest.mark.parametrize("kv_dim", [32, 48])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_torch_multihead_attention(kv_dim, with_mask, bias):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True, kdim=kv_dim, vdim=kv_dim, bias=bias).eval()
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)
    attn = CrossAttention.from_torch(mha).eval()
    x, ctx = inputs(kv_dim=kv_dim)
    mask = torch.rand(3, 7, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[:, 0] = True  # every row keeps a key: nn.MultiheadAttention gives NaN otherwise
    expected, expected_w = mha(
        x, ctx, ctx, key_padding_mask=~mask if with_mask else None, need_weights=True, average_attn_weights=False
    )
    out, w = attn(x, ctx, context_mask=mask if with_mask else None, need_weights=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(w, expected_w, atol=ATOL, rtol=0)
    torch.testing.assert_close(attn(x, ctx, context_mask=mask if with_mask else None), expected, atol=ATOL, rtol=0)


def test_sdpa_and_explicit_paths_agree():
    attn = make(kv_dim=24)
    x, ctx = inputs(kv_dim=24)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 3:] = False
    fast = attn(x, ctx, context_mask=mask)
    attn.use_sdpa = False
    slow = attn(x, ctx, context_mask=mask)
    torch.testing.assert_close(fast, slow, atol=ATOL, rtol=0)


def test_masked_keys_get_no_weight_and_weights_sum_to_one():
    attn = make()
    x, ctx = inputs()
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, 4:] = False
    _, w = attn(x, ctx, context_mask=mask, need_weights=True)
    assert w.shape == (3, 4, 5, 7)
    assert torch.all(w[0, :, :, 4:] == 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 5))
    # Masked keys do not influence the output: changing them changes nothing.
    ctx2 = ctx.clone()
    ctx2[0, 4:] += 100.0
    torch.testing.assert_close(attn(x, ctx, context_mask=mask), attn(x, ctx2, context_mask=mask))


@pytest.mark.parametrize("use_sdpa", [True, False])
def test_fully_masked_rows_give_zero_output_and_finite_gradients(use_sdpa):
    attn = make().train()
    attn.use_sdpa = use_sdpa
    x, ctx = inputs()
    x.requires_grad_(True)
    ctx.requires_grad_(True)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1] = False
    out = attn(x, ctx, context_mask=mask)
    assert torch.isfinite(out).all()
    assert torch.all(out[1] == 0)
    assert out[0].abs().sum() > 0
    out.sum().backward()
    grads = [x.grad, ctx.grad] + [p.grad for p in attn.parameters()]
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(x.grad[1] == 0)
    _, w = attn(x, ctx, context_mask=mask, need_weights=True)
    assert torch.all(w[1] == 0) and torch.isfinite(w).all()


def test_every_parameter_receives_a_gradient():
    attn = make(kv_dim=24).train()
    x, ctx = inputs(kv_dim=24)
    attn(x, ctx).pow(2).sum().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_projected_context_is_reusable():
    attn = make(kv_dim=24)
    _, ctx = inputs(b=2, kv_dim=24)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    kv = attn.project_context(ctx, mask)
    for seed in range(3):
        x = torch.randn(2, 4 + seed, 32, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(attn(x, kv=kv), attn(x, ctx, context_mask=mask))


def test_a_lora_adapter_on_kv_proj_changes_the_keys_and_values_as_its_merged_weight_does():
    """peft wraps kv_proj in a module of its own; the layer must call it, not read its base weight."""
    peft = pytest.importorskip("peft")
    attn = make(kv_dim=24).eval()
    x, ctx = inputs(b=2, kv_dim=24)
    plain = attn(x, ctx)
    adapted = peft.get_peft_model(attn, peft.LoraConfig(r=4, target_modules=["kv_proj"], init_lora_weights=False))
    with torch.no_grad():
        out = adapted(x, ctx)
    assert (out - plain).abs().max() > 1e-3  # the adapter is not left out
    merged = adapted.merge_and_unload()  # a plain nn.Linear again, with the adapter in its weight
    assert type(merged.kv_proj) is nn.Linear
    torch.testing.assert_close(merged(x, ctx), out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_sdpa", [True, False])
def test_shared_contexts_equal_repeated_contexts(use_sdpa):
    """Several questions about one image: context_index instead of copying the image per question."""
    attn = make(kv_dim=24)
    attn.use_sdpa = use_sdpa
    _, ctx = inputs(b=3, kv_dim=24)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2] = False  # an image with no attendable token
    index = torch.tensor([1, 0, 0, 2, 1, 1, 0])  # unsorted, unequal group sizes
    x = torch.randn(7, 4, 32, requires_grad=True)
    out, w = attn(x, kv=attn.project_context(ctx, mask), context_index=index, need_weights=True)
    x2 = x.detach().clone().requires_grad_(True)
    expected, expected_w = attn(x2, ctx[index], context_mask=mask[index], need_weights=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(w, expected_w, atol=ATOL, rtol=0)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="context_index values"):
        attn(x, ctx, context_index=torch.full((7,), 3))
    with pytest.raises(ValueError, match="context_index must be"):
        attn(x, ctx, context_index=index[:3])


def test_pruning_removes_exactly_those_heads_contributions():
    attn = make(dim=32, heads=4, kv_dim=24)
    x, ctx = inputs(kv_dim=24)
    pruned_heads = [1, 3]
    # Reference: the unpruned module with the pruned heads' attention outputs zeroed before out_proj.
    q = attn.split_heads(attn.q_proj(x))
    kv = attn.project_context(ctx)
    per_head, _ = attention_core(q, kv.key, kv.value)  # (B, H, Lq, hd)
    per_head[:, pruned_heads] = 0
    expected = attn.out_proj(per_head.transpose(1, 2).reshape(3, 5, 32))

    attn.prune_heads(pruned_heads)
    assert attn.num_heads == 2 and attn.head_ids == [0, 2] and attn.pruned_heads == {1, 3}
    assert attn.q_proj.weight.shape == (16, 32) and attn.kv_proj.weight.shape == (32, 24)
    assert attn.out_proj.weight.shape == (32, 16)
    torch.testing.assert_close(attn(x, ctx), expected, atol=ATOL, rtol=0)
    _, w = attn(x, ctx, need_weights=True)
    assert w.shape == (3, 2, 5, 7)

    # Idempotent on removed heads, original indices still meaningful.
    attn.prune_heads([1, 3])
    assert attn.num_heads == 2
    attn.prune_heads([1, 2])
    assert attn.head_ids == [0]
    with pytest.raises(ValueError, match="every head"):
        attn.prune_heads([0])
    with pytest.raises(ValueError, match="out of range"):
        attn.prune_heads([4])


def test_pruned_module_still_trains():
    attn = make(kv_dim=24).train()
    attn.prune_heads([0])
    x, ctx = inputs(kv_dim=24)
    attn(x, ctx).sum().backward()
    assert all(p.grad is not None for p in attn.parameters())


def test_xavier_init_and_zero_bias():
    torch.manual_seed(0)
    attn = CrossAttention(256, 16, kv_dim=512)
    for linear in (attn.q_proj, attn.out_proj):
        fan_in, fan_out = linear.weight.shape[1], linear.weight.shape[0]
        bound = (6 / (fan_in + fan_out)) ** 0.5
        assert linear.weight.abs().max() <= bound
        assert linear.weight.abs().max() > 0.9 * bound
        assert torch.all(linear.bias == 0)
    k_rows = attn.kv_proj.weight[:256]
    assert k_rows.abs().max() <= (6 / (512 + 256)) ** 0.5
    assert torch.all(attn.kv_proj.bias == 0)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: CrossAttention(30, 16), "divisible"),
        (lambda: CrossAttention(32, 0), "at least 1"),
        (lambda: CrossAttention(32, 4, dropout=1.5), "dropout"),
    ],
)
def test_constructor_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_forward_errors_name_the_problem():
    attn = make(kv_dim=24)
    x, ctx = inputs(kv_dim=24)
    with pytest.raises(ValueError, match="width 32.*kv_dim=24"):
        attn(x, torch.randn(3, 7, 32))
    with pytest.raises(ValueError, match="batch sizes differ"):
        attn(x, ctx[:2])
    with pytest.raises(ValueError, match="context_mask must have shape"):
        attn(x, ctx, context_mask=torch.ones(3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        attn(x, ctx, context_mask=torch.ones(3, 7))
    with pytest.raises(ValueError, match="x must be"):
        attn(torch.randn(3, 5, 16), ctx)
    with pytest.raises(ValueError, match="exactly one"):
        attn(x)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3),
    lq=st.integers(1, 6),
    lk=st.integers(1, 9),
    heads=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([1, 4, 8]),
    kv_dim=st.integers(1, 20),
    mask_seed=st.integers(0, 10_000),
)
def test_random_shapes_match_torch_and_never_nan(b, lq, lk, heads, head_dim, kv_dim, mask_seed):
    dim = heads * head_dim
    g = torch.Generator().manual_seed(mask_seed)
    mha = nn.MultiheadAttention(dim, heads, batch_first=True, kdim=kv_dim, vdim=kv_dim).eval()
    attn = CrossAttention.from_torch(mha).eval()
    x, ctx = torch.randn(b, lq, dim, generator=g), torch.randn(b, lk, kv_dim, generator=g)
    mask = torch.rand(b, lk, generator=g) > 0.5
    out = attn(x, ctx, context_mask=mask)
    assert out.shape == (b, lq, dim) and torch.isfinite(out).all()
    attn.use_sdpa = False
    torch.testing.assert_close(attn(x, ctx, context_mask=mask), out, atol=ATOL, rtol=0)
    rows = mask.any(-1)
    assert torch.all(out[~rows] == 0)
    if rows.any():
        expected, _ = mha(x[rows], ctx[rows], ctx[rows], key_padding_mask=~mask[rows])
        torch.testing.assert_close(out[rows], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("output_gate", [False, True])
def test_head_mask_zero_equals_pruning_and_per_row_masks_follow_shared_contexts(output_gate):
    torch.manual_seed(0)
    attn = CrossAttention(32, 8, kv_dim=24, output_gate=output_gate).eval()
    x, context = torch.randn(5, 3, 32), torch.randn(2, 7, 24)
    index = torch.tensor([0, 1, 1, 0, 1])
    mask = torch.ones(8)
    mask[[2, 6]] = 0.0
    masked = attn(x, context, context_index=index, head_mask=mask)
    pruned = CrossAttention(32, 8, kv_dim=24, output_gate=output_gate).eval()
    pruned.load_state_dict(attn.state_dict())
    pruned.prune_heads([2, 6])
    torch.testing.assert_close(masked, pruned(x, context, context_index=index))
    # a (B, H) mask: row 1 keeps every head, the other rows lose heads 2 and 6
    rows = mask.repeat(5, 1)
    rows[1] = 1.0
    per_row = attn(x, context, context_index=index, head_mask=rows)
    torch.testing.assert_close(per_row[1], attn(x, context, context_index=index)[1])
    torch.testing.assert_close(per_row[[0, 2, 3, 4]], masked[[0, 2, 3, 4]])
    with pytest.raises(ValueError, match=r"head_mask must have shape \(8,\) or \(5, 8\)"):
        attn(x, context, context_index=index, head_mask=torch.ones(6))


# ----------------------------------------------------------------------------- self-attention
def torch_self_attention(dim=32, heads=4, seed=0):
    """A batch_first nn.MultiheadAttention with non-zero biases, in eval mode."""
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(dim, heads, batch_first=True).eval()
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)
    return mha


def padding_mask(b=3, length=6):
    """``(B, L)`` True for real tokens: row 0 full, row 1 with 2 padding tokens, row 2 with one real token."""
    lengths = torch.tensor([length, length - 2, 1][:b])
    return torch.arange(length)[None, :] < lengths[:, None]


@pytest.mark.parametrize("use_sdpa", [True, False])
@pytest.mark.parametrize("with_mask", [False, True])
def test_self_attention_matches_torch_multihead_attention_with_a_key_padding_mask(use_sdpa, with_mask):
    mha = torch_self_attention()
    attn = SelfAttention.from_torch(mha).eval()
    assert type(attn) is SelfAttention and attn.kv_dim == 32
    attn.use_sdpa = use_sdpa
    x = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(1))
    mask = padding_mask() if with_mask else None
    expected, expected_w = mha(
        x, x, x, key_padding_mask=None if mask is None else ~mask, need_weights=True, average_attn_weights=False
    )
    out, w = attn(x, mask=mask, need_weights=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(w, expected_w, atol=ATOL, rtol=0)
    torch.testing.assert_close(attn(x, mask=mask), expected, atol=ATOL, rtol=0)  # without weights (SDPA when it can)


def test_causal_self_attention_from_torch_matches_torch_with_a_causal_mask():
    mha = torch_self_attention()
    attn = CausalSelfAttention.from_torch(mha).eval()
    assert type(attn) is CausalSelfAttention
    x = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(1))
    later = torch.ones(6, 6, dtype=torch.bool).triu(diagonal=1)  # True: may not attend
    expected, expected_w = mha(x, x, x, attn_mask=later, need_weights=True, average_attn_weights=False)
    out, w = attn(x, need_weights=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(w, expected_w, atol=ATOL, rtol=0)
    torch.testing.assert_close(attn(x), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("normalizer", ["softmax", "leaky_relu"])
def test_self_attention_gives_padding_keys_no_weight(normalizer):
    torch.manual_seed(0)
    attn = SelfAttention(32, 4, normalizer=normalizer).eval()
    x = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(1))
    mask = padding_mask()
    out, w = attn(x, mask=mask, need_weights=True)
    assert w.shape == (3, 4, 6, 6)
    assert torch.all(w.transpose(1, 3)[~mask] == 0)  # every query, every head: 0 on the padding keys
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 6))
    # Changing the padding tokens changes no real token's output.
    changed = x.clone()
    changed[~mask] += 100.0
    torch.testing.assert_close(attn(changed, mask=mask)[mask], out[mask], atol=ATOL, rtol=0)
    # A row of real tokens alone gives what the padded row gives them.
    torch.testing.assert_close(attn(x[1:2, :4])[0], out[1, :4], atol=ATOL, rtol=0)


@pytest.mark.parametrize("normalizer", ["softmax", "leaky_relu"])
@pytest.mark.parametrize("use_sdpa", [True, False])
def test_self_attention_row_of_padding_gives_zeros_and_finite_gradients(normalizer, use_sdpa):
    torch.manual_seed(0)
    attn = SelfAttention(32, 4, normalizer=normalizer, output_gate=True, dropout=0.1).train()
    attn.use_sdpa = use_sdpa
    x = torch.randn(3, 6, 32, requires_grad=True)
    mask = padding_mask()
    mask[2] = False  # a row whose keys are all padding
    out = attn(x, mask=mask)
    assert torch.isfinite(out).all()
    assert torch.all(out[2] == 0) and torch.all(out[:2].abs().sum(-1) > 0)
    out.pow(2).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[2] == 0)
    for name, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    _, w = attn.eval()(x, mask=mask, need_weights=True)
    assert torch.all(w[2] == 0) and torch.isfinite(w).all()


def test_self_attention_equals_a_cross_attention_of_the_sequence_over_itself():
    """What FusionBlock.self_attn computed before it was a SelfAttention: attn(rows, rows, context_mask=mask)."""
    torch.manual_seed(0)
    cross = CrossAttention(32, 4, output_gate=True).eval()
    attn = SelfAttention(32, 4, output_gate=True).eval()
    attn.load_state_dict(cross.state_dict())
    x, mask = torch.randn(3, 6, 32), padding_mask()
    torch.testing.assert_close(attn(x, mask=mask), cross(x, x, context_mask=mask), atol=ATOL, rtol=0)
    torch.testing.assert_close(attn(x), cross(x, x), atol=ATOL, rtol=0)
    attn.prune_heads([1])
    cross.prune_heads([1])
    torch.testing.assert_close(attn(x, mask=mask), cross(x, x, context_mask=mask), atol=ATOL, rtol=0)


def test_self_attention_errors_name_the_problem():
    attn = SelfAttention(32, 4)
    x = torch.randn(2, 5, 32)
    with pytest.raises(TypeError):
        attn(x, torch.randn(2, 5, 32))  # no context: it attends within x
    with pytest.raises(TypeError):
        SelfAttention(32, 4, kv_dim=16)
    with pytest.raises(ValueError, match=r"mask must have shape \(batch, .*\) = \(2, 5\), got \(2, 4\)"):
        attn(x, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        attn(x, mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="width 16"):
        attn(torch.randn(2, 5, 16))


# ----------------------------------------------------------------------------- one core for every layer
PARAMETER_NAMES = [
    "q_proj.weight", "q_proj.bias", "kv_proj.weight", "kv_proj.bias", "out_proj.weight", "out_proj.bias",
    "gate_proj.weight", "gate_proj.bias",
]


def every_attention_layer(**options):
    torch.manual_seed(0)
    return {
        "cross": CrossAttention(32, 4, **options),
        "self": SelfAttention(32, 4, **options),
        "causal": CausalSelfAttention(32, 4, **options),
        "local": LocalSelfAttention(32, 4, layout=sliding_window(6, 5), **options),  # a window over every pair
    }


def test_every_attention_layer_is_a_multi_head_attention_with_the_same_parameters():
    layers = every_attention_layer(output_gate=True)
    shapes = {name: p.shape for name, p in layers["cross"].state_dict().items()}
    for kind, layer in layers.items():
        assert isinstance(layer, MultiHeadAttention), kind
        assert list(layer.state_dict()) == PARAMETER_NAMES, kind
        assert {name: p.shape for name, p in layer.state_dict().items()} == shapes, kind
        assert (layer.num_heads, layer.head_dim, layer.head_ids) == (4, 8, [0, 1, 2, 3]), kind
    for kind in ("self", "causal", "local"):
        assert not isinstance(layers[kind], CrossAttention), kind
    assert list(every_attention_layer()["self"].state_dict()) == PARAMETER_NAMES[:6]  # no gate: no gate_proj


def test_a_self_attentions_weights_load_into_a_local_and_a_causal_self_attention():
    layers = every_attention_layer(output_gate=True)
    full = layers["self"].eval()
    local, causal = layers["local"].eval(), layers["causal"].eval()
    local.load_state_dict(full.state_dict())
    causal.load_state_dict(full.state_dict())
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    # A layout over every pair is full self-attention.
    torch.testing.assert_close(local(x), full(x), atol=ATOL, rtol=0)
    # The last token sees every token; token t sees the first t + 1 tokens, as full attention over them.
    out = causal(x)
    torch.testing.assert_close(out[:, -1], full(x)[:, -1], atol=ATOL, rtol=0)
    for t in range(6):
        torch.testing.assert_close(out[:, t], full(x[:, : t + 1])[:, t], atol=ATOL, rtol=0)
    # And back: a CrossAttention takes them too (the names of saved models).
    cross = layers["cross"].eval()
    cross.load_state_dict(causal.state_dict())
    torch.testing.assert_close(cross(x, x), full(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["cross", "self", "causal", "local"])
def test_every_attention_layer_prunes_heads_through_the_shared_core(kind):
    layer = every_attention_layer(output_gate=True)[kind].eval()
    layer.prune_heads([0, 2])
    assert layer.head_ids == [1, 3] and layer.pruned_heads == {0, 2}
    assert layer.q_proj.weight.shape == (16, 32) and layer.kv_proj.weight.shape == (32, 32)
    assert layer.gate_proj.weight.shape == (16, 32) and layer.out_proj.weight.shape == (32, 16)
    x = torch.randn(2, 6, 32)
    out = layer(x, x) if kind == "cross" else layer(x)
    assert out.shape == (2, 6, 32) and torch.isfinite(out).all()


def test_self_attention_layers_refuse_a_torch_layer_with_other_key_widths_and_local_takes_its_layout():
    mha = nn.MultiheadAttention(32, 4, batch_first=True, kdim=16, vdim=16)
    for layer in (SelfAttention, CausalSelfAttention):
        with pytest.raises(ValueError, match=rf"{layer.__name__} attends a sequence over itself: it needs kdim == vdim"):
            layer.from_torch(mha)
    assert CrossAttention.from_torch(mha).kv_dim == 16
    square = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    local = LocalSelfAttention.from_torch(square, layout=sliding_window(6, 5)).eval()  # every pair: full attention
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(local(x), square(x, x, x, need_weights=False)[0], atol=1e-5, rtol=0)

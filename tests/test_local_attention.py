import warnings

import pytest
import torch
import torch.nn.functional as F

from vlfuse import FusionBlock
from vlfuse.layers import SelfAttention
from vlfuse.layers import local_attention
from vlfuse.layers.local_attention import (
    LocalSelfAttention,
    block_sparse,
    block_sparse_mask,
    grid_neighbourhood,
    grid_neighbourhood_mask,
    local_self_attention,
    sliding_window,
    sliding_window_mask,
)

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def brute_force(length, allowed):
    return torch.tensor([[allowed(i, j) for j in range(length)] for i in range(length)])


@pytest.mark.parametrize("length, window", [(1, 0), (7, 0), (9, 2), (10, 20)])
def test_sliding_window_allows_exactly_the_window(length, window):
    expected = brute_force(length, lambda i, j: abs(i - j) <= window)
    assert torch.equal(sliding_window_mask(length, window), expected)


@pytest.mark.parametrize("grid_h, grid_w, radius, prefix", [(3, 4, 1, 0), (4, 3, 0, 1), (5, 6, 2, 2), (2, 2, 5, 1)])
def test_grid_neighbourhood_allows_exactly_the_square_and_the_prefix(grid_h, grid_w, radius, prefix):
    def allowed(i, j):
        if i < prefix or j < prefix:  # prefix tokens are global
            return True
        (ri, ci), (rj, cj) = divmod(i - prefix, grid_w), divmod(j - prefix, grid_w)
        return abs(ri - rj) <= radius and abs(ci - cj) <= radius

    mask = grid_neighbourhood_mask(grid_h, grid_w, radius, prefix)
    assert torch.equal(mask, brute_force(prefix + grid_h * grid_w, allowed))


@pytest.mark.parametrize(
    "length, block, neighbours, global_blocks", [(10, 3, 0, 0), (10, 3, 1, 1), (23, 4, 1, 2), (8, 8, 0, 1)]
)
def test_block_sparse_allows_exactly_local_and_global_blocks(length, block, neighbours, global_blocks):
    def allowed(i, j):
        bi, bj = i // block, j // block
        return abs(bi - bj) <= neighbours or bi < global_blocks or bj < global_blocks

    mask = block_sparse_mask(length, block, neighbours=neighbours, global_blocks=global_blocks)
    assert torch.equal(mask, brute_force(length, allowed))


def test_layout_arguments_are_checked():
    with pytest.raises(ValueError, match="window"):
        sliding_window(8, -1)
    with pytest.raises(ValueError, match="length"):
        sliding_window(0, 1)
    with pytest.raises(ValueError, match="grid_w"):
        grid_neighbourhood(2, 0, 1)
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        grid_neighbourhood(2, 2, 1, num_prefix_tokens=-1)
    with pytest.raises(ValueError, match="global_blocks"):
        block_sparse(8, 2, global_blocks=-1)


LAYOUTS = [
    sliding_window(300, 40),
    grid_neighbourhood(15, 19, 2, num_prefix_tokens=1),
    block_sparse(700, 128, neighbours=1, global_blocks=1),
    block_sparse(333, 50, neighbours=0, global_blocks=2),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_block_mask_matches_create_block_mask(layout):
    """Our tile-by-tile BlockMask lists the same partial and full tiles as FlexAttention's own builder."""
    expected = flex.create_block_mask(layout.mask_mod, None, None, layout.length, layout.length, device="cpu")
    ours = layout.block_mask()
    assert torch.equal(ours.to_dense(), expected.to_dense())
    assert torch.equal(ours.kv_num_blocks, expected.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, expected.full_kv_num_blocks)
    assert layout.block_mask() is ours  # built once


def qkv(length, heads=2, head_dim=16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, length, head_dim, generator=g).requires_grad_(requires_grad) for _ in range(3)]


def dense_reference(q, k, v, layout):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return scores.masked_fill(~layout.dense(), float("-inf")).softmax(-1) @ v


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention without torch.compile: same semantics, no compile time (it ignores the tiles)."""
    monkeypatch.setattr(local_attention, "_compiled_flex", flex.flex_attention)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=[layout.name for layout in LAYOUTS[:3]])
def test_flex_and_dense_paths_agree(layout, eager_flex):
    q, k, v = qkv(layout.length)
    expected = dense_reference(q, k, v, layout)
    torch.testing.assert_close(local_self_attention(q, k, v, layout, use_flex=False), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(local_self_attention(q, k, v, layout, use_flex=True), expected, atol=1e-5, rtol=0)


def _compiled_agrees(layout):
    q, k, v = qkv(layout.length)
    with torch.no_grad():
        out = local_self_attention(q, k, v, layout, use_flex=True)
    torch.testing.assert_close(out, dense_reference(q, k, v, layout), atol=1e-5, rtol=0)


def test_compiled_flex_skips_tiles_and_agrees_with_the_dense_mask():
    """The real kernel (compiled; the only one that uses the tiles) on the richest layout."""
    _compiled_agrees(grid_neighbourhood(15, 19, 2, num_prefix_tokens=1))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_compiled_flex_agrees_on_every_layout(layout):
    _compiled_agrees(layout)


def test_gradients_flow_through_the_dense_fallback_on_cpu():
    layout = sliding_window(50, 3)
    q, k, v = qkv(50, requires_grad=True)
    out = local_self_attention(q, k, v, layout)  # FlexAttention has no CPU backward: dense mask
    assert torch.isfinite(out).all()
    out.pow(2).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="no backward pass on CPU"):
        local_self_attention(q, k, v, layout, use_flex=True)
    with torch.no_grad(), pytest.raises(ValueError, match="no attention dropout"):
        local_self_attention(q, k, v, layout, use_flex=True, dropout_p=0.1)
    with pytest.raises(ValueError, match="for 50 tokens"):
        local_self_attention(*qkv(49), layout)


def test_a_failing_compile_falls_back_to_the_dense_mask_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(local_attention, "_compiled_flex", broken)
    monkeypatch.setattr(local_attention, "_flex_broken", None)
    layout = sliding_window(40, 2)
    q, k, v = qkv(40)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        out = local_self_attention(q, k, v, layout)
    torch.testing.assert_close(out, dense_reference(q, k, v, layout), atol=1e-5, rtol=0)
    assert "failed earlier" in local_attention.flex_unsupported_reason(q)


def make_local(layout, dim=32, heads=4, **kw):
    torch.manual_seed(0)
    attn = LocalSelfAttention(dim, heads, layout=layout, **kw)
    with torch.no_grad():  # non-zero biases, so bias handling is exercised too
        for p in attn.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return attn.eval()


def masked_reference(attn, x, allowed):
    """The layer by hand: its projections, the normaliser over ``allowed`` ``(B or 1, L, L)`` pairs, out_proj."""
    kv = attn.project_context(x)
    q = attn.q_proj(x).view(*x.shape[:2], attn.num_heads, attn.head_dim).transpose(1, 2)  # (B, H, L, hd)
    scores = q @ kv.key.transpose(-2, -1) / attn.head_dim**0.5  # (B, H, L, L)
    weights = attn.normalize(scores, allowed[:, None])
    merged = (weights @ kv.value).transpose(1, 2).reshape(x.shape)  # (B, L, H * hd)
    if attn.gate_proj is not None:
        merged = merged * torch.sigmoid(x @ attn.gate_proj.weight.T + attn.gate_proj.bias)
    return attn.out_proj(merged), weights


@pytest.mark.parametrize("output_gate", [False, True])
@pytest.mark.parametrize("normalizer", ["softmax", "leaky_relu"])
def test_local_self_attention_attends_only_within_its_layout(normalizer, output_gate):
    layout = sliding_window(9, 1)
    attn = make_local(layout, normalizer=normalizer, output_gate=output_gate)
    x = torch.randn(2, 9, 32)
    out, w = attn(x, need_weights=True)
    expected, expected_w = masked_reference(attn, x, layout.dense()[None])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(w, expected_w, atol=1e-5, rtol=0)
    assert torch.all(w[:, :, ~layout.dense()] == 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 9))
    torch.testing.assert_close(attn(x), out, atol=1e-5, rtol=0)  # the fast path (local_self_attention)
    attn.use_sdpa = False  # the explicit path: a padding mask with every token real leaves the fast one
    torch.testing.assert_close(attn(x, mask=torch.ones(2, 9, dtype=torch.bool)), out, atol=1e-5, rtol=0)
    # A token beyond a query's window does not change that query's output.
    far = x.clone()
    far[:, 5:] += 10.0
    torch.testing.assert_close(attn(far)[:, :4], out[:, :4], atol=1e-5, rtol=0)


@pytest.mark.parametrize("normalizer", ["softmax", "leaky_relu"])
@pytest.mark.parametrize("use_sdpa", [True, False])
def test_window_plus_padding_leaves_queries_without_keys_at_zero_without_nan(normalizer, use_sdpa):
    layout = sliding_window(8, 2)
    attn = make_local(layout, normalizer=normalizer).train()
    attn.use_sdpa = use_sdpa
    x = torch.randn(2, 8, 32, requires_grad=True)
    padding = torch.ones(2, 8, dtype=torch.bool)
    padding[0, 3:] = False  # queries 5, 6 and 7 of row 0 see only padding within +-2
    out = attn(x, mask=padding)
    assert torch.isfinite(out).all()
    assert torch.all(out[0, 5:] == 0) and torch.all(out[0, :5].abs().sum(-1) > 0)
    out.pow(2).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[0, 5:] == 0)
    for name, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    attn.eval()
    expected, _ = masked_reference(attn, x, layout.dense()[None] & padding[:, None, :])
    kept = torch.ones(2, 8, 1, dtype=torch.bool)
    kept[0, 5:] = False
    expected = torch.where(kept, expected, 0.0)  # the reference's softmax over no key is NaN there
    torch.testing.assert_close(attn(x, mask=padding), expected, atol=1e-5, rtol=0)


def test_a_full_self_attention_loads_into_a_local_one_and_a_full_layout_matches_it():
    """A SelfAttention with a layout: the same parameter names and call, so it stands in for one."""
    torch.manual_seed(0)
    full = SelfAttention(32, 4, output_gate=True).eval()
    local = LocalSelfAttention(32, 4, layout=sliding_window(7, 6), output_gate=True).eval()  # every pair
    assert isinstance(local, SelfAttention)
    local.load_state_dict(full.state_dict())
    x = torch.randn(3, 7, 32)
    padding = torch.ones(3, 7, dtype=torch.bool)
    padding[1, 4:] = False
    torch.testing.assert_close(local(x, mask=padding), full(x, mask=padding), atol=1e-5, rtol=0)
    torch.testing.assert_close(local(x), full(x), atol=1e-5, rtol=0)
    out, w = local(x, mask=padding, need_weights=True)
    expected, expected_w = full(x, mask=padding, need_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(w, expected_w, atol=1e-5, rtol=0)
    local.prune_heads([2])
    assert local.num_heads == 3 and local(x).shape == (3, 7, 32)
    assert "sliding window +-6" in repr(local)


def test_local_self_attention_runs_its_layout_through_flex_when_it_can(eager_flex, monkeypatch):
    """An image-side self-attention over a patch grid: inference goes through FlexAttention."""
    layout = grid_neighbourhood(6, 7, 1, num_prefix_tokens=1)
    attn = make_local(layout)
    patches = torch.randn(2, layout.length, 32)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flex.flex_attention(*args, **kwargs)

    monkeypatch.setattr(local_attention, "_compiled_flex", counted)
    with torch.no_grad():
        out = attn(patches)
        attn.use_flex = False
        dense = attn(patches)
    assert calls == [1]
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=0)
    torch.testing.assert_close(out, masked_reference(attn, patches, layout.dense()[None])[0], atol=1e-5, rtol=0)


def test_local_self_attention_errors_name_the_problem():
    attn = make_local(sliding_window(6, 1))
    x = torch.randn(2, 6, 32)
    with pytest.raises(ValueError, match=r"x must be \(batch, 6, 32\) for 'sliding window \+-1', got shape \(2, 7, 32\)"):
        attn(torch.randn(2, 7, 32))
    with pytest.raises(TypeError):  # no context argument: it attends within x
        attn(x, torch.randn(2, 6, 32))
    with pytest.raises(TypeError):
        attn(x, context_mask=torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        attn(x, mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"mask must have shape \(batch, .*\) = \(2, 6\), got \(2, 5\)"):
        attn(x, mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="width 16"):
        attn(torch.randn(2, 6, 16))


def test_fusion_block_built_with_a_local_layout_uses_it_for_the_text_self_attention():
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=24, gated=False, self_attn_layout=sliding_window(10, 1)).train()
    assert isinstance(block.self_attn, LocalSelfAttention)
    x = torch.randn(2, 10, 32, requires_grad=True)
    image = torch.randn(2, 5, 24)
    text_mask = torch.ones(2, 10, dtype=torch.bool)
    text_mask[1, 4:] = False
    local = block(x, image, text_mask=text_mask)
    assert torch.isfinite(local).all()
    local.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in block.parameters())
    full = FusionBlock(32, 4, kv_dim=24, gated=False).eval()
    full.load_state_dict(block.state_dict())  # the same parameter names
    block.eval()
    with torch.no_grad():
        assert not torch.allclose(full(x, image, text_mask=text_mask), block(x, image, text_mask=text_mask))
        # The self-attention is the only difference: with the local one swapped in, the outputs match.
        full.self_attn = block.self_attn
        torch.testing.assert_close(full(x, image, text_mask=text_mask), block(x, image, text_mask=text_mask))
    with pytest.raises(ValueError, match="no self-attention"):
        FusionBlock(32, 4, self_attention=False, self_attn_layout=sliding_window(10, 1))

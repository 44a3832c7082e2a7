import pytest
import torch
from torch import nn

from vlfuse import FusionBlock, FusionStack
from vlfuse.layers import MLP_LAYERS, Mlp, SelfAttention, SwiGLU
from vlfuse.layers.fusion import mlp_layer_class


def data(b=2, lt=6, li=9, dim=32, kv_dim=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, lt, dim, generator=g), torch.randn(b, li, kv_dim, generator=g)


def test_new_block_without_self_attention_is_identity():
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=24, self_attention=False).eval()
    x, img = data()
    torch.testing.assert_close(block(x, img), x)


def test_new_block_ignores_the_image_until_its_gate_opens():
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=24).eval()
    x, img = data()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False
    torch.testing.assert_close(block(x, img, text_mask=mask), block(x, img + 5, text_mask=mask))
    with torch.no_grad():
        block.gate_attn.fill_(1.0)
    assert not torch.allclose(block(x, img, text_mask=mask), block(x, img + 5, text_mask=mask))


def test_ungated_block_uses_the_image_from_the_start():
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=24, gated=False).eval()
    assert block.gate_attn is None
    x, img = data()
    assert not torch.allclose(block(x, img), block(x, img + 5))


def test_fully_padded_text_gives_no_nan_forward_or_backward():
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=24, gated=False, dropout=0.1, attn_dropout=0.1).train()
    x, img = data()
    x.requires_grad_(True)
    text_mask = torch.ones(2, 6, dtype=torch.bool)
    text_mask[1] = False  # a row that is all padding
    text_mask[0, 3:] = False
    out = block(x, img, text_mask=text_mask)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in block.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_every_parameter_of_a_stack_receives_a_gradient():
    torch.manual_seed(0)
    stack = FusionStack(2, 32, 4, kv_dim=24).train()
    x, img = data()
    # At initialisation only the gates learn (tanh(0) = 0 blocks the branches' gradients) ...
    stack(x, img)[0].pow(2).sum().backward()
    for block in stack.blocks:
        assert block.gate_attn.grad.abs().item() > 0 and block.gate_mlp.grad.abs().item() > 0
    # ... and once the gates are open, every parameter does.
    stack.zero_grad()
    with torch.no_grad():
        for block in stack.blocks:
            block.gate_attn.fill_(0.5)
            block.gate_mlp.fill_(0.5)
    out, _ = stack(x, img)
    out.pow(2).sum().backward()
    for name, p in stack.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_stack_shares_image_keys_values_between_questions():
    torch.manual_seed(0)
    stack = FusionStack(2, 32, 4, kv_dim=24, gated=False).eval()
    x, img = data(b=4)
    image_index = torch.tensor([0, 0, 1, 1])
    images = img[[0, 2]]
    shared, _ = stack(x, kvs=stack.project_context(images), image_index=image_index)
    expanded, _ = stack(x, images[image_index])
    torch.testing.assert_close(shared, expanded)


def test_weights_only_from_the_layers_asked_for():
    torch.manual_seed(0)
    stack = FusionStack(3, 32, 4, kv_dim=24, gated=False).eval()
    x, img = data()
    out, weights = stack(x, img, weights_from=[1])
    assert list(weights) == [1]
    assert weights[1].shape == (2, 4, 6, 9)
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(2, 4, 6))
    plain, none = stack(x, img)
    assert none == {}
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=0)


def test_stack_argument_errors():
    stack = FusionStack(2, 32, 4, kv_dim=24)
    x, img = data()
    with pytest.raises(ValueError, match="context or kvs"):
        stack(x)
    with pytest.raises(ValueError, match="1 layers, the stack has 2"):
        stack(x, kvs=stack.project_context(img)[:1])
    with pytest.raises(ValueError, match="depth"):
        FusionStack(0, 32)


def test_swiglu_mlp_follows_its_definition():
    torch.manual_seed(0)
    mlp = SwiGLU(32, 48)
    x, _ = data()
    w_a, w_b = mlp.inner.weight.split(48)
    b_a, b_b = mlp.inner.bias.split(48)
    expected = mlp.out(torch.nn.functional.silu(x @ w_a.T + b_a) * (x @ w_b.T + b_b))
    torch.testing.assert_close(mlp(x), expected)


@pytest.mark.parametrize("mlp_layer, inner_width", [("gelu", 64), ("swiglu", 128)])
def test_block_builds_the_mlp_asked_for_and_trains(mlp_layer, inner_width):
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=24, mlp_ratio=2.0, gated=False, mlp_layer=mlp_layer)
    assert type(block.mlp) is MLP_LAYERS[mlp_layer]
    first = block.mlp.inner if mlp_layer == "swiglu" else block.mlp[0]
    assert first.out_features == inner_width
    x, img = data()
    block(x, img).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in block.mlp.parameters())
    with pytest.raises(ValueError, match=r"mlp_layer must be one of \('gelu', 'swiglu'\) or an nn.Module class, got 'relu'"):
        FusionBlock(32, 4, mlp_layer="relu")


def test_mlp_layers_by_name():
    assert MLP_LAYERS == {"gelu": Mlp, "swiglu": SwiGLU}
    assert mlp_layer_class("gelu") is Mlp and mlp_layer_class("swiglu") is SwiGLU and mlp_layer_class(SwiGLU) is SwiGLU
    assert FusionBlock(32, 4).mlp.__class__ is Mlp  # the default
    # The GELU MLP keeps the weight names of saved models: a Sequential's 0.* and 2.*.
    assert list(Mlp(32, 64).state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert isinstance(Mlp(32, 64)[1], nn.GELU)
    with pytest.raises(ValueError, match=r"mlp_layer must be one of \('gelu', 'swiglu'\)"):
        mlp_layer_class("SwiGLU")


class ScaledIdentity(nn.Module):
    """A test MLP: ``scale * x``, built as ``cls(dim, hidden)`` like every MLP of a block."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.dim, self.hidden = dim, hidden
        self.scale = nn.Parameter(torch.full((dim,), 2.0))

    def forward(self, x):
        return self.scale * x


def test_block_builds_an_mlp_class_it_is_given_and_runs_it():
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=24, mlp_ratio=1.5, gated=False, self_attention=False, mlp_layer=ScaledIdentity).eval()
    assert isinstance(block.mlp, ScaledIdentity) and (block.mlp.dim, block.mlp.hidden) == (32, 48)
    x, img = data()
    after_attention = x + block.cross_attn(block.norm_cross(x), img)
    torch.testing.assert_close(block(x, img), after_attention + 2.0 * block.norm_mlp(after_attention), atol=1e-5, rtol=0)
    stack = FusionStack(2, 32, 4, kv_dim=24, mlp_layer=ScaledIdentity)
    assert all(isinstance(b.mlp, ScaledIdentity) for b in stack.blocks)


def test_the_text_self_attention_of_a_block_is_a_self_attention_under_the_text_mask():
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=24, gated=False).eval()
    assert type(block.self_attn) is SelfAttention
    x, img = data()
    text_mask = torch.ones(2, 6, dtype=torch.bool)
    text_mask[0, 4:] = False
    # The first branch by hand: x + self_attn(norm(x), mask), then the rest of the block.
    expected_rows = x + block.self_attn(block.norm_self(x), mask=text_mask)
    no_self = FusionBlock(32, 4, kv_dim=24, gated=False, self_attention=False).eval()
    no_self.load_state_dict({k: v for k, v in block.state_dict().items() if not k.startswith(("self_attn", "norm_self"))})
    out = block(x, img, text_mask=text_mask)
    expected = no_self(expected_rows, img, text_mask=text_mask)
    torch.testing.assert_close(out[text_mask], expected[text_mask], atol=1e-5, rtol=0)
    assert torch.equal(out[~text_mask], x[~text_mask])  # padding passes through


def test_stack_head_masks_reach_each_layer():
    torch.manual_seed(0)
    stack = FusionStack(2, 32, 8, gated=False).eval()
    x, image = torch.randn(3, 4, 32), torch.randn(3, 6, 32)
    masks = [torch.ones(8), torch.ones(8)]
    masks[1][3] = 0.0
    masked, _ = stack(x, image, head_masks=masks)
    stack.blocks[1].cross_attn.prune_heads([3])
    pruned, _ = stack(x, image)
    torch.testing.assert_close(masked, pruned)
    with pytest.raises(ValueError, match="head masks for 1 layers, the stack has 2"):
        stack(x, image, head_masks=[None])


@pytest.mark.parametrize("need_weights", [False, True])
def test_text_without_a_real_token_passes_through_a_block_and_a_stack(need_weights):
    """No real token at all (every row padding): nothing to attend from, so the text comes back as it was."""
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=16, gated=False).eval()
    stack = FusionStack(2, 32, 4, kv_dim=16, gated=False).eval()
    x, image = torch.randn(2, 5, 32), torch.randn(2, 7, 16)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    out = block(x, image, text_mask=mask, need_weights=need_weights)
    out, weights = out if need_weights else (out, None)
    torch.testing.assert_close(out, x, rtol=0, atol=0)
    if need_weights:
        assert weights.shape == (2, 4, 5, 7) and not weights.any()
    fused, stack_weights = stack(x, image, text_mask=mask, weights_from=[1] if need_weights else [])
    torch.testing.assert_close(fused, x, rtol=0, atol=0)
    assert set(stack_weights) == ({1} if need_weights else set())

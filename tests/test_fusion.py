import pytest
import torch

from vlfuse import FusionBlock, FusionStack
from vlfuse.layers import SwiGLU


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


@pytest.mark.parametrize("mlp_type, inner_width", [("gelu", 64), ("swiglu", 128)])
def test_block_builds_the_mlp_asked_for_and_trains(mlp_type, inner_width):
    torch.manual_seed(0)
    block = FusionBlock(32, 4, kv_dim=24, mlp_ratio=2.0, gated=False, mlp_type=mlp_type)
    first = block.mlp.inner if mlp_type == "swiglu" else block.mlp[0]
    assert first.out_features == inner_width
    x, img = data()
    block(x, img).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in block.mlp.parameters())
    with pytest.raises(ValueError, match="mlp_type must be one of"):
        FusionBlock(32, 4, mlp_type="relu")


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

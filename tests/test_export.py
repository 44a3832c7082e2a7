"""torch.export and torch.compile(fullgraph=True) of the fusion layers: the padded layout, equal to the packed one."""

import pytest
import torch

from vlfuse import CrossAttention, FusionBlock, FusionStack
from vlfuse.layers.fusion import layout_of
from vlfuse.layers.packing import PackedTokens, PaddedTokens

ATOL = 1e-5
DIM, KV_DIM, HEADS = 64, 96, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def opened(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in eval mode with every tanh gate at 0.5, so that the image changes the output."""
    torch.manual_seed(0)
    for name, param in module.named_parameters():
        if name.endswith(("gate_attn", "gate_mlp")):
            param.data.fill_(0.5)
    return module.eval()


def inputs(questions: int = 4, images: int = 3):
    """Padded questions (one without real tokens), images with masked keys (one with none), an unsorted image index."""
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(questions, 6, DIM, generator=g), torch.randn(images, 9, KV_DIM, generator=g)
    text_mask = torch.arange(6)[None, :] < torch.tensor([6, 3, 0, 5][:questions])[:, None]  # (B, Lt)
    context_mask = torch.arange(9)[None, :] < torch.tensor([9, 4, 0][:images])[:, None]  # (Bi, Li)
    image_index = torch.tensor([2, 0, 1, 0][:questions])
    return x, context, text_mask, context_mask, image_index


def assert_same(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL)


def test_the_issue_block_exports_and_equals_eager():
    block = opened(FusionBlock(DIM, HEADS, kv_dim=KV_DIM))
    x, context, text_mask, _, _ = inputs(images=4)
    program = torch.export.export(block, (x, context), {"text_mask": text_mask})
    assert_same(program.module()(x, context, text_mask=text_mask), block(x, context, text_mask=text_mask))


@pytest.mark.parametrize("self_attention", [True, False])
def test_block_with_shared_images_and_masked_keys_exports(self_attention):
    block = opened(FusionBlock(DIM, HEADS, kv_dim=KV_DIM, self_attention=self_attention, output_gate=True))
    x, context, text_mask, context_mask, image_index = inputs()
    kwargs = {"text_mask": text_mask, "context_mask": context_mask, "context_index": image_index}
    program = torch.export.export(block, (x, context), kwargs)
    with torch.no_grad():
        expected = block(x, context, **kwargs)
    assert_same(program.module()(x, context, **kwargs), expected)
    assert_same(expected[2], x[2])  # a question without real tokens passes through


class StackCall(torch.nn.Module):
    """A FusionStack's forward with its non-tensor options fixed: what is exported or compiled."""

    def __init__(self, stack: FusionStack, weights_from=()) -> None:
        super().__init__()
        self.stack, self.weights_from = stack, tuple(weights_from)

    def forward(self, x, context, text_mask, context_mask, image_index, head_mask):
        head_masks = [head_mask] + [None] * (len(self.stack) - 1)
        return self.stack(
            x, context, text_mask=text_mask, context_mask=context_mask, image_index=image_index,
            weights_from=self.weights_from, head_masks=head_masks,
        )


@pytest.mark.parametrize("self_attention", [True, False])
def test_stack_exports_with_shared_images_weights_and_head_masks(self_attention):
    stack = opened(FusionStack(2, DIM, HEADS, kv_dim=KV_DIM, self_attention=self_attention, mlp_layer="swiglu"))
    call = StackCall(stack, weights_from=[1])
    x, context, text_mask, context_mask, image_index = inputs()
    head_mask = torch.rand(len(x), HEADS, generator=torch.Generator().manual_seed(2))  # (B, H)
    args = (x, context, text_mask, context_mask, image_index, head_mask)
    program = torch.export.export(call, args)
    with torch.no_grad():
        expected, expected_weights = call(*args)
    out, weights = program.module()(*args)
    assert_same(out, expected)
    assert list(weights) == [1]
    assert_same(weights[1], expected_weights[1])  # (B, H, Lt, Li), zero at padding
    assert weights[1].shape == (4, HEADS, 6, 9) and not weights[1][1, :, 3:].any()


def test_exported_stack_takes_other_batch_sizes_and_lengths():
    stack = opened(FusionStack(2, DIM, HEADS, kv_dim=KV_DIM))
    x, context, text_mask, context_mask, image_index = inputs()
    questions, length, images = torch.export.Dim("questions"), torch.export.Dim("length"), torch.export.Dim("images")
    static = torch.export.Dim.STATIC
    shapes = {
        "x": (questions, length, static), "context": (images, static, static), "text_mask": (questions, length),
        "context_mask": (images, static), "image_index": (questions,), "head_mask": None,
    }
    args = (x, context, text_mask, context_mask, image_index, None)
    program = torch.export.export(StackCall(stack), args, dynamic_shapes=shapes)
    smaller = (x[:3, :4], context[:2], text_mask[:3, :4], context_mask[:2], image_index[[1, 3, 1]], None)
    with torch.no_grad():
        expected, _ = StackCall(stack)(*smaller)
    out, _ = program.module()(*smaller)
    assert out.shape == (3, 4, DIM)
    assert_same(out, expected)


def test_cross_attention_with_a_context_index_exports():
    attn = CrossAttention(DIM, HEADS, kv_dim=KV_DIM).eval()
    x, context, _, context_mask, image_index = inputs()
    kwargs = {"context_mask": context_mask, "context_index": image_index}
    program = torch.export.export(attn, (x, context), kwargs)
    with torch.no_grad():
        assert_same(program.module()(x, context, **kwargs), attn(x, context, **kwargs))


def test_the_padded_layout_gives_the_packed_results_in_eager_mode():
    stack = opened(FusionStack(2, DIM, HEADS, kv_dim=KV_DIM, attention_normalizer="leaky_relu"))
    x, context, text_mask, context_mask, image_index = inputs()
    kvs = stack.project_context(context, context_mask)
    packed, kvs_packed = layout_of(x, text_mask, image_index, kvs)
    assert type(packed) is PackedTokens and kvs_packed is kvs  # eager mode: the fast layout
    padded = PaddedTokens(*text_mask.shape, text_mask)
    tokens = {"packed": packed.pack(x), "padded": padded.pack(x)}  # (N, dim) and (B * Lt, dim)
    assert tokens["padded"].shape == (x.shape[0] * x.shape[1], DIM) and len(tokens["packed"]) == int(text_mask.sum())
    with torch.no_grad():
        for block, kv in zip(stack.blocks, kvs):
            tokens["packed"], weights_packed = block.forward_packed(tokens["packed"], kv, packed, need_weights=True)
            tokens["padded"], weights_padded = block.forward_packed(tokens["padded"], kv.rows(image_index), padded, need_weights=True)
            zeros = weights_packed.new_zeros(*text_mask.shape, *weights_packed.shape[1:])  # (B, Lt, H, Li)
            assert_same(padded.unpack(weights_padded, zeros), packed.unpack(weights_packed, zeros))
    assert_same(padded.unpack(tokens["padded"], x), packed.unpack(tokens["packed"], x))


def compiled_matches(backend: str) -> None:
    """``torch.compile(fullgraph=True)`` of a FusionStack's forward with ``backend`` equals eager."""
    stack = opened(FusionStack(2, DIM, HEADS, kv_dim=KV_DIM))
    x, context, text_mask, context_mask, image_index = inputs()
    kwargs = {"text_mask": text_mask, "context_mask": context_mask, "image_index": image_index}
    compiled = torch.compile(stack, fullgraph=True, backend=backend)
    with torch.no_grad():
        out, _ = compiled(x, context, **kwargs)
        expected, _ = stack(x, context, **kwargs)
    assert_same(out, expected)


def test_compile_fullgraph_captures_the_stack():
    compiled_matches("aot_eager")  # the whole graph through dynamo and AOT autograd, without inductor's C++ build


@pytest.mark.slow
def test_compile_fullgraph_with_inductor_on_cpu():
    compiled_matches("inductor")  # 20-50 s on a shared 2-core CPU: too slow for the fast suite

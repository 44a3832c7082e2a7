"""Packed tokens (vlfuse.layers.packing) and the fusion blocks that run on them."""

import pytest
import torch

from vlfuse import FusionStack
from vlfuse.layers import PackedTokens
from vlfuse.layers.packing import ContextGroups, TokenPacking

ATOL = 1e-5


def padded_questions(lengths=(3, 6, 1, 4, 0, 5), length=6, dim=32, seed=0):
    """Text rows ``(B, L, dim)`` and their mask: row i has ``lengths[i]`` real tokens, then padding."""
    x = torch.randn(len(lengths), length, dim, generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)
    return x, mask


def test_packing_keeps_the_real_tokens_row_by_row_and_puts_them_back():
    x, mask = padded_questions()
    packing = TokenPacking(*mask.shape, mask)
    packed = packing.pack(x)
    torch.testing.assert_close(packed, torch.cat([row[keep] for row, keep in zip(x, mask)]), rtol=0, atol=0)
    assert packing.rows.tolist() == [i for i, n in enumerate(mask.sum(1).tolist()) for _ in range(n)]
    padding = torch.full_like(x, 7.0)
    back = packing.unpack(packed * 2, padding)
    torch.testing.assert_close(back[mask], x[mask] * 2, rtol=0, atol=0)
    assert torch.all(back[~mask] == 7.0)


def test_packing_without_a_mask_is_a_reshape_of_the_same_memory():
    x, _ = padded_questions()
    packing = TokenPacking(x.shape[0], x.shape[1])
    packed = packing.pack(x)
    assert packed.shape == (x.shape[0] * x.shape[1], x.shape[2]) and packed.data_ptr() == x.data_ptr()
    assert packing.unpack(packed, x).data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match=r"text mask must have shape \(batch, length\) = \(2, 3\), got \(2, 4\)"):
        TokenPacking(2, 3, torch.ones(2, 4, dtype=torch.bool))


def test_groups_hold_each_contexts_tokens_in_order_then_zeros():
    context = torch.tensor([2, 0, 2, 2, 1, 0])
    tokens = torch.arange(1.0, 7.0)[:, None].repeat(1, 3)  # token i holds i + 1
    groups = ContextGroups(context, num_contexts=4)
    grouped = groups.group(tokens)
    assert grouped.shape == (4, 3, 3) and groups.size == 3
    assert grouped[:, :, 0].tolist() == [[2, 6, 0], [5, 0, 0], [1, 3, 4], [0, 0, 0]]
    torch.testing.assert_close(groups.ungroup(grouped), tokens, rtol=0, atol=0)


def test_equal_sorted_groups_are_laid_out_in_place():
    tokens = torch.randn(6, 4)
    groups = ContextGroups(torch.tensor([0, 0, 1, 1, 2, 2]), num_contexts=3)
    assert groups.in_place and groups.group(tokens).data_ptr() == tokens.data_ptr()
    assert not ContextGroups(torch.tensor([1, 1, 0, 0, 2, 2]), num_contexts=3).in_place


IMAGE_INDEX = torch.tensor([2, 0, 2, 1, 0, 2])
"""The image of each of :func:`padded_questions`' rows (3 images, unsorted, one row without tokens)."""


def test_rows_that_read_their_own_image_with_no_padding_are_grouped_without_counting(monkeypatch):
    x = torch.randn(4, 3, 8)
    monkeypatch.setattr(torch, "bincount", None)  # nothing is counted
    groups = PackedTokens.of(x, None, None, 4).groups
    assert (groups.num_contexts, groups.size) == (4, 3) and groups.in_place
    tokens = x.reshape(12, 8)
    assert groups.group(tokens).data_ptr() == tokens.data_ptr()
    torch.testing.assert_close(groups.ungroup(groups.group(tokens)), tokens, rtol=0, atol=0)


def test_packed_tokens_go_back_to_their_rows_with_zeros_at_padding():
    x, mask = padded_questions()
    layout = PackedTokens.of(x, mask, IMAGE_INDEX, num_images=3)
    assert len(layout) == int(mask.sum()) and (layout.batch, layout.length) == mask.shape
    rows = layout.to_rows(layout.pack(x))
    assert rows.shape == x.shape
    assert torch.equal(rows[mask], x[mask]) and torch.all(rows[~mask] == 0)
    # Any width: e.g. one value per token and head.
    per_head = torch.arange(len(layout) * 4.0).view(-1, 4)
    back = layout.to_rows(per_head)
    assert back.shape == (6, 6, 4) and torch.equal(back[mask], per_head) and torch.all(back[~mask] == 0)
    # Without a mask every token is real: to_rows is the inverse of pack.
    full = PackedTokens.of(x, None, None, num_images=6)
    assert len(full) == 36 and torch.equal(full.to_rows(full.pack(x)), x)


def test_packed_tokens_expand_a_per_row_head_mask_to_one_row_per_token():
    x, mask = padded_questions()
    layout = PackedTokens.of(x, mask, IMAGE_INDEX, num_images=3)
    head_mask = torch.rand(6, 4, generator=torch.Generator().manual_seed(0))
    per_token = layout.per_token(head_mask)
    assert per_token.shape == (len(layout), 4)
    expected = torch.cat([head_mask[i].expand(n, 4) for i, n in enumerate(mask.sum(1).tolist())])
    assert torch.equal(per_token, expected)
    shared = torch.rand(4)
    assert layout.per_token(shared) is shared and layout.per_token(None) is None  # (H,) and None as given


def test_packed_tokens_group_the_tokens_by_the_image_they_read():
    x, mask = padded_questions()
    layout = PackedTokens.of(x, mask, IMAGE_INDEX, num_images=3)
    groups = layout.groups
    assert isinstance(groups, ContextGroups) and groups.num_contexts == 3
    assert torch.equal(groups.context, IMAGE_INDEX[layout.rows])
    grouped = groups.group(layout.pack(x))  # (3, Lg, dim)
    counts = [int(mask[IMAGE_INDEX == image].sum()) for image in range(3)]
    assert groups.size == max(counts) and grouped.shape == (3, max(counts), 32)
    for image, count in enumerate(counts):
        # The real tokens of the image's rows, row by row, then zeros.
        expected = torch.cat([x[i][mask[i]] for i in range(6) if IMAGE_INDEX[i] == image])
        assert torch.equal(grouped[image, :count], expected) and torch.all(grouped[image, count:] == 0)
    assert torch.equal(groups.ungroup(grouped), layout.pack(x))
    # Without an image index, row i reads image i.
    own = PackedTokens.of(x, mask, None, num_images=6)
    assert torch.equal(own.groups.context, own.rows)


@pytest.fixture
def stack_and_images():
    torch.manual_seed(0)
    stack = FusionStack(2, 32, 4, kv_dim=24, gated=False, output_gate=True, mlp_layer="swiglu").eval()
    images = torch.randn(3, 9, 24, generator=torch.Generator().manual_seed(1))
    return stack, images


@pytest.mark.parametrize("self_attention", [False, True])
def test_each_question_gets_what_it_gets_alone_without_padding(self_attention):
    """Packing is exact: a padded question sharing its image with others is fused as if run alone."""
    torch.manual_seed(0)
    stack = FusionStack(2, 32, 4, kv_dim=24, gated=False, self_attention=self_attention).eval()
    images = torch.randn(3, 9, 24, generator=torch.Generator().manual_seed(1))
    x, mask = padded_questions()
    image_index = torch.tensor([2, 0, 2, 1, 0, 2])
    head_masks = [torch.rand(6, 4, generator=torch.Generator().manual_seed(2)), None]
    out, weights = stack(x, images, text_mask=mask, image_index=image_index, weights_from=[0, 1], head_masks=head_masks)
    for i, n in enumerate(mask.sum(1).tolist()):
        if n == 0:
            continue
        alone, alone_weights = stack(x[i : i + 1, :n], images[image_index[i : i + 1]], weights_from=[0, 1],
                                     head_masks=[head_masks[0][i], None])
        torch.testing.assert_close(out[i, :n], alone[0], atol=ATOL, rtol=0)
        for layer in (0, 1):
            torch.testing.assert_close(weights[layer][i, :, :n], alone_weights[layer][0], atol=ATOL, rtol=0)


def test_padding_passes_through_unchanged_with_no_weights(stack_and_images):
    stack, images = stack_and_images
    x, mask = padded_questions()
    out, weights = stack(x, images, text_mask=mask, image_index=torch.tensor([0, 1, 2, 0, 1, 2]), weights_from=[1])
    assert torch.equal(out[~mask], x[~mask])
    assert torch.all(weights[1].transpose(1, 2)[~mask] == 0)
    torch.testing.assert_close(weights[1].transpose(1, 2)[mask].sum(-1), torch.ones(int(mask.sum()), 4))


def test_gradients_reach_only_the_real_tokens_through_the_blocks(stack_and_images):
    stack, images = stack_and_images
    x, mask = padded_questions()
    x.requires_grad_(True)
    out, _ = stack(x, images, text_mask=mask, image_index=torch.tensor([0, 1, 2, 0, 1, 2]))
    out[mask].square().sum().backward()
    assert torch.all(x.grad[~mask] == 0) and torch.isfinite(x.grad).all()
    assert (x.grad[mask].abs().sum(-1) > 0).all()
    for name, p in stack.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name

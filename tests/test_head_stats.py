"""Head statistics, dead-head flags and role tags on hand-made attention with known answers."""

import math

import pytest
import torch

from vlfuse.analysis.head_roles import HeadRules, dead_heads, role_tags, uniform_distance
from vlfuse.analysis.head_stats import (
    HeadStatsAccumulator,
    attended_distance,
    head_agreement,
    head_output_norms,
    normalized_entropy,
    object_cells,
    object_mass,
    prefix_mass,
    top_patch_mass,
)
from vlfuse.layers import CrossAttention

GRID, PREFIX = (8, 8), 1
KEYS = PREFIX + GRID[0] * GRID[1]


def cell(row: int, col: int) -> int:
    """The image-token index of a grid cell (after the prefix token)."""
    return PREFIX + row * GRID[1] + col


def spread(cells, keys: int = KEYS) -> torch.Tensor:
    """A distribution uniform over the image tokens ``cells``: ``(keys,)``."""
    weights = torch.zeros(keys)
    weights[list(cells)] = 1.0 / len(cells)
    return weights


def neighbourhood(row: int, col: int) -> list[int]:
    """The 3x3 block of cells around (row, col)."""
    return [cell(row + dr, col + dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)]


def rows_of(*maps: torch.Tensor) -> torch.Tensor:
    """One query row whose heads are ``maps``: ``(1, H, keys)``."""
    return torch.stack(maps)[None]


# ------------------------------------------------------------------------------- statistics
def test_uniform_attention_has_entropy_one_and_the_uniform_spread():
    weights = rows_of(torch.full((KEYS,), 1.0 / KEYS))
    assert normalized_entropy(weights).item() == pytest.approx(1.0, abs=1e-6)
    assert top_patch_mass(weights, PREFIX).item() == pytest.approx(1.0 / KEYS)
    assert prefix_mass(weights, PREFIX).item() == pytest.approx(1.0 / KEYS)
    assert attended_distance(weights, GRID, PREFIX).item() == pytest.approx(uniform_distance(GRID), abs=1e-5)


def test_one_hot_attention_has_entropy_zero_top_mass_one_and_no_spread():
    weights = rows_of(spread([cell(2, 5)]), spread([0]))  # head 0 on a patch, head 1 on the CLS token
    torch.testing.assert_close(normalized_entropy(weights), torch.zeros(1, 2))
    torch.testing.assert_close(top_patch_mass(weights, PREFIX), torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(prefix_mass(weights, PREFIX), torch.tensor([[0.0, 1.0]]))
    assert attended_distance(weights, GRID, PREFIX)[0, 0].item() == pytest.approx(0.0, abs=1e-6)


def test_local_attention_has_a_small_distance_and_two_far_cells_half_their_separation():
    local = spread(neighbourhood(4, 3))
    far = spread([cell(0, 0), cell(6, 0)])  # 6 cells apart: every cell is 3 from the centroid
    distance = attended_distance(rows_of(local, far), GRID, PREFIX)[0]
    assert distance[0].item() == pytest.approx((4 * 1 + 4 * math.sqrt(2)) / 9, abs=1e-5)
    assert distance[0] < 0.5 * uniform_distance(GRID)
    assert distance[1].item() == pytest.approx(3.0, abs=1e-5)
    # Prefix weight does not count: the patch weights are renormalised over the grid.
    with_cls = 0.5 * local + 0.5 * spread([0])
    assert attended_distance(rows_of(with_cls), GRID, PREFIX).item() == pytest.approx(distance[0].item(), abs=1e-5)


def test_entropy_of_a_uniform_block_is_its_log_size():
    weights = rows_of(spread(neighbourhood(4, 4)))
    assert normalized_entropy(weights).item() == pytest.approx(math.log(9) / math.log(KEYS), abs=1e-6)


def test_object_mass_is_the_share_of_patch_weights_on_object_cells():
    objects = torch.zeros(1, GRID[0] * GRID[1], dtype=torch.bool)
    objects[0, [cell(1, 1) - PREFIX, cell(1, 2) - PREFIX]] = True
    on_object = spread([cell(1, 1), cell(1, 2)])
    half = spread([cell(1, 1), cell(7, 7)])
    with_cls = 0.5 * spread([cell(1, 1)]) + 0.5 * spread([0])
    mass = object_mass(rows_of(on_object, half, with_cls), objects, PREFIX)
    torch.testing.assert_close(mass, torch.tensor([[1.0, 0.5, 1.0]]))


def test_identical_heads_agree_fully_and_disjoint_heads_not_at_all():
    a, b = spread(neighbourhood(2, 2)), spread(neighbourhood(5, 5))
    agreement = head_agreement(rows_of(a, a, b))[0]
    torch.testing.assert_close(agreement[0, 1], torch.tensor(1.0))
    torch.testing.assert_close(agreement[0, 2], torch.tensor(0.0))
    torch.testing.assert_close(agreement.diagonal(), torch.ones(3))


def test_head_output_norms_split_the_output_projection_by_head():
    torch.manual_seed(0)
    attn = CrossAttention(16, 4)
    torch.nn.init.zeros_(attn.out_proj.bias)  # so that the output is the sum of the heads' shares
    inputs = torch.randn(2, 3, 16)  # (B, Lq, H * hd), head-major
    norms = head_output_norms(inputs, attn.out_proj.weight, 4)  # (2, 3, 4)
    for h in range(4):
        only = torch.zeros_like(inputs)
        only[..., 4 * h : 4 * h + 4] = inputs[..., 4 * h : 4 * h + 4]
        torch.testing.assert_close(norms[..., h], attn.out_proj(only).norm(dim=-1))
    with pytest.raises(ValueError, match="do not split into 5 heads"):
        head_output_norms(inputs, attn.out_proj.weight, 5)


@pytest.mark.parametrize("background", [(0.9, 0.85, 0.8), (0.0, 0.0, 0.0)], ids=["easy-vqa-like", "shapes-like"])
def test_object_cells_are_the_cells_that_differ_from_the_background(background):
    pixels = torch.tensor(background).view(3, 1, 1).expand(3, 32, 32).clone()
    pixels[:, 8:16, 20:28] = torch.tensor([0.1, 0.2, 0.9]).view(3, 1, 1)  # cells (2..3, 5..6) of a 4-px grid
    pixels[:, 30, 0] = torch.tensor([0.1, 0.9, 0.1])  # one stray pixel: under a quarter of its cell
    mask = object_cells(pixels[None], GRID).view(*GRID)
    expected = torch.zeros(GRID, dtype=torch.bool)
    expected[2:4, 5:7] = True
    torch.testing.assert_close(mask, expected)


def test_accumulator_means_equal_the_statistics_of_all_rows_at_once():
    torch.manual_seed(0)
    weights = torch.randn(10, 4, KEYS).softmax(-1)
    objects = torch.rand(10, GRID[0] * GRID[1]) > 0.7
    norms = torch.rand(10, 4)
    whole, parts = HeadStatsAccumulator(4, GRID, PREFIX), HeadStatsAccumulator(4, GRID, PREFIX)
    whole.update(weights, objects, norms)
    parts.update(weights[:3], objects[:3], norms[:3])
    parts.update(weights[3:], objects[3:], norms[3:])
    a, b = whole.result(), parts.result()
    for name in ("entropy", "top_patch_mass", "prefix_mass", "distance", "object_mass", "agreement", "contribution"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name))
    torch.testing.assert_close(a.entropy, normalized_entropy(weights).mean(0))
    torch.testing.assert_close(a.object_lift, a.object_mass / objects.float().mean())
    torch.testing.assert_close(a.contribution, norms.mean(0) / norms.mean())
    assert a.num_queries == 10


def test_accumulator_refuses_weights_of_another_layer_and_an_empty_result():
    accumulator = HeadStatsAccumulator(4, GRID, PREFIX)
    with pytest.raises(ValueError, match="no query rows"):
        accumulator.result()
    with pytest.raises(ValueError, match=r"weights must be \(queries, 4, 65\)"):
        accumulator.update(torch.rand(2, 3, KEYS))


# ----------------------------------------------------------------------------- dead and roles
def role_layer():
    """Eight queries of five heads, one per role, on images whose object is the centre 2x2 block."""
    centre = [cell(r, c) for r in (3, 4) for c in (3, 4)]
    objects = torch.zeros(8, GRID[0] * GRID[1], dtype=torch.bool)
    objects[:, [c - PREFIX for c in centre]] = True
    local_centres = [(1, 1), (6, 6), (1, 6), (6, 1)]
    rows = []
    for i in range(8):
        rows.append(
            torch.stack(
                [
                    spread([0]),  # sink: always the CLS token
                    torch.full((KEYS,), 1.0 / KEYS),  # global: uniform
                    spread(centre),  # object
                    spread(neighbourhood(*local_centres[i % 4])),  # local, away from the object
                    spread([cell(i, 0), cell(i, 7)]),  # mixed: two far cells, a different row each query
                ]
            )
        )
    return torch.stack(rows), objects  # (8, 5, KEYS), (8, cells)


def test_each_role_rule_picks_its_hand_made_head():
    weights, objects = role_layer()
    accumulator = HeadStatsAccumulator(5, GRID, PREFIX)
    accumulator.update(weights, objects, torch.ones(8, 5))
    stats = accumulator.result()
    assert role_tags(stats, GRID) == ["sink", "global", "object", "local", "mixed"]
    assert dead_heads(stats) == [False, True, False, False, False]  # the uniform head


def test_a_head_with_no_output_is_dead_and_thresholds_change_the_rules():
    weights, objects = role_layer()
    accumulator = HeadStatsAccumulator(5, GRID, PREFIX)
    accumulator.update(weights, objects, torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.01]]).expand(8, 5))
    stats = accumulator.result()
    assert dead_heads(stats) == [False, True, False, False, True]
    strict = HeadRules(object_lift=100.0, local_distance=0.8, dead_entropy=1.01, dead_contribution=0.0)
    assert role_tags(stats, GRID, strict) == ["sink", "global", "local", "mixed", "mixed"]
    assert dead_heads(stats, strict) == [False] * 5


def test_rules_are_written_out_with_their_thresholds():
    text = "\n".join(HeadRules(dead_entropy=0.93).describe(GRID))
    assert "normalised entropy >= 0.93" in text
    for role in ("sink", "global", "object", "local", "mixed"):
        assert f"**{role}**" in text

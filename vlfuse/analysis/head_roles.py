"""Dead-head flags and role tags from per-head statistics, by explicit, measurable rules.

The rules read a :class:`~vlfuse.analysis.head_stats.HeadStats`; their thresholds live in one
:class:`HeadRules` object, and :meth:`HeadRules.describe` writes them out for a report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlfuse.analysis.head_stats import HeadStats, attended_distance

ROLES = ("sink", "global", "object", "local", "mixed")
"""Role tags, in the order the rules are tried: a head gets the first one whose rule holds."""


@dataclass(frozen=True)
class HeadRules:
    """Thresholds of the dead-head flag, of the role tags and of the object masks.

    Attributes:
        dead_entropy: dead when the normalised entropy is at least this (near-uniform attention).
        dead_contribution: dead when the output contribution (relative to the layer's mean head)
            is at most this.
        sink_share: sink when the same image token is the top token for at least this share of
            the queries ...
        sink_mass: ... and holds at least this mean weight.
        global_entropy: global when the normalised entropy is at least this.
        object_mass: object when at least this share of the patch attention is on object cells ...
        object_lift: ... and that is at least this many times the object area (a uniform map's share).
        local_distance: local when the attended distance is at most this many grid cells and at
            most ``local_fraction`` of a uniform map's distance on the same grid ...
        local_fraction: see ``local_distance``.
        local_patch_mass: ... with at least this weight on the patch grid (not on prefix tokens).
        pixel_tolerance: a pixel is foreground when a channel differs from the background by more.
        cell_share: a grid cell holds an object when at least this share of its pixels is foreground.
    """

    dead_entropy: float = 0.95
    dead_contribution: float = 0.1
    sink_share: float = 0.8
    sink_mass: float = 0.5
    global_entropy: float = 0.8
    object_mass: float = 0.5
    object_lift: float = 2.0
    local_distance: float = 1.5
    local_fraction: float = 0.5
    local_patch_mass: float = 0.5
    pixel_tolerance: float = 0.15
    cell_share: float = 0.25

    def local_limit(self, grid: tuple[int, int]) -> float:
        """The largest attended distance (in cells) of a local head on ``grid``."""
        return min(self.local_distance, self.local_fraction * uniform_distance(grid))

    def describe(self, grid: tuple[int, int]) -> list[str]:
        """The rules as markdown bullet lines, thresholds included, for a ``grid`` of patches."""
        return [
            f"- **dead**: normalised entropy >= {self.dead_entropy} (near-uniform attention) or output "
            f"contribution <= {self.dead_contribution} of the layer's mean head.",
            "- Role tags are tried in this order; a head gets the first that holds:",
            f"  1. **sink**: one fixed image token (CLS or a patch) is the head's top token for >= "
            f"{self.sink_share:.0%} of the queries and holds >= {self.sink_mass} of the weight on average;",
            f"  2. **global**: normalised entropy >= {self.global_entropy} (attention spread over most tokens);",
            f"  3. **object**: >= {self.object_mass:.0%} of the patch attention on object cells, and >= "
            f"{self.object_lift}x the object area (the share a uniform map would give them);",
            f"  4. **local**: attended distance <= {self.local_limit(grid):.2f} grid cells (the smaller of "
            f"{self.local_distance} and {self.local_fraction} x {uniform_distance(grid):.2f}, the distance of a "
            f"uniform map on this {grid[0]}x{grid[1]} grid), with >= {self.local_patch_mass:.0%} of the weight "
            "on the patch grid;",
            "  5. **mixed**: none of the above.",
            f"- Object cells: the background is the median colour of the image's border pixels; a pixel is "
            f"foreground when a channel differs from it by more than {self.pixel_tolerance} (pixels in "
            f"[0, 1]); a cell holds an object when >= {self.cell_share:.0%} of its pixels are foreground "
            "(computed on the image as the model saw it).",
        ]


def uniform_distance(grid: tuple[int, int]) -> float:
    """The attended distance of a uniform map over ``grid``: the scale a local head is measured against."""
    uniform = torch.full((1, 1, grid[0] * grid[1]), 1.0 / (grid[0] * grid[1]), dtype=torch.float64)
    return float(attended_distance(uniform, grid, 0))


def dead_heads(stats: HeadStats, rules: HeadRules = HeadRules()) -> list[bool]:
    """One flag per head: near-uniform attention or a near-zero contribution to the output."""
    uniform = stats.entropy >= rules.dead_entropy
    silent = stats.contribution <= rules.dead_contribution  # False where the contribution is NaN
    return (uniform | silent).tolist()


def role_tags(stats: HeadStats, grid: tuple[int, int], rules: HeadRules = HeadRules()) -> list[str]:
    """One role from :data:`ROLES` per head of a layer whose patch grid is ``grid``, by ``rules``."""
    local_limit = rules.local_limit(grid)
    return [_role(stats, h, rules, local_limit) for h in range(stats.num_heads)]


def _role(stats: HeadStats, h: int, rules: HeadRules, local_limit: float) -> str:
    if stats.modal_share[h] >= rules.sink_share and stats.modal_mass[h] >= rules.sink_mass:
        return "sink"
    if stats.entropy[h] >= rules.global_entropy:
        return "global"
    if stats.object_mass[h] >= rules.object_mass and stats.object_lift[h] >= rules.object_lift:
        return "object"
    if stats.distance[h] <= local_limit and 1 - stats.prefix_mass[h] >= rules.local_patch_mass:
        return "local"
    return "mixed"

"""Side-by-side timing on a shared machine: interleaved calls and medians of paired ratios.

On a machine shared with other processes, absolute times drift with the load from second to
second. Two things timed side by side see the same load, so their ratio is steady where their
times are not: every repetition runs each case once, in an order rotated by one case per
repetition, and a comparison is the median over repetitions of the ratio of the two cases' times
in the same repetition (:meth:`Timings.ratio`), not the ratio of their medians. Benchmarks report
these ratios; absolute times are context.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Hashable, Mapping, Sequence


@dataclass
class Timings:
    """Seconds of every timed call, by case; ``samples[case][i]`` ran in repetition ``i``.

    Attributes:
        samples: ``{case: [seconds of repetition 0, 1, ...]}``, warm-up calls left out.
    """

    samples: dict[Hashable, list[float]]

    def median(self, case: Hashable) -> float:
        """Median seconds of ``case``."""
        return statistics.median(self.samples[case])

    def ratio(self, case: Hashable, reference: Hashable) -> float:
        """Median over repetitions of ``case``'s time / ``reference``'s time in the same repetition."""
        return paired_ratio(self.samples[case], self.samples[reference])


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median of ``numerators[i] / denominators[i]``: the ratio of two cases timed side by side.

    Raises:
        ValueError: the sequences differ in length or are empty.
    """
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(
            f"paired samples must be two equally long, non-empty sequences, got {len(numerators)} and "
            f"{len(denominators)}"
        )
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def time_interleaved(
    cases: Mapping[Hashable, Callable[[], object]],
    repeats: int,
    warmup: int = 0,
    *,
    clock: Callable[[], float] | None = None,
) -> Timings:
    """Time every case once per repetition, rotating the order, so that noise falls on all alike.

    Repetition ``r`` starts with case ``r mod n`` of the ``n`` cases and runs the others after it
    in order, wrapping around; the first ``warmup`` repetitions run the same way, untimed.

    Args:
        cases: ``{name: callable}``; each call is one timed sample (prepare inputs outside it).
        repeats: timed repetitions, at least 1.
        warmup: repetitions run first and not recorded.
        clock: seconds as a float (default :func:`time.perf_counter`).

    Raises:
        ValueError: ``repeats`` is below 1, ``warmup`` below 0, or there are no cases.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be at least 0, got {warmup}")
    if not cases:
        raise ValueError("no cases to time")
    clock = clock or perf_counter
    names = list(cases)
    samples: dict[Hashable, list[float]] = {name: [] for name in names}
    for repetition in range(warmup + repeats):
        shift = repetition % len(names)
        for name in names[shift:] + names[:shift]:
            start = clock()
            cases[name]()
            elapsed = clock() - start
            if repetition >= warmup:
                samples[name].append(elapsed)
    return Timings(samples)

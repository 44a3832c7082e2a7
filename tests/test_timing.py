"""vlfuse.analysis.timing: interleaved calls in rotated order, and medians of paired ratios (on a fake clock)."""

import pytest

from vlfuse.analysis.timing import Timings, paired_ratio, time_interleaved


class FakeClock:
    """A clock that moves only when a case says how long it took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def case(self, name: str, durations: list[float], calls: list[str]):
        """A case that logs its call and advances the clock by its next duration."""
        remaining = iter(durations)

        def run():
            calls.append(name)
            self.now += next(remaining)

        return run


def test_each_repetition_runs_every_case_once_starting_one_case_later():
    calls = []
    cases = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    time_interleaved(cases, repeats=3, warmup=1)
    assert calls == list("abc" "bca" "cab" "abc")  # the first repetition is the warm-up


def test_samples_are_each_calls_own_time_in_repetition_order_without_the_warmup():
    clock, calls = FakeClock(), []
    cases = {
        "slow": clock.case("slow", [100.0, 4.0, 6.0, 8.0], calls),
        "fast": clock.case("fast", [50.0, 1.0, 2.0, 3.0], calls),
    }
    timings = time_interleaved(cases, repeats=3, warmup=1, clock=clock)
    assert timings.samples == {"slow": [4.0, 6.0, 8.0], "fast": [1.0, 2.0, 3.0]}
    assert timings.median("slow") == 6.0 and timings.median("fast") == 2.0
    assert calls == ["slow", "fast", "fast", "slow", "slow", "fast", "fast", "slow"]


def test_the_ratio_pairs_calls_of_one_repetition_and_takes_their_median():
    # A burst of load slows both cases of repetition 1 tenfold: each repetition's ratio stays 2,
    # the ratio of the medians (30 / 3 = 10) does not.
    clock, calls = FakeClock(), []
    cases = {
        "before": clock.case("before", [2.0, 200.0, 30.0, 40.0], calls),
        "after": clock.case("after", [1.0, 100.0, 3.0, 20.0], calls),
    }
    timings = time_interleaved(cases, repeats=4, clock=clock)
    assert timings.ratio("before", "after") == 2.0  # the paired ratios: 2, 2, 10, 2
    assert timings.median("before") / timings.median("after") == pytest.approx(35.0 / 11.5)
    assert timings.ratio("after", "before") == 0.5


def test_paired_ratio_of_raw_samples():
    assert paired_ratio([3.0, 8.0, 1.0], [1.0, 2.0, 1.0]) == 3.0
    assert Timings({"x": [1.0, 3.0], "y": [2.0, 2.0]}).ratio("x", "y") == pytest.approx(1.0)  # median of 0.5, 1.5


@pytest.mark.parametrize(
    "numerators, denominators", [([1.0, 2.0], [1.0]), ([], [])], ids=["unpaired", "empty"]
)
def test_paired_ratio_refuses_samples_that_do_not_pair(numerators, denominators):
    with pytest.raises(ValueError, match="paired samples must be two equally long, non-empty sequences"):
        paired_ratio(numerators, denominators)


@pytest.mark.parametrize(
    "cases, repeats, warmup, message",
    [
        ({"a": lambda: None}, 0, 0, "repeats must be at least 1, got 0"),
        ({"a": lambda: None}, 1, -1, "warmup must be at least 0, got -1"),
        ({}, 1, 0, "no cases to time"),
    ],
)
def test_bad_arguments_are_refused(cases, repeats, warmup, message):
    with pytest.raises(ValueError, match=message):
        time_interleaved(cases, repeats, warmup)

import math

import pytest

from skipsearch.search.measure import Interval, paired_runs, ratio_interval


def test_ratio_interval_is_a_geometric_mean_with_a_t_interval_on_logs():
    interval = ratio_interval([0.5, 2.0, 1.0])
    assert interval.estimate == pytest.approx(1.0)
    # stdev of logs = ln 2, n = 3, t(0.975, 2) = 4.303
    half = 4.302652729911275 * math.log(2) / math.sqrt(3)
    assert interval.low == pytest.approx(math.exp(-half)) and interval.high == pytest.approx(math.exp(half))
    assert interval.pairs == 3 and interval.low <= 1.0 <= interval.high < 10.0


def test_identical_ratios_give_a_point_interval_and_one_ratio_an_unbounded_one():
    assert ratio_interval([1.3, 1.3]) == Interval(pytest.approx(1.3), pytest.approx(1.3), pytest.approx(1.3), 2)
    single = ratio_interval([1.3])
    assert single.low == 0.0 and single.high == math.inf
    assert str(single) == "1.30x (one paired run: no interval)"
    assert str(ratio_interval([1.3, 1.3])) == "1.30x (95% interval 1.30-1.30, 2 paired runs)"


@pytest.mark.parametrize("bad", [[], [0.0], [-1.0, 1.0], [math.inf]])
def test_ratio_interval_refuses_impossible_ratios(bad):
    with pytest.raises(ValueError):
        ratio_interval(bad)


def test_paired_runs_alternate_the_order_and_time_each_side_with_the_clock():
    calls, now = [], [0.0]

    def clock():
        return now[0]

    def runner(name, cost):
        def run():
            calls.append(name)
            now[0] += cost
            return name
        return run

    pairs = paired_runs(runner("base", 2.0), runner("cand", 1.0), repeats=3, first_index=1, clock=clock)
    assert calls == ["cand", "base", "base", "cand", "cand", "base"]
    assert pairs == [(("base", 2.0), ("cand", 1.0))] * 3

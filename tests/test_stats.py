"""The comparison statistics (benchmarks/stats.py) on hand-computed inputs."""

import pytest

from benchmarks.stats import paired_interval, summarize, t_quantile_975, verdict


def test_summarize_by_hand():
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["n"] == 4
    assert s["sd"] == pytest.approx((5 / 3) ** 0.5)  # squared deviations 2.25+0.25+0.25+2.25 = 5, / 3
    assert summarize([7.0]) == {"mean": 7.0, "sd": 0.0, "n": 1}


def test_paired_interval_by_hand():
    # differences 1, 2, 3: mean 2, sd 1, t(0.975, 2) = 4.303, half width 4.303 / sqrt(3) = 2.4844
    iv = paired_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert iv["mean"] == 2.0 and iv["n"] == 3
    assert iv["lo"] == pytest.approx(2.0 - 2.48434, abs=1e-4)
    assert iv["hi"] == pytest.approx(2.0 + 2.48434, abs=1e-4)
    assert verdict(iv) == "not shown"  # the interval [-0.48, 4.48] contains 0


def test_verdicts():
    tight_below = paired_interval([1.0, 1.1, 0.9, 1.0], [2.0, 2.1, 1.9, 2.05])
    assert tight_below["hi"] < 0 and verdict(tight_below) == "holds"
    tight_above = paired_interval([3.0, 3.1, 2.9], [1.0, 1.0, 1.0])
    assert verdict(tight_above) == "reversed"
    assert verdict(paired_interval([1.0], [2.0])) == "not shown"  # one seed shows nothing
    assert verdict(tight_below, below=-2.0) == "reversed"  # the claim "A < B by more than 2"


def test_quantiles_and_bad_input():
    assert t_quantile_975(1) == 12.706 and t_quantile_975(30) == 2.042 and t_quantile_975(100) == 1.96
    with pytest.raises(ValueError, match="two samples"):
        t_quantile_975(0)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_interval([1.0, 2.0], [1.0])

"""The one quantile definition and the latency histograms nodes keep (backend/latency.py)."""

from __future__ import annotations

import random

import pytest

from backend.errors import ProtocolError
from backend.latency import LATENCY_BUCKETS_S, Histogram, LatencyHistograms, quantile


def test_quantile_interpolates_between_the_two_nearest_ranks() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert quantile(values, 0.0) == 1.0
    assert quantile(values, 1.0) == 4.0
    assert quantile(values, 0.5) == 2.5  # the median of an even count: the mean of the middle two
    assert quantile(values, 0.25) == pytest.approx(1.75)  # rank 0.75: three quarters of the way from 1 to 2
    assert quantile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        quantile(values, 50)  # a percent, not a fraction


def test_a_histogram_estimate_lands_in_the_bucket_of_the_true_quantile() -> None:
    rng = random.Random(7)
    samples = sorted(rng.lognormvariate(-7, 1.2) for _ in range(5000))  # about 1 ms, a long tail
    histogram = Histogram()
    for s in samples:
        histogram.observe(s)
    assert histogram.count == 5000 and histogram.sum_s == pytest.approx(sum(samples))
    for q in (0.5, 0.9, 0.99):
        exact = quantile(samples, q)
        bucket = next(i for i, bound in enumerate(LATENCY_BUCKETS_S) if exact <= bound)
        lower = LATENCY_BUCKETS_S[bucket - 1] if bucket else 0.0
        assert lower <= histogram.quantile(q) <= LATENCY_BUCKETS_S[bucket], q


def test_histogram_quantile_interpolates_inside_the_bucket_and_stops_at_the_last_bound() -> None:
    histogram = Histogram((1.0, 2.0, 4.0))
    for value in (1.5, 1.5, 3.0, 3.0):  # two in (1, 2], two in (2, 4]
        histogram.observe(value)
    assert histogram.counts == [0, 2, 2, 0]
    assert histogram.quantile(0.5) == 2.0  # rank 2 of 4: the top of the second bucket
    assert histogram.quantile(0.75) == 3.0  # rank 3: half-way through (2, 4]
    histogram.observe(100.0)  # above every bound
    assert histogram.quantile(1.0) == 4.0  # the histogram knows nothing finer than its last bound
    with pytest.raises(ValueError, match="empty"):
        Histogram((1.0,)).quantile(0.5)


def test_histograms_of_two_nodes_add_up() -> None:
    a, b = LatencyHistograms(), LatencyHistograms()
    for _ in range(3):
        a.observe("get_batch", 0.001)
    b.observe("get_batch", 0.2)
    b.observe("put_batch", 0.01)
    total = Histogram()
    for node in (a, b):
        total.add(LatencyHistograms.from_json(node.to_json()).ops["get_batch"])  # through STAT's JSON
    assert total.count == 4 and total.sum_s == pytest.approx(0.203)
    assert total.quantile(0.5) <= 0.001 < 0.1 < total.quantile(1.0) <= 0.2
    with pytest.raises(ValueError, match="different buckets"):
        total.add(Histogram((1.0,)))


@pytest.mark.parametrize(
    "body",
    [
        {"ops": {}},
        {"bounds_s": [2.0, 1.0], "ops": {}},
        {"bounds_s": [1.0], "ops": {"get_batch": {"counts": [1], "sum_s": 0.1}}},
        {"bounds_s": [1.0], "ops": {"get_batch": {"counts": [1, -1], "sum_s": 0.1}}},
        {"bounds_s": [1.0], "ops": {"get_batch": {"counts": [1, 0]}}},
        {"bounds_s": [1.0], "ops": {"get_batch": [1, 0]}},
    ],
)
def test_a_malformed_latency_answer_is_a_protocol_error(body: dict) -> None:
    with pytest.raises(ProtocolError, match="latency"):
        LatencyHistograms.from_json(body)

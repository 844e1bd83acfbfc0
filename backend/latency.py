"""Request latency as fixed-bucket histograms, and the one quantile definition kvpool uses.

A node counts each request's service time into fixed buckets per op
(:class:`LatencyHistograms`): constant memory, nothing sorted on the node's loop,
and the histograms of many nodes add up, which quantiles of sample windows do not.
``backend.metrics`` exports them as a Prometheus histogram
(``kvpool_node_request_latency_seconds``), ``kvpool stats`` sums them over the nodes
and estimates p50/p99 from the sum (:meth:`Histogram.quantile`), and the bench takes
quantiles of its exact samples (:func:`quantile`). All of them interpolate linearly
with :func:`quantile`: between the two nearest samples, or inside the bucket that
holds the rank.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.errors import ProtocolError

__all__ = ["LATENCY_BUCKETS_S", "Histogram", "LatencyHistograms", "quantile"]

# Upper bounds of the buckets, in seconds: 1-2-5 steps from 50 us (a PING on loopback)
# to 30 s (a reply the client does not read in that time closes its connection).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
)


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0 <= q <= 1) of ascending values, linear between the two nearest ranks.

    The rank is ``q * (n - 1)``, as numpy's default: the median of an even count is the
    mean of the middle two, ``q=0`` the smallest and ``q=1`` the largest value.
    """
    if not sorted_values:
        raise ValueError("the quantile of no values is undefined")
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is outside 0..1")
    rank = q * (len(sorted_values) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low))


@dataclass
class Histogram:
    """Counts of observations per bucket: ``counts[i]`` is of values <= ``bounds[i]`` (and
    above ``bounds[i - 1]``); the last count is of values above every bound."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds

    def add(self, other: Histogram) -> None:
        """Add ``other``'s counts (another node's, say); both must have the same buckets."""
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets cannot be added")
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.sum_s += other.sum_s

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` per bucket, the last bound ``inf``: Prometheus's ``le``."""
        total = 0
        out = []
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            total += count
            out.append((bound, total))
        return out

    def quantile(self, q: float) -> float:
        """An estimate of the ``q``-quantile, as Prometheus's ``histogram_quantile`` makes it.

        The bucket holding rank ``q * count`` is found and the value interpolated
        linearly inside it (the first bucket starts at 0). A rank above the last bound
        answers the last bound: the histogram knows nothing finer.
        """
        total = self.count
        if total == 0:
            raise ValueError("the quantile of an empty histogram is undefined")
        if not 0 <= q <= 1:
            raise ValueError(f"quantile {q} is outside 0..1")
        rank = q * total
        below = 0
        for i, count in enumerate(self.counts):
            if count and below + count >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                lower = self.bounds[i - 1] if i else 0.0
                return quantile((lower, self.bounds[i]), (rank - below) / count)
            below += count
        return self.bounds[-1]  # not reached: the counts add up to ``total``

    def to_json(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum_s": round(self.sum_s, 6)}

    @classmethod
    def from_json(cls, bounds: Sequence[float], body: Any) -> Histogram:
        """One op's histogram from a node's STAT answer; ProtocolError if it is malformed."""
        counts = body.get("counts") if isinstance(body, dict) else None
        sum_s = body.get("sum_s") if isinstance(body, dict) else None
        if (
            not isinstance(counts, list)
            or len(counts) != len(bounds) + 1
            or not all(isinstance(c, int) and c >= 0 for c in counts)
            or not isinstance(sum_s, (int, float))
        ):
            raise ProtocolError(
                f"latency histogram {str(body)[:80]} is not {{counts: {len(bounds) + 1} counts, sum_s}}"
            )
        return cls(tuple(bounds), counts, float(sum_s))


class LatencyHistograms:
    """One :class:`Histogram` of service times per op, as a node keeps them."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.ops: dict[str, Histogram] = {}

    def observe(self, op: str, seconds: float) -> None:
        histogram = self.ops.get(op)
        if histogram is None:
            histogram = self.ops[op] = Histogram(self.bounds)
        histogram.observe(seconds)

    def to_json(self) -> dict[str, Any]:
        """What STAT carries as ``latency``: the bounds once, then each op's counts and sum."""
        return {"bounds_s": list(self.bounds), "ops": {op: h.to_json() for op, h in sorted(self.ops.items())}}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> LatencyHistograms:
        """The histograms of a node's STAT ``latency``; ProtocolError if it is malformed."""
        bounds, ops = body.get("bounds_s"), body.get("ops")
        if (
            not isinstance(bounds, list)
            or not bounds
            or not all(isinstance(b, (int, float)) for b in bounds)
            or bounds != sorted(bounds)
            or not isinstance(ops, dict)
        ):
            raise ProtocolError("a node's latency is not {bounds_s: ascending bounds, ops: {op: histogram}}")
        out = cls(tuple(float(b) for b in bounds))
        out.ops = {str(op): Histogram.from_json(out.bounds, h) for op, h in ops.items()}
        return out

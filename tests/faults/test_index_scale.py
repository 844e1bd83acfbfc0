"""The Redis side of a large pool: a dead node's entries swept fast without stalling Redis, admin verbs
over a large index with every Redis call short (``bench.scale.sweep``, the same code as the figures).

``make test`` runs them small (seconds); ``make faults`` (``KVPOOL_FULL=1``) runs the sweep at 200,000
dead entries and the admin verbs over 1,000,000 keys. The index is written directly (pipelined HSETs
of what a commit writes); a real node process reaps it, the real CLI reads it.
"""

from __future__ import annotations

import os

import pytest

from bench.scale.sweep import CALL_TARGET_MS, admin, sweep

FULL = bool(os.environ.get("KVPOOL_FULL"))  # `make faults`: the 200,000-entry form
SWEEP_CHUNKS = 200_000 if FULL else 30_000
# The walk reads about 150,000-300,000 keys a second here; the reaper of the release before read
# 500 a second (60 s for 30,000, 400 s for 200,000). The bounds leave a loaded machine 10x room.
SWEEP_WALK_BOUND_S = 30.0 if FULL else 6.0
ADMIN_KEYS = 1_000_000 if FULL else 50_000


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(600 if FULL else 120)
def test_a_dead_nodes_entries_are_swept_in_seconds_and_no_redis_call_takes_10ms():
    figures = sweep(SWEEP_CHUNKS, grace_s=0.5)
    print(figures)
    assert figures["fields_removed"] == SWEEP_CHUNKS, figures
    assert figures["sample_dead_fields_left"] == 0, figures
    assert figures["sample_live_fields_kept"] == "1000/1000", figures  # only the dead node's copies went
    assert figures["sweep_walk_s"] <= SWEEP_WALK_BOUND_S, figures
    # SLOWLOG: Redis's own time per command, counted in wall time. In `make test` Redis shares two
    # cores with two test workers and their nodes, and one sweep step of ~240 was seen descheduled
    # (23 ms for 125 keys, where steps take ~1 ms): there one call may be late, none 5x the target.
    # `make faults` runs alone and holds every call under the target.
    late_allowed, worst_ms = (0, CALL_TARGET_MS) if FULL else (1, 5 * CALL_TARGET_MS)
    assert figures["redis_calls_over_10ms"] <= late_allowed, figures
    assert figures["redis_slowest_call_ms"] < worst_ms, figures


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(900 if FULL else 120)
def test_ls_evict_stats_and_status_over_a_large_index_keep_every_redis_call_short_and_the_cli_small():
    figures = admin(ADMIN_KEYS)
    print(figures)
    assert figures["ls_prefix"]["rows"] == 1000  # one model's keys, found by SCAN over every key
    assert figures["evict_prefix"]["evicted"] == 1000
    for verb in ("ls_prefix", "evict_prefix", "stats", "status"):
        assert figures[verb]["redis_calls_over_10ms"] == 0, (verb, figures[verb])
        assert figures[verb]["cli_peak_rss_mib"] < 200, (verb, figures[verb])  # one SCAN batch at a time

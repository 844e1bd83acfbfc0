"""The benches of what tenants, pins and the event ring cost a node (docs/scale-node.md), run small.

``bench.scale.node``'s options must measure what they say: a tenant's fill is held and
accounted as that tenant's, the pins are taken, the ring is on. ``bench.scale.event_ack`` must
time puts to a node with the ring and one without, and the ring must have seen them.
"""

from __future__ import annotations

import pytest

from bench.scale import event_ack
from bench.scale import node as scale_node

SMALL_FILL = 24_000  # the least the node measurement takes (leases, requests in flight, rounds, 1,000 lookups)


def test_scale_node_fills_as_a_tenant_with_the_ring_on_and_pins_its_share(processes):
    extras = scale_node.Extras(tenant="acme", event_ring_keys=1000, pin_share=0.01)
    out = scale_node.measure_node(SMALL_FILL, "lru", extras)
    # measure_node itself asserts the tenant's bytes (every chunk the large node holds) and the pinned count
    assert out["extras"] == {"tenant": "acme", "event_ring_keys": 1000, "pin_share": 0.01}
    assert out["pinned_chunks"] == SMALL_FILL // 100
    assert out["key_bytes_mean"] > len("~t/acme/") + 60  # the key the node holds: the tenant's prefix counted in


def test_scale_node_refuses_a_tenant_name_no_client_could_use_and_needs_none(capsys):
    with pytest.raises(SystemExit):
        scale_node.main(["--tenant", "not a name", "--chunks", str(SMALL_FILL)])
    assert "--tenant: tenant 'not a name' must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no --tenant: the defaults parse, and the next check speaks
        scale_node.main(["--chunks", "10"])
    assert "--chunks must be more than 10,000" in capsys.readouterr().err


def test_event_ack_times_puts_to_a_node_with_the_ring_and_one_without(processes):
    out = event_ack.measure(rounds=10, batch=4, ring_keys=500)  # asserts the ring saw the last put
    assert out["off_ms"]["p50"] > 0 and out["ring_ms"]["p50"] > 0
    assert out["ratio_p50"] == out["ring_ms"]["p50"] / out["off_ms"]["p50"]


def test_event_ack_with_tokens_checks_the_ring_kept_them(processes):
    out = event_ack.measure(rounds=6, batch=4, ring_keys=500, tokens=64)  # asserts the last put's records came back
    assert out["tokens"] == 64 and out["ratio_p50"] > 0

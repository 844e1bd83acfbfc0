"""Someone who holds the Redis password but not the pool token rewrites the index.

They can make readers miss (deny service); they can never make a reader return bytes other
than the ones stored under the key it asked for, nor make it talk to a node that cannot prove
the token (tests/security/test_handshake.py covers forged registry entries). A real node, a
real redis-server written to directly, a real client.
"""

from __future__ import annotations

import os

import redis

from backend.metadata import Location
from kvpool import Chunk, PoolConfig, SyncPoolClient
from tests.support.index import copies, index_key, slots

TOKEN = "forgery-token-0123456789abcdef01"


def test_forged_index_entries_make_misses_never_another_keys_bytes(node_factory, redis_server, pool_url, namespace):
    node_factory(env={"KVPOOL_TOKEN": TOKEN})
    url = pool_url.replace("kvpool://", f"kvpool://:{TOKEN}@")
    a, b = os.urandom(64 * 1024), os.urandom(64 * 1024)
    with SyncPoolClient(PoolConfig.from_url(url)) as client:
        client.put([Chunk("a", a), Chunk("b", b)])
        live = client.nodes()[0]
        raw = redis.Redis.from_url(redis_server.url)
        b_loc = copies(raw, namespace, "b")[live.node_id]
        slot = str(slots(raw, namespace)[live.node_id])
        forged = {
            # "a" claims to be b's copy (b's size and checksum) on the live node
            "a": {slot: b_loc.encode()},
            # a key never stored, pointed at the live node with b's location
            "never-stored": {slot: b_loc.encode()},
            # copies on a slot no node holds, and a value that does not parse
            "ghost": {"999": Location("no-such-node", live.epoch, "dram", 65536, 1).encode()},
            "garbage": {slot: b"not|a|location"},
        }
        for key, fields in forged.items():
            raw.delete(index_key(namespace, key))
            raw.hset(index_key(namespace, key), mapping=fields)
        got = client.get(["a", "never-stored", "ghost", "garbage", "b"])
        raw.close()
    assert got[0] is None or bytes(got[0].data) == a  # a's own bytes or a miss: never b's
    assert got[1:4] == [None, None, None]
    assert got[4] is not None and bytes(got[4].data) == b  # the untouched key still reads

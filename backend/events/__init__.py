"""KV events for routers: the pool's stores and removals in vLLM's wire format (docs/fleet-events.md).

- ``wire``: vLLM's ``KVEventBatch`` and its events as msgspec structs, in the form each vLLM release reads;
- ``keys``: which router block a pool key stands for;
- ``view``: the pool's blocks as the nodes' rings report them, and the events each change makes;
- ``auth``: the CURVE keys every holder of the pool token derives;
- ``endpoint``: the ``kvpool events`` process (ZMQ PUB, ROUTER replay, snapshots).

Imports pyzmq and msgspec (the ``events`` extra); nothing else in the pool does.
"""

from backend.events.auth import CurveKeys, curve_keys
from backend.events.endpoint import DEFAULT_CHUNK_TOKENS, EndpointConfig, EventsEndpoint
from backend.events.wire import DEFAULT_FORM, WIRE_FORMS, Wire

__all__ = [
    "CurveKeys",
    "curve_keys",
    "DEFAULT_CHUNK_TOKENS",
    "EndpointConfig",
    "EventsEndpoint",
    "DEFAULT_FORM",
    "WIRE_FORMS",
    "Wire",
]

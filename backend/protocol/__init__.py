"""The wire format between clients and pool nodes (spec: docs/protocol.md): a pure codec, no I/O.

One part per concern; a caller imports a name from the part that defines it
(``from backend.protocol.reads import GetBatch``):

- ``frame``: the 36-byte header, op and status codes, :class:`Limits`, the checksum, which
  error a status stands for, and :class:`OpCodec`, the base of every op's codec;
- ``meta``: the meta section's building blocks: :class:`ItemMeta`, the key and item checks,
  the bounded reader, key and flag lists, JSON metas;
- ``json_codec``: :class:`JsonReport`, the one codec of the JSON reports;
- ``tokens``: a chunk's token record (its token ids and parent hash), which a put carries
  and EVENTS hands back;
- one part per op family, each op's codec a class in it: ``puts`` (PutBatch, PutStaged),
  ``reads`` (ExistsBatch, DeleteBatch, GetBatch, Lease, Release, Touch), ``channel``
  (ChannelGet, the part ``nccl_channel`` uses), ``inventory`` (Inventory, VerifyBatch),
  ``pins`` (Pin, Unpin, Pins), ``events`` (Events) and ``reports`` (Stat and its
  :class:`NodeReport`, Ping).

Each op family's part imports only ``frame``, ``meta``, ``json_codec`` and ``tokens``, so none
needs another's codec to be read. The handshake's codec (HELLO, AUTH) is ``backend.handshake``,
a room of its own beside this one.

The package itself exports only what nearly every caller needs (``__all__``, held by
tests/test_protocol_surface.py) and :data:`CODECS`, every op's codec by its op.
"""

from backend.protocol import channel, events, inventory, pins, puts, reads, reports  # noqa: F401  (their codecs)
from backend.protocol.frame import CODECS, DEFAULT_LIMITS, VERSION, Limits, Op, OpCodec, Status, checksum
from backend.protocol.meta import ItemMeta

__all__ = ["CODECS", "DEFAULT_LIMITS", "VERSION", "ItemMeta", "Limits", "Op", "OpCodec", "Status", "checksum"]

"""The wire format between clients and pool nodes (spec: docs/protocol.md): a pure codec, no I/O.

One part per concern; every name of the wire API is importable from here
(``from backend.protocol import ItemMeta``):

- ``frame``: the 36-byte header, op and status codes, :class:`Limits`, the checksum, and
  which error a status stands for;
- ``meta``: the meta section's building blocks: :class:`ItemMeta`, the key and item checks,
  the bounded reader, key and flag lists, JSON metas;
- ``puts``: PUT_BATCH and PUT_STAGED (items, put options, per-item outcomes);
- ``reads``: GET_BATCH's answer, LEASE and RELEASE;
- ``channel``: CHANNEL_GET (the part ``nccl_channel`` uses);
- ``inventory``: INVENTORY and VERIFY_BATCH (admin);
- ``reports``: STAT's answer (:class:`NodeReport` and its parts).

Each part imports only ``frame`` and ``meta`` of this package (``meta`` only ``frame``), so
none needs another op family's codec to be read. The handshake's codec (HELLO, AUTH) is
``backend.handshake``, a room of its own beside this one.
"""

from backend.protocol.channel import (
    MAX_OFFER_DIGEST_CHARS,
    MAX_PAIR_ID_BYTES,
    ChannelRequest,
    decode_channel_request,
    decode_channel_response,
    encode_channel_request,
    encode_channel_response,
)
from backend.protocol.frame import (
    DEFAULT_LIMITS,
    HEADER,
    MAGIC,
    RESPONSE_BIT,
    VERSION,
    Header,
    Limits,
    Op,
    Status,
    checksum,
    checksum_stream,
    decode_header,
    encode_header,
    error_for_status,
    status_for_error,
    verify_meta,
)
from backend.protocol.inventory import (
    MAX_INVENTORY_PAGE,
    InventoryPage,
    InventoryRow,
    Verified,
    decode_inventory_request,
    decode_inventory_response,
    encode_inventory_request,
    encode_inventory_response,
)
from backend.protocol.meta import (
    ANY_FINGERPRINT,
    NO_FINGERPRINT,
    ItemMeta,
    OtherLayout,
    check_item,
    check_key,
    decode_flags,
    decode_json,
    decode_keys,
    encode_flags,
    encode_json,
    encode_keys,
)
from backend.protocol.puts import (
    DEFAULT_PUT_WAIT_MS,
    MAX_PUT_WAIT_MS,
    MAX_STAGE_NAME_BYTES,
    PUT_BUSY,
    PUT_INTEGRITY,
    PUT_NO_ROOM,
    PUT_STORED,
    STAGE_TOKEN_BYTES,
    PutOptions,
    decode_items,
    decode_put_batch,
    decode_put_staged,
    encode_items,
    encode_put_batch,
    encode_put_staged,
    put_outcome,
)
from backend.protocol.reads import (
    LEASE_MAP,
    NO_OFFSET,
    decode_get_request,
    decode_get_response,
    decode_lease_request,
    decode_lease_response,
    decode_release,
    decode_touch,
    encode_get_request,
    encode_get_response,
    encode_lease_request,
    encode_lease_response,
    encode_release,
    encode_touch,
)
from backend.protocol.reports import (
    ArenaReport,
    NodeReport,
    RecentReport,
    RecoveryReport,
    RepublishReport,
    TierReport,
    decode_node_report,
    encode_node_report,
    tiers_from_json,
)

__all__ = [
    # frame
    "MAGIC",
    "VERSION",
    "HEADER",
    "RESPONSE_BIT",
    "Op",
    "Status",
    "Limits",
    "DEFAULT_LIMITS",
    "Header",
    "checksum",
    "checksum_stream",
    "encode_header",
    "decode_header",
    "verify_meta",
    "error_for_status",
    "status_for_error",
    # meta
    "ItemMeta",
    "NO_FINGERPRINT",
    "ANY_FINGERPRINT",
    "OtherLayout",
    "check_key",
    "check_item",
    "encode_keys",
    "decode_keys",
    "encode_flags",
    "decode_flags",
    "encode_json",
    "decode_json",
    # puts
    "PUT_STORED",
    "PUT_INTEGRITY",
    "PUT_NO_ROOM",
    "PUT_BUSY",
    "put_outcome",
    "encode_items",
    "decode_items",
    "MAX_PUT_WAIT_MS",
    "DEFAULT_PUT_WAIT_MS",
    "PutOptions",
    "encode_put_batch",
    "decode_put_batch",
    "MAX_STAGE_NAME_BYTES",
    "STAGE_TOKEN_BYTES",
    "encode_put_staged",
    "decode_put_staged",
    # reads
    "encode_get_request",
    "decode_get_request",
    "encode_get_response",
    "decode_get_response",
    "LEASE_MAP",
    "NO_OFFSET",
    "encode_lease_request",
    "decode_lease_request",
    "encode_lease_response",
    "decode_lease_response",
    "encode_release",
    "decode_release",
    "encode_touch",
    "decode_touch",
    # channel
    "MAX_PAIR_ID_BYTES",
    "MAX_OFFER_DIGEST_CHARS",
    "ChannelRequest",
    "encode_channel_request",
    "decode_channel_request",
    "encode_channel_response",
    "decode_channel_response",
    # inventory
    "MAX_INVENTORY_PAGE",
    "Verified",
    "InventoryRow",
    "InventoryPage",
    "encode_inventory_request",
    "decode_inventory_request",
    "encode_inventory_response",
    "decode_inventory_response",
    # reports
    "TierReport",
    "tiers_from_json",
    "ArenaReport",
    "RecoveryReport",
    "RepublishReport",
    "RecentReport",
    "NodeReport",
    "encode_node_report",
    "decode_node_report",
]

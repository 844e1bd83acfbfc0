"""The protocol's surface held as tests: one codec for the JSON reports, and (below) the package's public names."""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass

import pytest

from backend.errors import ProtocolError
from backend.protocol import CODECS, Op, OpCodec
from backend.protocol.json_codec import JsonReport
from backend.protocol.meta import encode_json
from backend.protocol.pins import PinRow
from backend.protocol.reads import Release
from backend.protocol.reports import NodeReport, Ping, RecentReport, Stat, TenantReport, TierReport, tiers_from_json
from tests.test_class_sizes import REPO

PROTOCOL = REPO / "backend" / "protocol"


def _stat() -> dict[str, object]:
    return {
        "node_id": "n1",
        "epoch": 3,
        "uptime_s": 1,
        "counters": {"gets": 4},
        "objects": 2,
        "tiers": {"dram": {"capacity_bytes": 64, "used_bytes": 16, "objects": 2}},
        "recent": {"window_s": 300, "requests_per_s": 0.5, "gets": 4, "hits": 3},
    }


def test_no_report_of_the_protocol_writes_its_own_json_codec() -> None:
    own = []
    for path in sorted(PROTOCOL.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name != "JsonReport":
                own += [
                    f"{path.name}:{node.name}.{item.name}"
                    for item in node.body
                    if isinstance(item, ast.FunctionDef) and item.name in ("to_json", "from_json")
                ]
    assert own == [], "subclass backend.protocol.json_codec.JsonReport instead"


@pytest.mark.parametrize(
    "change, named",
    [
        ({"node_id": 7}, "'node_id' is 7, not str"),
        ({"uptime_s": True}, "'uptime_s' is True, not float"),
        ({"counters": {"gets": True}}, r"'counters'\['gets'\] is True, not int"),
        ({"recent": {"window_s": 1, "requests_per_s": 1, "gets": 1}}, "recent figures: field 'hits' is missing"),
        ({"tenants": {"a": []}}, "STAT tenant is \\[\\], not an object"),
    ],
)
def test_a_report_field_that_is_wrong_or_missing_is_refused_by_name(change: dict[str, object], named: str) -> None:
    with pytest.raises(ProtocolError, match=named):
        NodeReport.from_json(_stat() | change)


def test_a_field_of_a_newer_node_is_left_out_not_refused() -> None:
    newer = _stat() | {"colour": "blue"}
    newer["tiers"] = {"dram": {"capacity_bytes": 1, "used_bytes": 0, "objects": 0, "shelves": 2}}
    report = NodeReport.from_json(newer)
    assert report.tiers["dram"].capacity_bytes == 1
    assert "colour" not in report.to_json() and "shelves" not in report.to_json()["tiers"]["dram"]


def test_a_report_keeps_the_numbers_as_sent_and_leaves_out_what_a_node_omits() -> None:
    report = NodeReport.from_json(_stat())
    assert report.recent == RecentReport(300, 0.5, 4, 3) and report.leases == 0 and report.tenants == {}
    assert report.to_json()["recent"] == {"gets": 4, "hits": 3, "requests_per_s": 0.5, "window_s": 300}
    assert "disk_full" not in TierReport(1, 0, 0).to_json()
    assert set(TenantReport(1, 2, 3, 4, 5).to_json()) == {
        "held_bytes",
        "quota_bytes",
        "puts",
        "hits",
        "misses",
        "quota_evictions",
    }
    assert TenantReport.from_json(TenantReport(1, 2, 3, 4, 5, 6, 7, 8).to_json()) == TenantReport(
        1, 2, 3, 4, 5, 6, 7, 8
    )


def test_a_pin_row_is_its_fields_as_json_and_back() -> None:
    row = PinRow("k@1", "me", 2, None, 16, "dram")
    assert row.to_json() == {"key": "k@1", "owner": "me", "refs": 2, "expires_in_s": None, "nbytes": 16, "tier": "dram"}
    assert PinRow.from_json(row.to_json()) == row


def test_a_report_field_of_a_type_the_codec_cannot_read_is_a_programming_error() -> None:
    @dataclass(frozen=True)
    class Odd(JsonReport):
        values: list[int]

    with pytest.raises(TypeError, match="reads no field of type"):
        Odd.from_json({"values": [1]})


# -- the package's public surface --------------------------------------------------------------
OP_FAMILIES = ("puts", "reads", "channel", "inventory", "pins", "events", "reports")
HANDSHAKE_OPS = {Op.HELLO, Op.AUTH}  # their codec is backend.handshake's


def test_the_package_exports_only_the_names_nearly_every_caller_needs() -> None:
    import backend.protocol

    assert sorted(backend.protocol.__all__) == sorted(
        ["CODECS", "DEFAULT_LIMITS", "VERSION", "ItemMeta", "Limits", "Op", "OpCodec", "Status", "checksum"]
    )
    assert [name for name in backend.protocol.__all__ if not hasattr(backend.protocol, name)] == []
    assert len((PROTOCOL / "__init__.py").read_text().splitlines()) <= 60


def test_every_op_but_the_handshake_has_one_codec_with_both_directions() -> None:
    assert set(CODECS) == set(Op) - HANDSHAKE_OPS
    for op, codec in CODECS.items():
        assert codec.op is op and issubclass(codec, OpCodec)
        missing = [
            m for m in ("encode_request", "decode_request", "encode_answer", "decode_answer") if not hasattr(codec, m)
        ]
        assert missing == [], f"{codec.__name__} lacks {missing}"


def test_a_second_codec_for_an_op_is_refused() -> None:
    with pytest.raises(TypeError, match="STAT already has its codec, Stat"):

        class Again(OpCodec):
            op = Op.STAT

    assert CODECS[Op.STAT] is Stat


def test_no_op_family_exports_a_loose_encode_or_decode_function() -> None:
    loose = {
        f"{family}.{name}"
        for family in OP_FAMILIES
        for name in importlib.import_module(f"backend.protocol.{family}").__all__
        if name.startswith(("encode_", "decode_"))
    }
    assert loose == set(), "give the op's codec class the method instead"


def test_the_answers_of_release_and_ping_go_through_their_codecs() -> None:
    assert Release.decode_answer(Release.encode_answer(3)) == 3
    assert Release.encode_answer(3) == encode_json({"released": 3})  # as the node always answered
    assert Ping.decode_answer(Ping.encode_answer("n1", 7)) == ("n1", 7)
    assert Stat.encode_request() == Ping.encode_request() == b""
    with pytest.raises(ProtocolError, match="released"):
        Release.decode_answer(encode_json({"released": True}))
    with pytest.raises(ProtocolError, match="PING answer"):
        Ping.decode_answer(encode_json({"node_id": 1, "epoch": 2}))


def test_a_nodes_tiers_are_read_by_the_same_codec() -> None:
    assert tiers_from_json({"nvme": {"capacity_bytes": 8, "used_bytes": 0, "objects": 0, "disk_full": True}}) == {
        "nvme": TierReport(8, 0, 0, disk_full=True)
    }
    with pytest.raises(ProtocolError, match="a node's tiers is \\[\\], not an object"):
        tiers_from_json([])
    with pytest.raises(ProtocolError, match="a node's tier: 'objects' is x, not int"):
        tiers_from_json({"dram": {"capacity_bytes": 8, "used_bytes": 0, "objects": "x"}})

"""The protocol's surface held as tests: one codec for the JSON reports, and (below) the package's public names."""

from __future__ import annotations

import ast
from dataclasses import dataclass

import pytest

from backend.errors import ProtocolError
from backend.protocol.json_codec import JsonReport
from backend.protocol.pins import PinRow
from backend.protocol.reports import NodeReport, RecentReport, TenantReport, TierReport
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
        (
            {"tiers": {"dram": {"capacity_bytes": 1, "used_bytes": 0, "objects": 0, "shelves": 2}}},
            "unknown field 'shelves'",
        ),
        ({"colour": "blue"}, "STAT answer: unknown field 'colour'"),
        ({"tenants": {"a": []}}, "STAT tenant is \\[\\], not an object"),
    ],
)
def test_a_report_field_that_is_wrong_missing_or_unknown_is_refused_by_name(
    change: dict[str, object], named: str
) -> None:
    with pytest.raises(ProtocolError, match=named):
        NodeReport.from_json(_stat() | change)


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

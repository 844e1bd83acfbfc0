"""``bench.scale.nvme``'s disk measurement: its segment prototype finds every chunk, the newest record of a
key winning, and both layouts are measured over the same chunks."""

from __future__ import annotations

from backend.protocol import ItemMeta
from bench.scale.nvme import SegmentLog, files_vs_segments, scan_segments


def test_the_segment_prototype_finds_every_chunk_and_a_later_record_of_a_key_wins(tmp_path):
    log = SegmentLog(tmp_path, durable=False, segment_bytes=4096)  # a few records per segment
    written = {}
    for i in range(40):
        key = f"k{i % 30}"  # the last 10 write keys 0..9 again, into later segments
        payload = bytes([i]) * 100
        written[key] = log.append(ItemMeta(key, len(payload), 0, "uint8", (len(payload),), 0), payload)
    log.close()
    found = scan_segments(tmp_path)
    assert len(list(tmp_path.glob("*.seg"))) > 2
    assert {key: where[:2] for key, where in found.items()} == written


def test_files_and_segments_are_measured_over_the_same_chunks(tmp_path):
    result = files_vs_segments(300, tmp_path, payload_bytes=64, fsync_chunks=10)
    for kind in ("files", "segments"):
        figures = result[kind]
        assert figures["put_per_s"] > 0 and figures["scan_s"] > 0 and figures["put_fsync_per_s"] > 0
    assert result["files"]["files_made"] >= 300 > result["segments"]["files_made"]
    assert not list(tmp_path.iterdir())  # it cleans up after itself

"""The NCCL channel's whole path on one GPU, with the channel's own code, against ceilings of the same run.

    python -m bench.nccl.bandwidth --path --json out.json      (needs a CUDA GPU and libnccl)

A node's chunks live in its DRAM arena, an mmap'd /dev/shm file: here a batch of 8
chunks (4 MiB, then 32 MiB) sits in such a file. One 1-rank communicator moves them
with ``nccl_channel.transport_nccl.exchange_self``: the node link's copy out
(``copy_out``, into its slot) and the client link's landing (``recv_pointer``/``copy_in``/``land``)
are the channel's, as is the pipeline that verifies each chunk's checksum as it lands
(``nccl_channel.pipeline.receive_batch``); only the group pairs each send with its
receive, as NCCL needs for a rank sending to itself. Sinks are pinned host buffers
(and, to compare, pageable ones). The path is measured with the arena registered
(``cudaHostRegister``) and not (pinned bounce slots).

Ceilings measured in the same run: a device-to-device copy, pinned host to device,
device to pinned host, host to device from the registered arena, device to the pinned
sink. Also the fixed cost of one 4 KiB exchange (median of warm calls) and the 32 MiB
and 256 MiB exchange rates. Each target is printed with PASS or MISS.
"""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

MIB = 1024 * 1024
BATCH = 8
CHUNK_MIB = (4, 32)
TIMEOUT_S = 60.0
# figure -> (comparison, bound): the targets for an H200
TARGETS: dict[str, tuple[str, float]] = {
    "exchange_4kib_us": ("<=", 150.0),
    "exchange_32mib_gbps": (">=", 300.0),
    "exchange_256mib_gbps": (">=", 800.0),
    "h2d_from_arena_gbps": (">=", 45.0),
    "d2h_into_sink_gbps": (">=", 45.0),
    "path_8x32mib_gbps": (">=", 20.0),
    "path_8x4mib_gbps": (">=", 12.0),
}


def _median_s(fn: Callable[[], Any], runs: int) -> float:
    fn()  # warm
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Arena:
    """A node-like arena: one mmap'd /dev/shm file holding the batch's chunks back to back."""

    def __init__(self, nbytes: int) -> None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, self.path = tempfile.mkstemp(prefix="kvpool-bench-arena-", dir=directory)
        try:
            os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        view = torch.frombuffer(self.map, dtype=torch.uint8)
        view.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        self.view = memoryview(self.map)

    def chunk(self, index: int, size: int) -> memoryview:
        return self.view[index * size : (index + 1) * size]

    def close(self) -> None:
        os.unlink(self.path)
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # a tensor made from it is still alive: the mapping goes with the process
            pass


def _sinks(count: int, size: int, pinned: bool) -> list[torch.Tensor]:
    return [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(count)]


def _ceilings(arena: Arena, size: int, sink: torch.Tensor, registered: bool, device: str) -> dict[str, float]:
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    chunk = torch.frombuffer(arena.chunk(0, size), dtype=torch.uint8)
    gbps = {
        "d2d_copy_gbps": size / _median_s(lambda: dst.copy_(src), 10) / 1e9,
        "h2d_pinned_gbps": size / _median_s(lambda: dst.copy_(pinned, non_blocking=True), 10) / 1e9,
        "d2h_pinned_gbps": size / _median_s(lambda: pinned.copy_(src, non_blocking=True), 10) / 1e9,
        "d2h_into_sink_gbps": size / _median_s(lambda: sink.copy_(src, non_blocking=True), 10) / 1e9,
    }
    key = "h2d_from_arena_gbps" if registered else "h2d_from_pageable_arena_gbps"
    gbps[key] = size / _median_s(lambda: dst.copy_(chunk, non_blocking=True), 10) / 1e9
    return gbps


def _exchanges(comm: Any, device: str) -> dict[str, float]:
    small = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=device)
    small_out = torch.empty_like(small)
    out: dict[str, float] = {}
    out["exchange_4kib_us"] = _median_s(lambda: comm.exchange([small], [small_out], TIMEOUT_S, peer=0), 50) * 1e6
    for mib in (32, 256):
        big = torch.randint(0, 256, (mib * MIB,), dtype=torch.uint8, device=device)
        big_out = torch.empty_like(big)
        seconds = _median_s(lambda: comm.exchange([big], [big_out], TIMEOUT_S, peer=0), 20)  # noqa: B023
        if not torch.equal(big, big_out):
            raise SystemExit(f"nccl_path: a {mib} MiB exchange came back different")
        out[f"exchange_{mib}mib_gbps"] = mib * MIB / seconds / 1e9
    return out


class _SelfLink:
    """``recv_into`` of a 1-rank pair: the node link stages, the client link lands (``exchange_self``)."""

    def __init__(self, node: Any, client: Any, sources: list[memoryview]) -> None:
        self.node, self.client, self.sources = node, client, sources

    def recv_into(self, sizes: Any, targets: Any, timeout_s: float, landed: Callable[[int], None]) -> None:
        from nccl_channel.transport_nccl import exchange_self

        exchange_self(self.node, self.client, self.sources, targets, timeout_s, landed)


def _one_path(comm: Any, arena: Arena, registry: Any, size: int, pinned_sink: bool, iters: int) -> dict[str, Any]:
    from backend.protocol import checksum
    from nccl_channel.pipeline import Verifier, receive_batch
    from nccl_channel.transport_nccl import NcclLink

    sources = [arena.chunk(i, size) for i in range(BATCH)]
    sums = [checksum(s) for s in sources]
    sinks = _sinks(BATCH, size, pinned_sink)
    targets = [memoryview(s.numpy()).cast("B") for s in sinks]
    node = NcclLink(comm, registry)  # both links on one communicator: never used at once here
    client = NcclLink(comm, registry)
    verifier = Verifier()
    runs: list[float] = []
    report = None
    try:
        for run in range(iters + 1):  # the first run warms the rings and the pinned bounce slots
            for target in targets:
                target[:8] = b"\0" * 8  # the last run's bytes must not pass for this run's
            start = time.monotonic()
            report = receive_batch(_SelfLink(node, client, sources), [size] * BATCH, targets, sums, TIMEOUT_S, verifier)
            verdicts = report.verdicts
            took = time.monotonic() - start
            if not all(verdicts):
                raise SystemExit(f"nccl_path: {size // MIB} MiB: checksums failed: {verdicts}")
            if run:
                runs.append(took)
                last_start = start
    finally:
        verifier.close()
    seconds = statistics.median(runs)
    row: dict[str, Any] = {
        "staging": "pipelined",  # the one path the channel has (rows of older results also name others)
        "chunk_mib": size // MIB,
        "chunks": BATCH,
        "arena_registered": registry.contains(sources[0]),
        "sink_pinned": pinned_sink,
        "median_s": seconds,
        "gbps": BATCH * size / seconds / 1e9,
    }
    if report is not None:  # the last run's
        row["arrived_ms"] = [round((t - last_start) * 1e3, 3) for t in report.arrived_s]
        row["verified_ms"] = [round((t - last_start) * 1e3, 3) for t in report.verified_s]
    return row


def measure_path(device: str = "cuda:0", iters: int = 5) -> dict[str, Any]:
    """Every figure of the path; raises SystemExit when a byte came back wrong."""
    from nccl_channel.communicator import PairCommunicator
    from nccl_channel.library import load_library
    from nccl_channel.staging import HostRegistry

    lib = load_library()
    torch.cuda.set_device(device)
    comm = PairCommunicator.create(lib, lib.unique_id(), 0, 1, device, timeout_s=TIMEOUT_S)
    result: dict[str, Any] = {"batch": BATCH, "iters": iters, "rows": [], "ceilings": {}}
    try:
        result["exchanges"] = _exchanges(comm, device)
        for mib in CHUNK_MIB:
            size = mib * MIB
            arena = Arena(BATCH * size)
            registry = HostRegistry()  # the arena pageable first, then registered
            try:
                sink = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                result["ceilings"][f"{mib}mib"] = _ceilings(arena, size, sink, False, device)
                result["rows"].append(_one_path(comm, arena, registry, size, True, iters))
                registered_at = time.monotonic()
                if not registry.register(arena.view):
                    raise SystemExit("nccl_path: cudaHostRegister of the arena failed")
                result[f"register_{mib}mib_x{BATCH}_ms"] = (time.monotonic() - registered_at) * 1e3
                result["ceilings"][f"{mib}mib"].update(_ceilings(arena, size, sink, True, device))
                for pinned_sink in (True, False):
                    try:
                        result["rows"].append(_one_path(comm, arena, registry, size, pinned_sink, iters))
                    except Exception as exc:
                        if comm.broken:
                            raise
                        result["rows"].append({"staging": "pipelined", "chunk_mib": mib, "error": str(exc)})
            finally:
                registry.close()
                arena.close()
    finally:
        comm.close()
    result["targets"] = _judge(result)
    return result


def _judge(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    figures: dict[str, float] = dict(result["exchanges"])
    ceilings = result["ceilings"].get("32mib", {})
    for key in ("h2d_from_arena_gbps", "d2h_into_sink_gbps"):
        if key in ceilings:
            figures[key] = ceilings[key]
    for mib in CHUNK_MIB:
        best = [r["gbps"] for r in result["rows"] if r.get("chunk_mib") == mib and r.get("sink_pinned") and "gbps" in r]
        if best:
            figures[f"path_8x{mib}mib_gbps"] = max(best)
    judged = {}
    for name, (comparison, bound) in TARGETS.items():
        value = figures.get(name)
        ok = value is not None and (value <= bound if comparison == "<=" else value >= bound)
        judged[name] = {"value": value, "target": f"{comparison} {bound:g}", "pass": ok}
    return judged


def print_path(result: dict[str, Any]) -> None:
    print("\nthe channel's path, one GPU, a batch of", result["batch"], "chunks (median of", result["iters"], "runs)")
    for name, value in result["exchanges"].items():
        print(f"  {name:<28} {value:>10.1f}")
    for size, ceilings in result["ceilings"].items():
        print(f"  ceilings at {size}: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
    for row in result["rows"]:
        if "error" in row:
            print(f"  {row['staging']:<10} {row['chunk_mib']:>3} MiB: NOT MEASURED: {row['error']}")
            continue
        print(
            f"  {row['staging']:<10} {row['chunk_mib']:>3} MiB x {row['chunks']}  arena registered "
            f"{row['arena_registered']!s:<5} sink pinned {row['sink_pinned']!s:<5} {row['gbps']:>7.1f} GB/s"
        )
        if "arrived_ms" in row:
            print(f"      arrived ms  {row['arrived_ms']}\n      verified ms {row['verified_ms']}")
    for name, verdict in result["targets"].items():
        value = "unmeasured" if verdict["value"] is None else f"{verdict['value']:.1f}"
        print(f"  target {name:<24} {verdict['target']:<10} {value:>12}  {'PASS' if verdict['pass'] else 'MISS'}")

"""Bandwidth of the NCCL path against a plain device-to-device copy on one GPU, and of the staging copies.

    python -m bench.nccl.bandwidth [--sizes-mib 2,32,256] [--iters 20] [--path] [--json PATH]

NCCL refuses two ranks on one GPU, so on one device the NCCL path is measured as a
1-rank communicator sending to itself inside one group (what the channel issues,
minus the network). ``torch`` D2D is ``dst.copy_(src)`` on the same device. Staging is
what the channel adds around NCCL: a node copies each chunk from host memory into its
GPU staging buffer (host to GPU), a client copies from its staging buffer into
LMCache's host memory object (GPU to host); both are measured from ordinary (pageable)
host memory, as the channel's buffers are. Prints a table and, with ``--json``, writes
the figures. Needs a CUDA GPU and libnccl.

``--path`` adds the channel's whole path (``bench/nccl/path.py``): a batch of 8 chunks
from a node-side arena (an mmap'd /dev/shm file) through staging, NCCL and into pinned
host buffers, every checksum verified, beside ceilings measured in the same run, the
fixed cost of a 4 KiB exchange and the targets each figure is held to.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

MIB = 1024 * 1024


def _timed(fn: Any, iters: int) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def measure(sizes_mib: list[int], iters: int, device: str = "cuda:0") -> dict[str, Any]:
    from nccl_channel import available
    from nccl_channel.communicator import PairCommunicator
    from nccl_channel.library import load_library, version_string

    status = available()
    if not status:
        raise SystemExit(f"nccl_bandwidth: the NCCL channel cannot run here: {status.reason}")
    lib = load_library()
    comm = PairCommunicator.create(lib, lib.unique_id(), 0, 1, device, timeout_s=60.0)
    rows = []
    try:
        for size in sizes_mib:
            src = torch.randint(0, 256, (size * MIB,), dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            copy_s = _timed(lambda: dst.copy_(src), iters)  # noqa: B023
            nccl_s = _timed(lambda: comm.exchange([src], [dst], timeout_s=60.0, peer=0), iters)  # noqa: B023
            if not torch.equal(src, dst):
                raise SystemExit(f"nccl_bandwidth: {size} MiB came back different")
            host = torch.frombuffer(bytearray(size * MIB), dtype=torch.uint8)  # pageable, like the channel's buffers
            h2d_s = _timed(lambda: dst.copy_(host), iters)  # noqa: B023
            d2h_s = _timed(lambda: host.copy_(src), iters)  # noqa: B023
            if not torch.equal(host, src.cpu()):
                raise SystemExit(f"nccl_bandwidth: {size} MiB staged back to the host came back different")
            rows.append(
                {
                    "size_mib": size,
                    "torch_d2d_gbps": size * MIB / copy_s / 1e9,
                    "nccl_self_gbps": size * MIB / nccl_s / 1e9,
                    "staging_h2d_gbps": size * MIB / h2d_s / 1e9,
                    "staging_d2h_gbps": size * MIB / d2h_s / 1e9,
                    "staging_round_trip_gbps": size * MIB / (h2d_s + d2h_s) / 1e9,
                }
            )
    finally:
        comm.close()
    return {
        "device": torch.cuda.get_device_name(device),
        "nccl_version": version_string(lib.version()),
        "library": lib.path,
        "iters": iters,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="2,32,256", help="transfer sizes in MiB (default 2,32,256)")
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions per size (default 20)")
    parser.add_argument("--path", action="store_true", help="also measure the channel's whole path and its targets")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    result = measure([int(s) for s in args.sizes_mib.split(",")], args.iters)
    print(f"{result['device']}, NCCL {result['nccl_version']} ({result['library']})")
    print(
        f"{'size':>8}  {'torch D2D GB/s':>15}  {'NCCL self GB/s':>15}  {'host->GPU GB/s':>15}  "
        f"{'GPU->host GB/s':>15}  {'round trip GB/s':>16}"
    )
    for row in result["rows"]:
        print(
            f"{row['size_mib']:>5} MiB  {row['torch_d2d_gbps']:>15.1f}  {row['nccl_self_gbps']:>15.1f}  "
            f"{row['staging_h2d_gbps']:>15.1f}  {row['staging_d2h_gbps']:>15.1f}  "
            f"{row['staging_round_trip_gbps']:>16.1f}"
        )
    if args.path:
        from bench.nccl.path import measure_path, print_path

        result["path"] = measure_path()
        print_path(result["path"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

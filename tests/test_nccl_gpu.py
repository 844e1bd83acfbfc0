"""The NCCL channel on a real GPU (marked ``gpu``; skipped cleanly without one).

``bench/device_check.sh`` runs these and the bandwidth measurement. NCCL refuses two
ranks on one GPU: single-GPU tests use a 1-rank communicator sending to itself inside
one group; the two-process test needs two GPUs and is skipped otherwise.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import REPO

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]
TIMEOUT_S = 60.0


def _copy_and_verify(work):
    """Each ``(host view, device tensor, checksum)``: the tensor copied into the view, and whether it checks out."""
    from backend.protocol import checksum

    verdicts = []
    for view, source, expected in work:
        if len(view):
            torch.frombuffer(view, dtype=torch.uint8).copy_(source)
        verdicts.append(checksum(view) == expected)
    return verdicts


@pytest.fixture(scope="module")
def lib():
    import nccl_channel
    from nccl_channel.library import load_library

    status = nccl_channel.available()
    if not status:
        pytest.skip(f"NCCL channel unavailable: {status.reason}")
    return load_library()


def test_the_binding_loads_and_reports_its_version(lib):
    from nccl_channel.library import version_string

    version = lib.version()
    print(f"libnccl {version_string(version)} from {lib.path}")
    assert version >= 21700


def test_self_send_and_recv_inside_one_group_move_the_bytes(lib):
    from nccl_channel.communicator import PairCommunicator

    comm = PairCommunicator.create(lib, lib.unique_id(), 0, 1, "cuda:0", TIMEOUT_S)
    try:
        sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0") for n in (1, 4096, 3 << 20)]
        targets = [torch.zeros_like(s) for s in sources]
        comm.exchange(sources, targets, TIMEOUT_S, peer=0)
        assert all(torch.equal(s, t) for s, t in zip(sources, targets))
    finally:
        comm.close()


def test_staged_bytes_go_host_to_gpu_to_host_and_are_verified(lib):
    """The channel's staging without LMCache (the GPU machine has none): a node's host bytes into GPU
    staging, over NCCL, and out of the client's staging into host memory, checksum verified."""
    import os

    from backend.protocol import checksum
    from nccl_channel.communicator import PairCommunicator

    comm = PairCommunicator.create(lib, lib.unique_id(), 0, 1, "cuda:0", TIMEOUT_S)
    try:
        payload = os.urandom(3 << 20)
        source = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to("cuda:0")  # host -> GPU staging
        staging = torch.empty_like(source)
        comm.exchange([source], [staging], TIMEOUT_S, peer=0)
        target = bytearray(len(payload))
        view = memoryview(target)
        assert _copy_and_verify([(view, staging, checksum(payload))]) == [True]  # GPU -> host, verified
        assert bytes(target) == payload
        staging[12345] = staging[12345] ^ 0xFF  # one byte wrong on the device: never taken as good
        assert _copy_and_verify([(view, staging, checksum(payload))]) == [False]
    finally:
        comm.close()


def test_staging_is_copied_into_an_lmcache_memory_object_and_verified(lib):
    pytest.importorskip("lmcache", reason="LMCache is not installed (the GPU machine has none)")
    from backend.lmcache.stack import LMCacheStack, kvpool_lmcache_config
    from backend.protocol import checksum
    from nccl_channel.communicator import PairCommunicator
    from tests.support.lmcache import same_bytes

    stack = LMCacheStack(kvpool_lmcache_config("kvpool://127.0.0.1:1/none?progress_timeout_s=0.2"))
    comm = PairCommunicator.create(lib, lib.unique_id(), 0, 1, "cuda:0", TIMEOUT_S)
    expected = stack.make_object(7)
    target = stack.make_object(8)
    try:
        source = expected.tensor.view(torch.uint8).reshape(-1).to("cuda:0")
        staging = torch.empty_like(source)
        comm.exchange([source], [staging], TIMEOUT_S, peer=0)
        view = memoryview(target.byte_array).cast("B")
        assert _copy_and_verify([(view, staging, checksum(memoryview(expected.byte_array).cast("B")))]) == [True]
        assert same_bytes(target, expected)
    finally:
        comm.close()
        stack.release([expected, target])
        stack.close()


@pytest.mark.parametrize("pinned_sink", [True, False], ids=["pinned-sink", "pageable-sink"])
def test_the_pipelined_path_lands_every_chunk_verified_from_a_registered_or_pageable_arena(lib, pinned_sink):
    """The channel's own staging and landing (exchange_self on a 1-rank communicator), arena registered for
    half the chunks' run, a flipped byte caught: every byte right."""
    import mmap
    import os

    from backend.protocol import checksum
    from nccl_channel.communicator import PairCommunicator
    from nccl_channel.pipeline import Verifier, receive_batch
    from nccl_channel.staging import HostRegistry
    from nccl_channel.transport_nccl import NcclLink, exchange_self

    sizes = [1, 4096, 3 << 20, 0, 5 << 20, 777]
    arena = mmap.mmap(-1, sum(sizes))
    arena[:] = os.urandom(sum(sizes))
    view = memoryview(arena)
    sources, offset = [], 0
    for size in sizes:
        sources.append(view[offset : offset + size])
        offset += size
    comm = PairCommunicator.create(lib, lib.unique_id(), 0, 1, "cuda:0", TIMEOUT_S)
    registry = HostRegistry()
    verifier = Verifier()

    class SelfLink:
        def recv_into(self, sizes, targets, timeout_s, landed):
            exchange_self(node, client, sources, targets, timeout_s, landed)

    try:
        for register in (False, True):
            if register:
                assert registry.register(view)
            node, client = NcclLink(comm, registry), NcclLink(comm, registry)
            sinks = [torch.zeros(n, dtype=torch.uint8, pin_memory=pinned_sink) for n in sizes]
            targets = [memoryview(s.numpy()).cast("B") for s in sinks]
            sums = [checksum(s) for s in sources]
            report = receive_batch(SelfLink(), sizes, targets, sums, TIMEOUT_S, verifier)
            assert report.verdicts == [True] * len(sizes)
            assert [bytes(t) for t in targets] == [bytes(s) for s in sources]
            sums[2] ^= 1  # a checksum that does not match what landed: that chunk alone is refused
            assert receive_batch(SelfLink(), sizes, targets, sums, TIMEOUT_S, verifier).verdicts[2] is False
    finally:
        verifier.close()
        comm.close()
        registry.close()


def test_the_path_benchmark_runs_and_judges_every_target(lib):
    from bench.nccl.path import TARGETS, measure_path

    result = measure_path(iters=1)
    assert set(result["targets"]) == set(TARGETS)
    assert all("error" not in row for row in result["rows"]), result["rows"]


def test_nccl_bandwidth_against_a_device_to_device_copy(lib):
    from bench.nccl.bandwidth import measure

    result = measure([2, 32], iters=5)
    for row in result["rows"]:
        print(
            f"{row['size_mib']} MiB: torch D2D {row['torch_d2d_gbps']:.1f} GB/s, NCCL {row['nccl_self_gbps']:.1f} GB/s, "
            f"staging host->GPU {row['staging_h2d_gbps']:.1f} GB/s, GPU->host {row['staging_d2h_gbps']:.1f} GB/s"
        )
        assert row["torch_d2d_gbps"] > 0 and row["nccl_self_gbps"] > 0
        assert row["staging_h2d_gbps"] > 0 and row["staging_d2h_gbps"] > 0


PAIR_WORKER = textwrap.dedent("""
    import asyncio, sys, torch
    from backend.metadata import MetadataStore
    from nccl_channel.library import load_library
    from nccl_channel.channel import NcclTransport
    from nccl_channel.rendezvous import Offer, Rendezvous

    rank, redis_url, namespace, pair_id = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    transport = NcclTransport(f"cuda:{rank}")

    async def main():
        store = MetadataStore(redis_url, namespace)
        rdv = Rendezvous(store.rendezvous)
        if rank == 0:
            uid, state = transport.prepare()
            await rdv.publish(Offer(pair_id, "nccl", uid, "rank0", "rank1", "c"))
        else:
            for _ in range(600):
                try:
                    uid = (await rdv.take(pair_id, target="rank1", cluster="c", transport="nccl")).unique_id
                    break
                except Exception:
                    await asyncio.sleep(0.05)
        await store.close()
        link = await asyncio.to_thread(transport.join, uid, rank, None, 60.0)
        payload = bytes(range(256)) * 4096
        if rank == 1:
            link.send([payload, payload[:1000]], 60.0)
        else:
            got = [bytearray(len(payload)), bytearray(1000)]
            link.recv_into([len(payload), 1000], [memoryview(g) for g in got], 60.0, lambda index: None)
            assert bytes(got[0]) == payload and bytes(got[1]) == payload[:1000]
        link.close()
        print("ok")

    asyncio.run(main())
""")


@pytest.mark.skipif(GPUS < 2, reason="NCCL refuses two ranks on one GPU: the pair test needs 2 GPUs")
def test_two_processes_pair_through_redis_and_move_a_batch(lib, redis_server, namespace):
    import uuid

    pair_id = uuid.uuid4().hex
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PAIR_WORKER, str(rank), redis_server.url, namespace, pair_id],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        outputs.append((proc.returncode, out, err))
    for code, out, err in outputs:
        assert code == 0 and "ok" in out, err[-3000:]

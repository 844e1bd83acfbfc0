"""The same-host put path: chunks written into this client's stage, copied in by the node.

For a node whose arena this client maps (same host, same user), a put writes each
chunk into the client's stage (``backend.shm.PutStage``, one per arena directory,
made on the first such put, or before it by :meth:`StagedWriter.prepare`, which the
LMCache connector calls for every node on its host when it starts), hashing it as
it copies, and sends PUT_STAGED with the offsets; the node copies the chunks into its DRAM tier and verifies them. Two memory
copies replace two trips through the kernel's TCP stack. A stage that cannot be made
(``/dev/shm`` full, not writable) leaves the puts to TCP, and is tried again after
``STAGE_RETRY_S``. The stage is removed at :meth:`StagedWriter.close`; its file stays
locked while this process lives, so if the process dies first the node removes it
(``backend.node.serve.stages``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence

from backend.client.arena import ArenaReader
from backend.client.connection import MAX_FRAME_ITEMS, Connections, NodeConnectionSet
from backend.client.context import ClientContext, logger
from backend.client.tcp import stripes
from backend.counters import ClientCounter
from backend.errors import AuthError, KVPoolError, PutOutcome, refused_outcome
from backend.metadata import NodeInfo
from backend.protocol import ItemMeta, Op
from backend.protocol.puts import PutOptions, PutStaged, put_outcome
from backend.shm import HEADER_BYTES, PutStage
from backend.transport import BULK_BYTES, Buffer

__all__ = ["StagedWriter", "STAGE_BYTES"]

STAGE_BYTES = 128 * 1024 * 1024  # a put larger than this goes through the stage in parts
STAGE_RETRY_S = 60.0

_Job = tuple[ItemMeta, int]  # (item, its offset in the stage)


class StagedWriter:
    """Puts to nodes on this host through a shared-memory stage; ``put`` answers None to mean "use TCP"."""

    def __init__(self, ctx: ClientContext, connections: Connections, arena: ArenaReader) -> None:
        self.ctx = ctx
        self.connections = connections
        self.arena = arena
        self._stages: dict[str, PutStage] = {}  # by arena directory
        self._failed_at: dict[str, float] = {}
        self._lock = asyncio.Lock()  # one put at a time fills a stage

    def serves(self, node: NodeInfo) -> bool:
        return self.arena.serves(node)

    async def prepare(self, node: NodeInfo) -> bool:
        """Map ``node``'s arena and make the stage for it now, so that the first same-host put does not
        wait for them (a 128 MiB stage takes ~0.1 s); False if ``node`` is not on this host.

        Also opens every connection puts may use, each with the stage already mapped by the
        node (an empty PUT_STAGED): else each of the first ``connections_per_node`` puts would
        pay a connect, a handshake and the node's mapping, 10-20 ms against a 2-3 ms put.
        """
        if not self.serves(node):
            return False
        async with self._lock:
            stage = await self._stage(os.path.dirname(node.shm_path))
            if stage is None:
                return False
            with contextlib.suppress(KVPoolError):  # then the first puts open them, as without this
                empty = PutStaged.encode_request(stage.name, stage.token, [], [])
                conns = self.connections.to(node)
                connections = await conns.open_all()
                if conns.tenant is not None:
                    return False  # a tenant's token puts over TCP: the node refuses stages
                await asyncio.gather(*(conn.request(Op.PUT_STAGED, empty) for conn in connections))
            return True

    async def put(
        self,
        node: NodeInfo,
        group: Sequence[ItemMeta],
        data: dict[str, Buffer],
        sums: dict[str, int],
        options: PutOptions,
    ) -> tuple[list[PutOutcome], KVPoolError | None] | None:
        """Store ``group`` (layouts) on ``node`` through the stage; each chunk's outcome and the node's
        error if a request failed. None when there is no stage: the caller puts over TCP.

        ``sums`` gets each chunk's checksum, computed as it is copied. Every request names
        the put (``options``): its parts and stripes never evict each other's chunks.
        """
        if max(item.nbytes for item in group) > STAGE_BYTES - HEADER_BYTES:
            return None
        conns = self.connections.to(node)
        if conns.tenant is not None:
            return None  # the node refuses stages to a tenant's token
        async with self._lock:
            stage = await self._stage(os.path.dirname(node.shm_path))
            if stage is None:
                return None
            outcomes: list[PutOutcome] = []
            error: KVPoolError | None = None
            for part in _parts(group):
                part_outcomes, part_error = await self._put_part(conns, stage, part, data, sums, options)
                if isinstance(part_error, AuthError) and conns.tenant is not None:
                    return None  # the first put learnt the node bound this client to a tenant: nothing staged
                outcomes += part_outcomes
                error = part_error or error
            self.ctx.counters[ClientCounter.STAGED_PUT_BYTES] += sum(item.nbytes for item in group)
            return outcomes, error

    async def _put_part(
        self,
        conns: NodeConnectionSet,
        stage: PutStage,
        part: Sequence[ItemMeta],
        data: dict[str, Buffer],
        sums: dict[str, int],
        options: PutOptions,
    ) -> tuple[list[PutOutcome], KVPoolError | None]:
        """Chunks that fit in the stage at once: each stripe is copied, then sent while the next is copied."""
        offsets, offset = [], HEADER_BYTES
        for item in part:
            offsets.append(offset)
            offset += item.nbytes
        offset_of = {item.key: off for item, off in zip(part, offsets)}

        def copy(job: _Job) -> int:
            item, off = job
            return stage.write_checked(off, memoryview(data[item.key]).cast("B"))

        requests: list[asyncio.Task[bytes]] = []
        parts = stripes(part, self.ctx.config.connections_per_node)
        try:
            for stripe in parts:
                jobs = [(item, offset_of[item.key]) for item in stripe]
                if sum(item.nbytes for item in stripe) < BULK_BYTES:
                    digests = [copy(job) for job in jobs]
                else:
                    digests = await self.ctx.map_in_threads(copy, jobs)
                items = [dataclasses.replace(item, checksum=d) for item, d in zip(stripe, digests)]
                sums.update({item.key: item.checksum for item in items})
                meta = PutStaged.encode_request(
                    stage.name, stage.token, items, [offset_of[i.key] for i in items], options=options
                )
                requests.append(asyncio.ensure_future(conns.request(Op.PUT_STAGED, meta)))
            await asyncio.wait(requests)
        except BaseException:
            for request in requests:
                request.cancel()
            raise
        outcomes: list[PutOutcome] = []
        error: KVPoolError | None = None
        for stripe, request in zip(parts, requests):
            failure = request.exception()
            if isinstance(failure, KVPoolError):
                error = failure
                outcomes += [refused_outcome(failure)] * len(stripe)
            elif failure is not None:
                raise failure
            else:
                outcomes += [put_outcome(flag) for flag in PutStaged.decode_answer(request.result(), len(stripe))]
        return outcomes, error

    async def _stage(self, directory: str) -> PutStage | None:
        stage = self._stages.get(directory)
        if stage is not None:
            return stage
        if time.monotonic() - self._failed_at.get(directory, -STAGE_RETRY_S) < STAGE_RETRY_S:
            return None
        try:  # allocating the pages takes a while: not on the caller's loop
            stage = await asyncio.to_thread(PutStage, directory, STAGE_BYTES)
        except OSError as exc:
            self._failed_at[directory] = time.monotonic()
            self.ctx.warn_once(
                f"stage:{directory}",
                "kvpool: cannot make a put stage in %s (%s); same-host puts go over TCP",
                directory,
                exc,
            )
            return None
        if self.ctx.closed:
            stage.close()
            return None
        logger.info("kvpool: same-host puts go through %s", stage.path)
        self._stages[directory] = stage
        return stage

    def forget(self) -> None:
        """After a fork: the stage belongs to the parent (it removes it, and holds its lock)."""
        for stage in self._stages.values():
            stage.forget()
        self._stages = {}

    def close(self) -> None:
        for stage in self._stages.values():
            stage.close()
        self._stages = {}


def _parts(group: Sequence[ItemMeta]) -> list[Sequence[ItemMeta]]:
    """Consecutive runs of ``group`` that fit in the stage (and in one frame's item count)."""
    out: list[Sequence[ItemMeta]] = []
    start, size = 0, 0
    for index, item in enumerate(group):
        if index > start and (size + item.nbytes > STAGE_BYTES - HEADER_BYTES or index - start >= MAX_FRAME_ITEMS):
            out.append(group[start:index])
            start, size = index, 0
        size += item.nbytes
    out.append(group[start:])
    return out

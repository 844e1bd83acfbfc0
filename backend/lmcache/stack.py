"""Build LMCache's storage exactly as LMCache does, for the demo, the bench and the tests.

``LMCacheStack`` = ``load_engine_config_with_overrides`` + ``CreateStorageBackends``
on a private event loop thread: a ``LocalCPUBackend`` and a ``RemoteBackend`` for
whatever remote the config names (the kvpool plugin, or one of LMCache's own).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch
import yaml

from backend.lmcache.config import PLUGIN_FORM, lmcache_config
from backend.threads import LoopThread

MODEL = "kvpool-demo/tiny-model"
NUM_LAYERS = 4
NUM_HEADS = 8
HEAD_SIZE = 64
CHUNK_TOKENS = 256


def kvpool_lmcache_config(
    url: str, *, form: str = PLUGIN_FORM, chunk_size: int = CHUNK_TOKENS, local_cpu_gib: float = 1.0
) -> dict[str, Any]:
    """The LMCache config that enables kvpool in ``form`` (what ``kvpool lmcache-config --form`` prints)."""
    return lmcache_config(url, form=form, chunk_size=chunk_size, local_cpu_gib=local_cpu_gib)


def vllm_loader(path: str) -> Any:
    """LMCache's config from a file as its vLLM integration reads it (``LMCACHE_CONFIG_FILE``, then ``LMCACHE_*``)."""
    from lmcache.v1.config import load_engine_config_with_overrides

    return load_engine_config_with_overrides(config_file_path=path)


class LMCacheStack:
    """LMCache's LocalCPUBackend + RemoteBackend built from a config dict, on its own loop.

    ``loader`` reads the config from the file it is written to, as an engine's LMCache
    integration does (default: vLLM's, :func:`vllm_loader`).
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        model: str = MODEL,
        num_layers: int = NUM_LAYERS,
        hidden: tuple[int, int] = (NUM_HEADS, HEAD_SIZE),
        dtype: torch.dtype = torch.bfloat16,
        loader: Callable[[str], Any] = vllm_loader,
    ) -> None:
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend import CreateStorageBackends

        self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-lmcache-")
        path = Path(self._tmp.name) / "lmcache.yaml"
        path.write_text(yaml.safe_dump(config))
        self.config = loader(str(path))
        chunk = int(config.get("chunk_size", CHUNK_TOKENS))
        self.model = model
        self.dtype = dtype
        self.shape = torch.Size([2, num_layers, chunk, hidden[0] * hidden[1]])
        self.metadata = LMCacheMetadata(
            model_name=model,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=dtype,
            kv_shape=(num_layers, 2, chunk, hidden[0], hidden[1]),
        )
        self._loop_thread = LoopThread("lmcache-loop")
        self.loop = self._loop_thread.loop
        self.backends = CreateStorageBackends(self.config, self.metadata, self.loop)
        self.local = self.backends["LocalCPUBackend"]
        remotes = [name for name in self.backends if name.startswith("RemoteBackend")]
        if len(remotes) != 1:
            raise RuntimeError(f"expected one remote backend, LMCache built {remotes or 'none'}")
        self.remote = self.backends[remotes[0]]

    @property
    def chunk_bytes(self) -> int:
        return int(self.shape.numel()) * int(self.dtype.itemsize)

    def key(self, chunk_hash: int) -> Any:
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(self.model, 1, 0, chunk_hash, self.dtype)

    def make_object(self, seed: int) -> Any:
        """A KV-shaped bf16 memory object from LMCache's allocator, filled from ``seed``."""
        from lmcache.v1.memory_management import MemoryFormat

        obj = self.local.allocate(self.shape, self.dtype, MemoryFormat.KV_2LTD)
        if obj is None:
            raise RuntimeError("LMCache's local buffer is full")
        obj.tensor.copy_(self.expected_tensor(seed))
        return obj

    def warm_local_buffer(self) -> int:
        """Touch every page of LMCache's local CPU buffer once; returns the bytes touched.

        On a GPU machine that buffer is pinned, so resident from the start. On a CPU-only
        machine its pages fault in as they are first used (about 0.4 GB/s here), and a
        benchmark of the pool would time the engine's page faults in its first round.
        """
        from lmcache.v1.memory_management import MemoryFormat

        objs = []
        while (obj := self.local.allocate(self.shape, self.dtype, MemoryFormat.KV_2LTD, eviction=False)) is not None:
            obj.tensor.view(torch.uint8).fill_(0)
            objs.append(obj)
        self.release(objs)
        return len(objs) * self.chunk_bytes

    def expected_tensor(self, seed: int) -> torch.Tensor:
        """The tensor ``make_object(seed)`` holds: any process can recompute it to verify."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.shape, generator=gen).to(self.dtype)

    @staticmethod
    def release(objs: Sequence[Any]) -> None:
        for obj in objs:
            if obj is not None:
                obj.ref_count_down()

    def put(self, keys: Sequence[Any], objs: Sequence[Any], timeout_s: float = 60.0) -> None:
        """Store through RemoteBackend and wait until every key's write completed."""
        done = threading.Event()
        remaining = [len(keys)]
        lock = threading.Lock()

        def on_complete(_key: Any) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

        self.remote.batched_submit_put_task(list(keys), list(objs), on_complete_callback=on_complete)
        if not done.wait(timeout_s):
            raise TimeoutError(f"{remaining[0]} of {len(keys)} puts still pending after {timeout_s} s")

    def contains_prefix(self, keys: Sequence[Any]) -> int:
        future = asyncio.run_coroutine_threadsafe(self.remote.batched_async_contains("lookup", list(keys)), self.loop)
        return int(future.result(30))

    def get(self, keys: Sequence[Any]) -> list[Any]:
        return list(self.remote.batched_get_blocking(list(keys)))

    def connector(self) -> Any:
        """The kvpool connector inside LMCache's instrumented wrapper."""
        conn = self.remote.connection
        return conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn

    def close(self, timeout_s: float = 5.0) -> None:
        closer = threading.Thread(target=self._close_backends, daemon=True)
        closer.start()
        closer.join(timeout_s)  # LMCache's redis:// connector deadlocks in close(): bound it
        self._loop_thread.stop(timeout_s, close=False)  # LMCache's threads may still hold the loop
        self._tmp.cleanup()

    def _close_backends(self) -> None:
        for backend in self.backends.values():
            try:
                backend.close()
            except Exception:
                pass

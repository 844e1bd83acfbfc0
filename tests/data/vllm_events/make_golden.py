"""Write the golden KV event batches with a released vLLM's own event classes (README.md says how it is run).

Usage: python make_golden.py KV_EVENTS_PY OUT_DIR

KV_EVENTS_PY is ``vllm/distributed/kv_events.py`` extracted from a vLLM wheel (``pip download
vllm==X --no-deps``, then unzip that one file). It is loaded on its own: the vLLM modules it
imports are stubbed here (it uses only ``ExternalBlockHash`` from them for its event classes), so
neither vLLM, torch nor CUDA is needed. Each batch below is built with that file's classes and
encoded as ``ZmqEventPublisher._publisher_thread`` encodes one: ``msgspec.msgpack.Encoder().encode``.
Fields a release does not have are left out of its batches.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import msgspec


def _stub(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__getattr__ = lambda attr: object  # type: ignore[method-assign]  # names the classes never use
    sys.modules[name] = module


def load(path: Path) -> types.ModuleType:
    for name in ("vllm", "vllm.config", "vllm.logger", "vllm.utils", "vllm.utils.network_utils", "vllm.v1"):
        _stub(name)
    _stub("vllm.config.kv_events")
    _stub("vllm.logger", init_logger=lambda name: None)
    _stub("vllm.v1.core")
    _stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)  # as every checked release defines it
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batches(kv: types.ModuleType) -> dict[str, Any]:
    fields = set(kv.BlockStored.__struct_fields__)
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"} if "kv_cache_spec_kind" in fields else {}
    common = {"token_ids": [], "block_size": 256, "lora_id": None, "medium": "CPU", "lora_name": None}
    return {
        "stored_removed_cleared": kv.KVEventBatch(
            ts=1767225600.25,
            events=[
                kv.AllBlocksCleared(),
                kv.BlockStored(
                    block_hashes=[0x1111222233334444, 0xFEDCBA9876543210], parent_block_hash=None, **common, **full
                ),
                kv.BlockStored(
                    block_hashes=[0x0123456789ABCDEF],
                    parent_block_hash=0xFEDCBA9876543210,
                    extra_keys=[("salt-a",)],
                    **common,
                    **full,
                ),
                kv.BlockRemoved(block_hashes=[0x1111222233334444], medium="CPU", **({"group_idx": 0} if full else {})),
            ],
            data_parallel_rank=0,
        ),
        "stored_with_tokens": kv.KVEventBatch(
            ts=1767225601.5,
            events=[
                kv.BlockStored(
                    block_hashes=[42, 43],
                    parent_block_hash=41,
                    token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                    block_size=4,
                    lora_id=7,
                    medium="GPU",
                    lora_name="adapter-a",
                )
            ],
        ),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    kv = load(Path(argv[1]))
    out = Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.msgpack.Encoder()
    for name, batch in batches(kv).items():
        (out / f"{name}.msgpack").write_bytes(encoder.encode(batch))
        print(out / f"{name}.msgpack")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

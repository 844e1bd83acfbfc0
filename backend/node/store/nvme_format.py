"""NVMe tier: one safetensors file per chunk, in sharded directories.

File layout (the safetensors format: https://github.com/huggingface/safetensors)::

    u64 little-endian N | N bytes of JSON header (space padded to 8) | payload

The header holds one tensor, ``kv``, with the chunk's dtype and shape, and a
``__metadata__`` map (all strings): the LMCache key, memory format, payload
checksum (xxh3-64), byte length, the original dtype and shape, the format
version and, for a chunk stored with one, its layout fingerprint (``layout``:
16 lowercase hex digits; absent: none, as in files of earlier versions). Any safetensors reader loads these files (``safetensors.torch.load_file``).

kvpool writes and parses the format itself instead of going through the
safetensors library: the library needs a torch tensor (so torch in every node) and
copies each payload into a serialised buffer, and restart recovery needs to read
headers only. The tests check every file against the library.

Crash ordering of a write: payload to ``<name>.tmp`` -> fsync -> rename to
``<name>.safetensors`` -> fsync the directory. A file with the final name is
complete; a ``.tmp`` file is debris from a crash and is never served.
All methods here block (disk I/O): the tier manager calls them from worker threads.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import struct
from pathlib import Path
from typing import Any

import xxhash

from backend.errors import IntegrityError
from backend.iov import IOV_MAX, Buffer, advance, to_write
from backend.protocol import ItemMeta, checksum

__all__ = [
    "NvmeFile",
    "FileCodecError",
    "chunk_path",
    "header_bytes",
    "write_chunk",
    "read_header",
    "read_payload",
    "FORMAT_VERSION",
    "CHUNKS_DIR",
    "SUFFIX",
    "TMP_SUFFIX",
]

FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
TENSOR_NAME = "kv"
MAX_HEADER_BYTES = 64 * 1024  # a kvpool header is a few hundred bytes
_U64 = struct.Struct("<Q")

# torch dtype name -> safetensors dtype code. Anything else is stored as raw bytes
# (U8, shape [nbytes]); the original dtype and shape stay in __metadata__.
SAFETENSORS_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "I32": 4,
    "U32": 4,
    "I64": 8,
    "U64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


class FileCodecError(ValueError):
    """A file is not a complete kvpool safetensors chunk (quarantine it)."""


@dataclasses.dataclass(frozen=True)
class NvmeFile:
    """A chunk on disk: where it is, what it holds, where its payload starts.

    ``path`` is a plain string: recovery makes one per file and pathlib would cost
    more than reading the header.
    """

    path: str
    meta: ItemMeta
    data_offset: int

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.meta.nbytes


CHUNKS_DIR = "chunks"


def chunk_name(key: str) -> tuple[str, str]:
    """(shard directory, file name) of a key's chunk file."""
    digest = xxhash.xxh3_128_hexdigest(key.encode("utf-8"))
    return digest[:2], digest + SUFFIX


def chunk_path(root: Path, key: str) -> Path:
    """``root/chunks/ab/<xxh3-128 of key>.safetensors`` (256 shards; keys hold '/', names are hashes)."""
    shard, name = chunk_name(key)
    return root / CHUNKS_DIR / shard / name


def header_bytes(meta: ItemMeta) -> bytes:
    """A chunk file's header: the u64 length and the JSON (space padded to 8 bytes) before the payload."""
    st_dtype = SAFETENSORS_DTYPES.get(meta.dtype)
    shape = list(meta.shape)
    numel = 1
    for dim in shape:
        numel *= dim
    if st_dtype is None or numel * _ITEMSIZE[st_dtype] != meta.nbytes:
        st_dtype, shape = "U8", [meta.nbytes]
    header: dict[str, Any] = {
        TENSOR_NAME: {"dtype": st_dtype, "shape": shape, "data_offsets": [0, meta.nbytes]},
        "__metadata__": {
            "kvpool_format": FORMAT_VERSION,
            "key": meta.key,
            "fmt": str(meta.fmt),
            "checksum": str(meta.checksum),
            "nbytes": str(meta.nbytes),
            "dtype": meta.dtype,
            "shape": json.dumps(list(meta.shape)),
        },
    }
    if meta.fingerprint:
        header["__metadata__"]["layout"] = f"{meta.fingerprint:016x}"
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the payload starts 8-byte aligned
    return _U64.pack(len(raw)) + raw


def write_chunk(
    root: Path, meta: ItemMeta, payload: memoryview | bytes | bytearray, *, durable: bool = True
) -> NvmeFile:
    """Write one chunk durably (tmp, fsync, rename, fsync dir); returns its file record.

    ``durable=False`` skips both fsyncs: only for generating test and bench fixtures.
    """
    path = chunk_path(root, meta.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(TMP_SUFFIX)
    head = header_bytes(meta)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, [head, payload])
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return NvmeFile(str(path), meta, len(head))


def write_all(fd: int, buffers: list[Buffer]) -> None:
    """Write every buffer to ``fd`` in order, with as few ``writev`` calls as the kernel allows."""
    views = to_write(buffers)
    while views:
        written = os.writev(fd, views[:IOV_MAX])
        if not written:
            raise OSError(errno.EIO, "writev wrote nothing")  # no progress: never spin
        advance(views, written)


HEADER_READ_BYTES = 4096  # one read covers a kvpool header (a few hundred bytes)


def read_header(path: Path | str) -> NvmeFile:
    """Parse a chunk file's header only (no payload read); FileCodecError if it is not whole."""
    record, _ = read_header_and_mtime(path)
    return record


def read_header_and_mtime(path: Path | str) -> tuple[NvmeFile, float]:
    """``read_header`` plus the file's mtime, in one open, one read and one fstat (recovery's hot loop)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            head = os.read(fd, HEADER_READ_BYTES)
            st = os.fstat(fd)
            if len(head) >= 8 and 8 + _U64.unpack_from(head)[0] > len(head):
                n = _U64.unpack_from(head)[0]
                if n <= MAX_HEADER_BYTES:
                    head += os.pread(fd, 8 + n - len(head), len(head))
        finally:
            os.close(fd)
    except OSError as exc:
        raise FileCodecError(f"unreadable: {exc.strerror}") from None
    if len(head) < 8:
        raise FileCodecError("shorter than a safetensors header")
    (n,) = _U64.unpack_from(head)
    if n > MAX_HEADER_BYTES:
        raise FileCodecError(f"header of {n} bytes is not a kvpool header")
    raw = head[8 : 8 + n]
    if len(raw) != n:
        raise FileCodecError("header truncated")
    try:
        header = json.loads(raw)
        info = header["__metadata__"]
        if info.get("kvpool_format") != FORMAT_VERSION:
            raise FileCodecError(f"format version {info.get('kvpool_format')!r} is not {FORMAT_VERSION}")
        tensor = header[TENSOR_NAME]
        nbytes = int(info["nbytes"])
        meta = ItemMeta(
            key=str(info["key"]),
            nbytes=nbytes,
            checksum=int(info["checksum"]),
            dtype=str(info["dtype"]),
            shape=tuple(int(d) for d in json.loads(info["shape"])),
            fmt=int(info["fmt"]),
            fingerprint=_fingerprint(info.get("layout")),
        )
        offsets = tensor["data_offsets"]
    except FileCodecError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise FileCodecError(f"header is not a kvpool chunk header: {exc}") from None
    if offsets != [0, nbytes]:
        raise FileCodecError(f"data offsets {offsets} do not match {nbytes} bytes")
    data_offset = 8 + n
    if st.st_size != data_offset + nbytes:
        raise FileCodecError(f"file is {st.st_size} bytes, header promises {data_offset + nbytes}")
    return NvmeFile(str(path), meta, data_offset), st.st_mtime


def _fingerprint(text: Any) -> int:
    """A header's ``layout`` (16 hex digits) as its fingerprint; absent: none (0)."""
    if text is None:
        return 0
    if not isinstance(text, str) or len(text) != 16:
        raise FileCodecError(f"layout fingerprint {text!r} is not 16 hex digits")
    return int(text, 16)  # ValueError for a non-hex one: the caller's FileCodecError


def read_payload(record: NvmeFile, into: Any) -> None:
    """Read a chunk's payload into ``into`` and verify its checksum (IntegrityError if wrong)."""
    view = memoryview(into).cast("B")
    if len(view) != record.meta.nbytes:
        raise ValueError(f"buffer of {len(view)} bytes for a {record.meta.nbytes}-byte chunk")
    with open(record.path, "rb", buffering=0) as f:
        f.seek(record.data_offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise IntegrityError(f"{record.path} ends {len(view) - done} bytes early")
            done += n
    if checksum(view) != record.meta.checksum:
        raise IntegrityError(f"checksum mismatch in {record.path} for {record.meta.key!r}")

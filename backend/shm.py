"""The same-host fast path's file format: a node's arena, and a client's put stage.

A node keeps its DRAM tier in one shared-memory file (``backend.node.memory.arena``). Its
first 4 KiB are a header: magic, a random token the node also publishes in the
registry, and the size of the data part. A client that can open the file named in
the registry, and finds the same token in it, is on the node's host and may copy
chunks straight out of the mapping (after a LEASE that keeps them in place).

A copy out of pages this process never touched pays a page fault per 4 KiB (about
half the speed of a copy out of mapped pages here). The node takes the file's pages
in steps from the start, so a view keeps its mapping populated up to the file's
allocated size, on a background thread at the lowest CPU priority, one
``MADV_POPULATE_READ`` per step: reads then find the pages mapped. It never touches
pages past the allocated size (that would allocate them in ``/dev/shm``).

The put path is the mirror image. A client on a node's host writes the chunks of a
put into its own *stage*, a file of the same format in the arena's directory
(``kvpool-<pid>-<token>.stage``, mode 0600, pages allocated when it is made, so a
write never finds a hole), and sends PUT_STAGED with their offsets instead of the
bytes. The node maps the stage read-only (:class:`ArenaView` with ``owned=True``:
only a regular file of its own user, so no other user can hand it a file to read, or
shrink one under its mapping), copies each chunk into its DRAM tier and verifies its
checksum, as it does for bytes from a socket.

A stage is held by its client for as long as the client's process lives: the client
keeps the stage's file open with a shared ``flock`` on it, which the kernel releases
when the process ends, however it ends (``kill -9`` included), and writes
:data:`STAGE_LOCKED_MARK` after the header to say so. A stage whose lock anyone can take
(:func:`remove_abandoned_stage`) belongs to no live process: the node sweeps such files from its
arena directory (``backend.node.serve.stages``). The lock works across PID namespaces (a
client in another container that shares the directory), where a pid could not be
checked; a stage without the mark (a client from before the lock) is judged by its pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
import weakref

import numpy as np

from backend.protocol.frame import checksum_stream

__all__ = [
    "ARENA_MAGIC",
    "HEADER",
    "HEADER_BYTES",
    "ArenaView",
    "PutStage",
    "read_header",
    "madvise",
    "MADV_POPULATE_WRITE",
    "FILE_PREFIX",
    "ARENA_SUFFIX",
    "STAGE_SUFFIX",
    "STAGE_NAME_RE",
    "STAGE_LOCKED_MARK",
    "STAGE_MIN_AGE_S",
    "remove_abandoned_stage",
    "remove_abandoned_stages",
    "pid_alive",
]

ARENA_MAGIC = b"KVPOOLSHM1"
HEADER_BYTES = 4096
HEADER = struct.Struct("<10s32sQ")  # magic, token (hex), data size in bytes
FILE_PREFIX = "kvpool-"  # then the owner's pid, a dash, 8 hex digits of its token
ARENA_SUFFIX = ".arena"
STAGE_SUFFIX = ".stage"
STAGE_NAME_RE = re.compile(r"^kvpool-\d{1,10}-[0-9a-f]{8}\.stage$")
# Written right after the header by a client that holds its stage's lock (older clients did not).
STAGE_LOCKED_MARK = b"kvpool-stage-locked-1"
# A stage younger than this is never removed: it may be being made (locked a moment after it is created).
STAGE_MIN_AGE_S = 2.0
# A checked copy hashes each piece right after copying it, while it is still in the CPU's cache.
COPY_PIECE_BYTES = 1024 * 1024
MADV_POPULATE_READ = 22  # Linux >= 5.14: map the pages now, not one fault at a time
MADV_POPULATE_WRITE = 23
POPULATE_STEP_BYTES = 64 * 1024 * 1024
POPULATE_NICE = 19  # the populating thread runs when the engine leaves a core idle

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) through ctypes, which drops the GIL (``mmap.madvise`` holds it): 0, or -1 with
    ``ctypes.get_errno()`` set. Most callers ignore it: the advice only saves faults."""
    return int(_libc.madvise(address, length, advice))


class ArenaView:
    """A read-only mapping of a kvpool shared-memory file: a node's arena (client side), or a
    client's put stage (node side)."""

    def __init__(self, path: str, token: str, *, owned: bool = False) -> None:
        """Map ``path`` read-only; OSError if it cannot be opened, ValueError if it is not the
        file ``token`` names (or, with ``owned``, not a regular file of this process's user)."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            size = info.st_size
            if owned and (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()):
                raise ValueError(f"{path} is not a regular file of this user")
            if size < HEADER_BYTES:
                raise ValueError(f"{path} is too small to be a kvpool arena")
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, found_token, data_bytes = read_header(self._map[:HEADER_BYTES])
        if magic != ARENA_MAGIC or found_token != token or data_bytes + HEADER_BYTES > size:
            self._map.close()
            raise ValueError(f"{path} is not the arena this node published")
        self.path = path
        self.size_bytes = size
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self._address = int(self._array.ctypes.data)
        self.mapped_bytes = 0  # pages below this offset are mapped in this process
        self._wanted = threading.Event()
        self._populator: threading.Thread | None = None
        self._closed = False

    def close(self) -> None:
        """Stop the background thread; the mapping goes with the last reference to this view."""
        self._closed = True
        self._wanted.set()

    def populate(self, end: int = 0) -> None:
        """Have the background thread map every page the node has allocated, if ``end`` is past what is mapped."""
        if end and end <= self.mapped_bytes:
            return
        if self._populator is None:
            self._populator = threading.Thread(target=self._populate, name="kvpool-arena-map", daemon=True)
            self._populator.start()
        self._wanted.set()

    def _populate(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread only, lowest priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), POPULATE_NICE)
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._closed:
                return
            try:
                allocated = min(os.stat(self.path).st_blocks * 512, self.size_bytes)
            except OSError:
                return  # the node is gone with its file: reads go elsewhere
            while self.mapped_bytes + mmap.PAGESIZE <= allocated and not self._closed:
                step = min(POPULATE_STEP_BYTES, allocated - self.mapped_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
                madvise(self._address + self.mapped_bytes, step, MADV_POPULATE_READ)
                self.mapped_bytes += step

    def copy_into(self, dest: memoryview, offset: int) -> None:
        """Copy ``len(dest)`` bytes at ``offset`` into ``dest``; ValueError if out of range."""
        np.copyto(np.frombuffer(dest, dtype=np.uint8), self._region(offset, len(dest)))

    def copy_checked(self, dest: memoryview, offset: int) -> int:
        """:meth:`copy_into`, returning the checksum of what was copied (computed piece by piece).

        The copies release the GIL; run it on a worker thread and two chunks copy at once.
        """
        return copy_checked(np.frombuffer(dest, dtype=np.uint8), self._region(offset, len(dest)))

    def _region(self, offset: int, nbytes: int) -> np.ndarray:  # type: ignore[type-arg]
        if offset < HEADER_BYTES or offset + nbytes > self.size_bytes:
            raise ValueError(f"region {offset}+{nbytes} is outside the arena ({self.size_bytes} bytes)")
        return self._array[offset : offset + nbytes]


class PutStage:
    """A client's put stage: a shared-memory file it writes chunks into for a node on its host.

    Made in the node's arena directory; its pages are allocated (``posix_fallocate``) and
    mapped before any write, so a full ``/dev/shm`` is an error here, never a SIGBUS on a
    write. Its file stays open, locked, for the stage's life (see the module docstring).
    Removed by :meth:`close`, or when the object is collected; a stage left by a client that
    died is removed by the node's sweep (``backend.node.serve.stages``).
    """

    def __init__(self, directory: str, size_bytes: int) -> None:
        """Create, lock and map the stage; OSError if ``directory`` has no room or cannot be written."""
        self.token = secrets.token_hex(16)
        self.name = f"{FILE_PREFIX}{os.getpid()}-{self.token[:8]}{STAGE_SUFFIX}"
        self.path = os.path.join(directory, self.name)
        self.size_bytes = HEADER_BYTES + size_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            # Locked before anything else; a sweep leaves alone a file younger than a few seconds.
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, self.size_bytes)
            os.posix_fallocate(fd, 0, self.size_bytes)
            self._map = mmap.mmap(fd, self.size_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(fd)
            raise
        self._map[: HEADER.size] = HEADER.pack(ARENA_MAGIC, self.token.encode(), size_bytes)
        self._map[HEADER.size : HEADER.size + len(STAGE_LOCKED_MARK)] = STAGE_LOCKED_MARK
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        madvise(int(self._array.ctypes.data), self.size_bytes, MADV_POPULATE_WRITE)
        # Removes the file and lets go of the lock: at close(), or when a client dropped without
        # close() is collected; in this process only (a forked child's copy leaves it alone).
        self._release = weakref.finalize(self, _remove_stage, self.path, fd, os.getpid())
        _LIVE_STAGES.add(self)

    def write_checked(self, offset: int, data: memoryview) -> int:
        """Copy ``data`` to ``offset`` and return its checksum (computed as it is copied)."""
        if offset < HEADER_BYTES or offset + len(data) > self.size_bytes:
            raise ValueError(f"region {offset}+{len(data)} is outside the stage ({self.size_bytes} bytes)")
        return copy_checked(self._array[offset : offset + len(data)], np.frombuffer(data, dtype=np.uint8))

    def close(self) -> None:
        """Remove the file and let go of its lock; nodes that mapped it keep their mapping until they drop it."""
        self._release()

    def forget(self) -> None:
        """In a forked child: the stage is the parent's. Drop this process's copy of the descriptor
        (the lock stays the parent's) and never remove the file from here."""
        detached = self._release.detach()
        if detached is not None:
            _, _, (_, fd, _), _ = detached
            with contextlib.suppress(OSError):
                os.close(fd)


_LIVE_STAGES: weakref.WeakSet[PutStage] = weakref.WeakSet()


def _forget_stages_in_child() -> None:
    # A forked child must not hold its parent's stages locked: they would outlive the parent.
    for stage in list(_LIVE_STAGES):
        stage.forget()


os.register_at_fork(after_in_child=_forget_stages_in_child)


def _remove_stage(path: str, fd: int, owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return  # a forked child at exit: the file and its lock are its parent's
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)


def remove_abandoned_stage(path: str, min_age_s: float = STAGE_MIN_AGE_S) -> bool:
    """Remove the stage file at ``path`` if it belongs to no live client; whether it did.

    Abandoned: at least ``min_age_s`` old, its lock free (taken here, and held while the
    file is unlinked: no client takes a stage's lock again once it let go), and either
    marked with :data:`STAGE_LOCKED_MARK` or, for a stage of a client from before the
    lock, its pid gone. Never blocks: the lock is tried, not waited for. A file that is not
    a regular file of this user is left alone.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return False
        if time.time() - info.st_mtime < min_age_s:
            return False  # being made: its client locks it the moment it exists, but give it time
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live process holds it
        if os.pread(fd, HEADER.size + len(STAGE_LOCKED_MARK), 0)[HEADER.size :] != STAGE_LOCKED_MARK:
            pid_text = os.path.basename(path)[len(FILE_PREFIX) :].split("-", 1)[0]
            if not pid_text.isdigit() or pid_alive(int(pid_text)):
                return False  # a client that does not lock its stage, and may still live
        if os.stat(path, follow_symlinks=False).st_ino != info.st_ino:
            return False  # the name is another file's now
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_abandoned_stages(directory: str | os.PathLike[str]) -> int:
    """Remove every stage in ``directory`` that no live client holds (:func:`remove_abandoned_stage`); how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if STAGE_NAME_RE.match(entry.name) and remove_abandoned_stage(entry.path):
                removed += 1
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists in this PID namespace (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def copy_checked(target: np.ndarray, source: np.ndarray) -> int:  # type: ignore[type-arg]
    """Copy ``source`` into ``target`` piece by piece, hashing each piece while it is in cache."""
    digest = checksum_stream()
    for start in range(0, len(target), COPY_PIECE_BYTES):
        piece = target[start : start + COPY_PIECE_BYTES]
        np.copyto(piece, source[start : start + COPY_PIECE_BYTES])
        digest.update(piece)
    return int(digest.intdigest())


def read_header(raw: bytes) -> tuple[bytes, str, int]:
    magic, token, data_bytes = HEADER.unpack(raw[: HEADER.size])
    return bytes(magic), bytes(token).decode("ascii", "replace"), int(data_bytes)

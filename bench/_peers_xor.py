"""The XOR+zstd-1 peer of ``bench/peers.py``: Stitch's delta method on rollpatch's board.

Per tensor, the zstd level-1 frame of old XOR new BF16 words and the xxh3-128 digest of the
new words (modal-projects/miles ``disk_delta.py``; the frames come from
``bench/_baselines.py``). A version's frames go into one object (the container below),
put on the board content-addressed (BLAKE3) with a manifest naming it as the patch from the
previous version, then LATEST moves: the same board, relays and polling as rollpatch, so only
the codec differs. Publishing is asynchronous like rollpatch's publisher: ``publish`` copies
the masters to host memory and returns; a worker casts, encodes, uploads and advances.

Container (little-endian): ``b"XZ1\\0"``, u32 header length, a JSON header
``{"tensors": [[name, offset, length, xxh3_128_hex], ...]}``, then the frames.
"""

from __future__ import annotations

import json
import queue
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _baselines import xor_apply, xor_encode

from rollpatch.board import Board
from rollpatch.formats import cast_view
from rollpatch.io.safetensors import view_to_bytes
from rollpatch.manifest import KeyframeObject, Manifest, PatchObject
from rollpatch.view import View

__all__ = ["XorPublisher", "apply_blob", "decode_blob", "encode_blob"]

MAGIC = b"XZ1\0"
LEVEL = 1
_MAX_HEADER = 64 << 20


def encode_blob(frames: Mapping[str, tuple[bytes, bytes]]) -> bytes:
    """Frames and digests per tensor → one container object."""
    entries, off = [], 0
    for name in sorted(frames):
        frame, digest = frames[name]
        entries.append([name, off, len(frame), digest.hex()])
        off += len(frame)
    header = json.dumps({"tensors": entries}).encode()
    return b"".join(
        [MAGIC, struct.pack("<I", len(header)), header, *(frames[n][0] for n in sorted(frames))]
    )


def decode_blob(blob: bytes) -> dict[str, tuple[bytes, bytes]]:
    """One container object → frames and digests per tensor (ValueError when malformed)."""
    if blob[:4] != MAGIC or len(blob) < 8:
        raise ValueError("not an XZ1 container")
    (n,) = struct.unpack("<I", blob[4:8])
    if n > min(_MAX_HEADER, len(blob) - 8):
        raise ValueError("XZ1 header length out of bounds")
    body = memoryview(blob)[8 + n :]
    out = {}
    for name, off, length, digest in json.loads(blob[8 : 8 + n])["tensors"]:
        if not (0 <= off and 0 <= length and off + length <= len(body)):
            raise ValueError(f"XZ1 frame of {name} out of bounds")
        out[name] = (bytes(body[off : off + length]), bytes.fromhex(digest))
    return out


def apply_blob(view: View, blob: bytes, pool: ThreadPoolExecutor) -> None:
    """Decompress, XOR into ``view`` in place, check every xxh3-128 (RoundTripError)."""
    frames = decode_blob(blob)
    if set(frames) != set(view):
        raise ValueError("XZ1 object names other tensors than the view holds")
    xor_apply(view, frames, pool)
    view.invalidate()


class XorPublisher:
    """Publishes versions as XOR+zstd-1 objects on a rollpatch board (see the module doc)."""

    def __init__(self, board: Board, run: str, *, threads: int | None = None) -> None:
        from rollpatch.native import threads as native_threads

        self.board, self.run = board, run
        # as many threads as rollpatch's native core takes in the same process (the cores
        # this process may run on, or ROLLPATCH_THREADS): the same parallelism on any machine
        self._pool = ThreadPoolExecutor(threads or native_threads())
        self._queue: queue.Queue[tuple[int, dict[str, np.ndarray], float, float] | None] = (
            queue.Queue()
        )
        self._prev: View | None = None
        self._error: BaseException | None = None
        self.stats: dict[int, dict[str, float]] = {}
        self._worker = threading.Thread(target=self._run, daemon=True, name="xor-publisher")
        self._worker.start()

    def publish(self, masters: Mapping[str, np.ndarray], version: int) -> float:
        """Snapshot to host memory and enqueue; returns the seconds the caller was blocked.
        ``stats[version]["total_s"]`` counts from this call to LATEST naming the version."""
        if self._error is not None:
            raise RuntimeError(f"XOR publisher failed: {self._error}") from self._error
        t0 = time.perf_counter()
        snap = {k: np.array(v, copy=True) for k, v in masters.items()}
        self._queue.put((version, snap, time.time(), t0))
        return time.perf_counter() - t0

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join()
        self._pool.shutdown()
        if self._error is not None:
            raise RuntimeError(f"XOR publisher failed: {self._error}") from self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                self._one(*item)
            except BaseException as e:  # noqa: BLE001 (reported by the next publish() or close())
                self._error = e

    def _one(
        self, version: int, masters: dict[str, np.ndarray], t_call: float, t_call_perf: float
    ) -> None:
        t0 = time.perf_counter()
        view = cast_view(masters, "bf16")
        del masters
        target = view.digest()
        t1 = time.perf_counter()
        if self._prev is None:
            ref = self.board.put_object(self.run, view_to_bytes(view), "safetensors")
            patches: tuple[PatchObject, ...] = ()
            keyframes: tuple[KeyframeObject, ...] = (KeyframeObject(ref),)
            nbytes = ref.size
        else:
            blob = encode_blob(xor_encode(self._prev, view, self._pool, LEVEL))
            t2 = time.perf_counter()
            ref = self.board.put_object(self.run, blob, "xz1")
            patches, keyframes = (PatchObject(ref, version - 1, self._prev.digest()),), ()
            nbytes = ref.size
            self.stats.setdefault(version, {})["encode_s"] = t2 - t1
        m = Manifest(
            run=self.run,
            version=version,
            parent=None if self._prev is None else version - 1,
            format="bf16",
            target=target,
            view_bytes=view.nbytes,
            created=t_call,
            publisher="bench-xor",
            patches=patches,
            keyframes=keyframes,
            meta={"codec": f"xor+zstd-{LEVEL}, xxh3-128 per tensor"},
        )
        self.board.put_manifest(m)
        self.board.advance(self.run, version)
        self.stats.setdefault(version, {}).update(
            cast_s=t1 - t0, total_s=time.perf_counter() - t_call_perf, bytes=float(nbytes)
        )
        self._prev = view

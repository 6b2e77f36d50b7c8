"""A trainer that publishes forever until it is killed (used by tests/test_crash.py).

Usage: ``python tests/crash_worker.py BOARD_DIR RUN``. It resumes the run from the board,
prints ``ready`` once its publisher exists, then publishes ``masters_for(n)`` as version ``n``
for n = LATEST+1, LATEST+2, ... as fast as it can, asynchronously, coalescing.

``ROLLPATCH_CRASH_STAGE_SLEEP=S`` makes every store write (object, manifest, keyframe marker,
pointer) sleep a random 0..S seconds before and after it, so a kill lands inside and between
the pipeline's stages rather than mostly in the CPU-bound ones.
"""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np

from rollpatch.board import Board
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import FileStore

#: The publisher configuration every trial uses (the test resumes with the same one).
CONFIG = PublisherConfig(keyframe_every=4, skip_strides=(2,), max_pending=1)
SHAPES = {
    "model.layers.0.mlp.up_proj.weight": (64, 96),
    "model.layers.0.mlp.down_proj.weight": (96, 64),
    "model.norm.weight": (64,),
}


def masters_for(version: int) -> dict[str, np.ndarray]:
    """The deterministic master state dict published as ``version``."""
    base, step = np.random.default_rng(0), np.random.default_rng(version + 1)
    return {
        name: (
            base.standard_normal(shape) * 0.02 + version * 2e-4 * step.standard_normal(shape)
        ).astype(np.float32)
        for name, shape in SHAPES.items()
    }


class SleepyFileStore(FileStore):
    """A file store whose writes sleep a random while around each operation."""

    def __init__(self, root: str, sleep: float) -> None:
        super().__init__(root)
        self.sleep = sleep

    def _nap(self) -> None:
        if self.sleep:
            time.sleep(random.uniform(0, self.sleep))

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        self._nap()
        super()._put(key, data, if_absent=if_absent)
        self._nap()

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        self._nap()
        super()._cas(key, data, expected=expected)
        self._nap()


def main(board_dir: str, run: str) -> None:
    sleep = float(os.environ.get("ROLLPATCH_CRASH_STAGE_SLEEP", "0"))
    board = Board(SleepyFileStore(board_dir, sleep))
    pub = Publisher(board, run, CONFIG)
    n = 0 if pub.last_durable is None else pub.last_durable + 1
    print("ready", flush=True)
    while True:
        pub.publish(masters_for(n), version=n)
        n += 1
        time.sleep(random.uniform(0, 0.01))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

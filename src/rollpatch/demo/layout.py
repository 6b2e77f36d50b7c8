"""Where the demo keeps things under its output directory, and how that directory is reset."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["Layout"]

_MARKER = ".rollpatch-demo"


@dataclass(frozen=True)
class Layout:
    """Paths of one demo run, all under ``root``."""

    root: Path

    @property
    def board(self) -> Path:
        """The bulletin board (a file store): what the trainer publishes to."""
        return self.root / "board"

    @property
    def board_uri(self) -> str:
        return self.board.resolve().as_uri()

    @property
    def model(self) -> Path:
        """The tiny model (config, tokenizer, random BF16 weights); reused across runs."""
        return self.root / "model"

    def cache(self, region: str) -> Path:
        """A regional relay's disk cache."""
        return self.root / "relay-cache" / region

    @property
    def key(self) -> Path:
        """The trainer's Ed25519 signing key (made for each run when the demo signs)."""
        return self.root / "trust" / "publisher.key"

    @property
    def trust_root(self) -> Path:
        """The root of trust the relays and islands verify under (``--trust``)."""
        return self.root / "trust" / "root.json"

    def trust_state(self, name: str) -> Path:
        """Rollback state of one verifying process (an island, a relay)."""
        return self.root / "trust" / f"state-{name}.json"

    def make_trust(self) -> None:
        """A fresh publisher key and root 1 (on the board and in :attr:`trust_root`)."""
        from ..board import Board
        from ..trust import Root, sign_root, write_keypair

        self.key.parent.mkdir(parents=True, exist_ok=True)
        _, _, key = write_keypair(self.key.with_suffix(""))
        raw = sign_root(Root.new([key.public]), [key])
        Board(self.board_uri).put_root(raw)
        self.trust_root.write_bytes(raw)

    @property
    def replay(self) -> Path:
        """``--model moe``: checkpoints of the versions whose routing transformers replayed."""
        return self.root / "replay"

    @property
    def logs(self) -> Path:
        """One log file per child process (their stderr and non-event output)."""
        return self.root / "logs"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    def plot(self, name: str) -> Path:
        return self.root / f"{name}.png"

    def prepare(self) -> None:
        """Create ``root``, or reset a previous demo run there (its model is kept).

        Refuses a non-empty directory that a demo did not create, so that ``--out`` can never
        delete someone's files.
        """
        root = self.root
        if root.exists() and any(root.iterdir()) and not (root / _MARKER).exists():
            raise ConfigError(
                "the output directory is not empty and was not made by `rollpatch demo`",
                path=str(root),
                hint="pass --out with a new or empty directory",
            )
        root.mkdir(parents=True, exist_ok=True)
        (root / _MARKER).write_text("made by rollpatch demo; reset on every run\n")
        for stale in (
            self.board,
            self.root / "relay-cache",
            self.logs,
            self.root / "trust",
            self.replay,
        ):
            if stale.exists():
                shutil.rmtree(stale)
        for png in root.glob("*.png"):
            png.unlink()
        if self.summary.exists():
            self.summary.unlink()
        self.board.mkdir()
        self.logs.mkdir()

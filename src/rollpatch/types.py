"""Domain vocabulary: versions, objects, constraints and pointer rules. Pure data, no I/O.

Everything else imports this module; it imports nothing of ours but ``errors``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError

__all__ = [
    "RUN_RE",
    "Constraint",
    "ObjectRef",
    "Pointer",
    "VersionRef",
    "check_run",
    "pointer_may_advance",
    "satisfies",
]

#: Run names: what may appear in a store key and a URL path segment.
RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_VERSION = (1 << 53) - 1  # JSON-safe integer


def check_run(run: str) -> str:
    """Validate a run name (ConfigError names the rule)."""
    if not isinstance(run, str) or not RUN_RE.match(run):
        raise ConfigError(
            f"invalid run name {run!r}",
            hint="1-128 characters of letters, digits, '.', '_', '-'; "
            "starting with a letter or digit",
        )
    return run


@dataclass(frozen=True, order=True)
class VersionRef:
    """A published version ``(run, n)``; immutable once published."""

    run: str
    n: int

    def __post_init__(self) -> None:
        check_run(self.run)
        if (
            not isinstance(self.n, int)
            or isinstance(self.n, bool)
            or not 0 <= self.n <= MAX_VERSION
        ):
            raise ConfigError(f"invalid version number {self.n!r}", run=self.run)

    def __str__(self) -> str:
        return f"{self.run}@{self.n}"


@dataclass(frozen=True)
class ObjectRef:
    """An immutable object on the board: key, size and BLAKE3 content hash (hex)."""

    key: str
    size: int
    b3: str


@dataclass(frozen=True)
class Pointer:
    """The LATEST pointer of a run: the newest complete version, its manifest and digest.

    A new training run is a new run name, i.e. a new epoch of versions: a run never restarts.
    """

    run: str
    version: int
    manifest: str
    target: str


def pointer_may_advance(current: Pointer | None, new: Pointer) -> bool:
    """LATEST never moves backwards (nor sideways to another manifest of the same version)."""
    if current is None:
        return True
    if new.run != current.run:
        return False
    return new.version > current.version


@dataclass(frozen=True, kw_only=True)
class Constraint:
    """What a caller accepts: at least ``min_version``, exactly ``exact_version``, or at most
    ``max_lag`` versions behind LATEST; ``wait_s`` bounds how long it may wait for catch-up
    (0 = answer at once)."""

    min_version: int | None = None
    exact_version: int | None = None
    max_lag: int | None = None
    wait_s: float | None = None

    def __post_init__(self) -> None:
        for field in ("min_version", "exact_version", "max_lag"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"{field} must be a non-negative integer", value=v)
        if self.wait_s is not None and not 0 <= self.wait_s <= 3600:
            raise ConfigError("wait_s must be between 0 and 3600 seconds", value=self.wait_s)
        if (
            self.exact_version is not None
            and self.min_version is not None
            and self.exact_version < self.min_version
        ):
            raise ConfigError("exact_version is below min_version")

    def lowest_acceptable(self, latest: int | None) -> int:
        """The smallest version that satisfies the constraint, given LATEST (if known)."""
        lo = 0
        if self.exact_version is not None:
            return self.exact_version
        if self.min_version is not None:
            lo = max(lo, self.min_version)
        if self.max_lag is not None and latest is not None:
            lo = max(lo, latest - self.max_lag)
        return lo


def satisfies(served: int, c: Constraint, latest: int | None) -> bool:
    """Whether serving version ``served`` satisfies ``c`` when LATEST is ``latest``."""
    if c.exact_version is not None and served != c.exact_version:
        return False
    return served >= c.lowest_acceptable(latest)

"""Gateway settings and island addresses (pure data, validated)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..serving.body import BodyLimits

__all__ = ["GatewayConfig", "IslandSpec", "parse_island"]


@dataclass(frozen=True)
class IslandSpec:
    """One island: a display ``name`` and the base URL of its sidecar."""

    name: str
    url: str

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"island {self.name!r} needs an http(s) sidecar URL",
                value=self.url,
                hint="e.g. http://10.0.0.5:8100",
            )
        if not self.name or any(c.isspace() for c in self.name):
            raise ConfigError("island names must be non-empty and without spaces", value=self.name)


def parse_island(text: str) -> IslandSpec:
    """``NAME=URL`` or a plain ``URL`` (the name is then ``host:port``)."""
    text = text.strip()
    name, sep, url = text.partition("=")
    if sep and "://" not in name:
        return IslandSpec(name.strip(), url.strip().rstrip("/"))
    url = text.rstrip("/")
    netloc = urlsplit(url).netloc
    return IslandSpec(netloc or url, url)


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Gateway settings (validated)."""

    #: Seconds between ``/version`` polls of each island.
    poll_s: float = 0.2
    #: Timeout of one ``/version`` poll; an island that does not answer is marked unreachable.
    poll_timeout_s: float = 2.0
    #: Timeout for opening a connection to a sidecar when forwarding (reads are unbounded:
    #: the sidecar may legitimately wait for catch-up, and generations may be long).
    connect_timeout_s: float = 2.0
    #: Most islands one request is sent to (the first try included).
    max_attempts: int = 3
    #: Pause before re-sending to the same island, which happens only when it is the only one.
    retry_backoff_s: float = 0.25
    #: Bounds on request bodies: size (413), JSON nesting depth (400), receive time (408).
    body: BodyLimits = field(default_factory=BodyLimits)
    #: Bearer token the islands' sidecars require on inference routes (None: they are open).
    #: Islands served over https are verified against the system CAs, or ``SSL_CERT_FILE``.
    island_token: str | None = None

    def __post_init__(self) -> None:
        if not 0.01 <= self.poll_s <= 60:
            raise ConfigError("poll_s must be in [0.01, 60]", field="poll_s", value=self.poll_s)
        if not 0 < self.poll_timeout_s <= 60:
            raise ConfigError("poll_timeout_s must be in (0, 60]", field="poll_timeout_s")
        if not 0 < self.connect_timeout_s <= 60:
            raise ConfigError("connect_timeout_s must be in (0, 60]", field="connect_timeout_s")
        if (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or not 1 <= self.max_attempts <= 16
        ):
            raise ConfigError(
                "max_attempts must be an integer in [1, 16]",
                field="max_attempts",
                value=self.max_attempts,
            )
        if not 0 <= self.retry_backoff_s <= 10:
            raise ConfigError("retry_backoff_s must be in [0, 10]", field="retry_backoff_s")
        if not isinstance(self.body, BodyLimits):
            raise ConfigError("body must be a BodyLimits", field="body")
        if self.island_token is not None and (
            not self.island_token.isascii()
            or not self.island_token.isprintable()
            or not self.island_token.strip()
        ):
            raise ConfigError("island_token must be printable ASCII", field="island_token")

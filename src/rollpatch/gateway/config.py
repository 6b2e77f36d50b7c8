"""Gateway settings and island addresses (pure data, validated)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from ..config import check_fields, setting
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
    """``NAME=URL`` or a plain ``URL`` (the name is then ``host:port``). The sidecar's root:
    an OpenAI base URL's ``/v1`` is dropped (as the sidecar's ``--engine-url`` drops it; kept,
    every request went to ``/v1/v1/...``)."""
    text = text.strip()
    name, sep, url = text.partition("=")
    if sep and "://" not in name:
        return IslandSpec(name.strip(), url.strip().rstrip("/").removesuffix("/v1"))
    url = text.rstrip("/").removesuffix("/v1")
    netloc = urlsplit(url).netloc
    return IslandSpec(netloc or url, url)


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Gateway settings (validated)."""

    poll_s: float = setting(
        0.2, lo=0.01, hi=60.0, help="seconds between /version polls of each island"
    )
    poll_timeout_s: float = setting(
        2.0,
        lo=0.0,
        lo_open=True,
        hi=60.0,
        help="deadline of one whole /version poll (connection, head and body); an island "
        "that does not answer within it is unreachable",
    )
    #: Reads are unbounded: the sidecar may legitimately wait for catch-up, and generations
    #: may be long.
    connect_timeout_s: float = setting(
        2.0,
        lo=0.0,
        lo_open=True,
        hi=60.0,
        help="seconds to connect to a sidecar before trying another",
    )
    max_attempts: int = setting(
        3, lo=1, hi=16, help="most islands one request is sent to (the first try included)"
    )
    retry_backoff_s: float = setting(
        0.25,
        lo=0.0,
        hi=10.0,
        help="pause before re-sending to the same island (only when it is the only one)",
    )
    max_answer_bytes: int = setting(
        64 << 20,
        lo=1024,
        hi=1 << 34,
        help="largest non-streamed answer read from an island (larger: 502, tried elsewhere)",
    )
    #: An SSE line holds one event; vLLM's routed_experts of a long generation come in one.
    max_event_bytes: int = setting(
        16 << 20,
        lo=1024,
        hi=1 << 32,
        help="longest line of an island's stream (longer: the stream ends with an error event)",
    )
    bad_answer_penalty_s: float = setting(
        30.0,
        lo=0.0,
        hi=3600.0,
        help="seconds an island that gave a bad answer (labels outside the constraint, none, "
        "not JSON, too large) is tried only when no other island can be",
    )
    #: Sidecars do not report their own bound in ``/version``, only ``latest_age_s``.
    latest_max_age_s: float = setting(
        5.0,
        lo=0.0,
        lo_open=True,
        hi=3600.0,
        help="/health counts an island fresh while its sidecar read LATEST less than this "
        "many seconds ago (set it to the islands' --latest-max-age: past it, they refuse "
        "max_lag requests)",
    )
    run: str | None = setting(
        None,
        help="the run every island must follow (default: the run most islands follow); "
        "islands of another run get no requests",
    )
    body: BodyLimits = setting(
        factory=BodyLimits,
        help="bounds on request bodies: size (413), JSON nesting depth (400), receive time (408)",
    )
    #: Islands served over https are verified against the system CAs, or ``SSL_CERT_FILE``.
    island_token: str | None = setting(
        None, help="bearer token the islands' sidecars require on inference routes"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.run is not None and (not self.run.strip() or not self.run.isprintable()):
            raise ConfigError("GatewayConfig.run must be a run name", field="run", value=self.run)
        if self.island_token is not None and (
            not self.island_token.isascii()
            or not self.island_token.isprintable()
            or not self.island_token.strip()
        ):
            raise ConfigError(
                "GatewayConfig.island_token must be printable ASCII", field="island_token"
            )

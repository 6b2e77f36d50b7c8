"""The rollpatch exception tree.

Every error rollpatch raises on purpose derives from :class:`RollpatchError`, carries the
context that identifies what failed (version, tensor, codec id, object key) and a hint that
says how to fix it. Layers above map classes, never messages, to behaviour (the sidecar maps
them to HTTP statuses; the CLI to exit codes)::

    RollpatchError
    ├── ConfigError                 bad option or argument (also a ValueError)
    │   └── LimitError              input over a size, depth or time bound (HTTP 413/408)
    ├── FormatError                 a served format cannot be applied to a tensor
    ├── ViewError                   a view or safetensors file is malformed or inconsistent
    ├── PatchError                  anything wrong with a patch
    │   ├── PatchDecodeError        bytes are not a valid patch: bad magic, checksum, bounds
    │   ├── CodecError              a codec id is unknown or its payload is inconsistent
    │   └── VerificationError       digests do not match: wrong base, corrupt result
    │       ├── BaseMismatchError   the view is not the patch's base (nothing was written)
    │       └── TargetMismatchError applying gave other bits than the target (rolled back)
    ├── StoreError                  storage backend failures
    │   ├── NotFoundError           key absent
    │   ├── AlreadyExistsError      put-if-absent refused: the key is published already
    │   ├── ConflictError           compare-and-swap lost a race
    │   └── TransientStoreError     network/timeout: safe to retry
    ├── BoardError                  versions, manifests, pointers, plans
    │   ├── ManifestError           a manifest is malformed or fails verification
    │   │   └── TrustError          unsigned, badly signed, expired or rolled-back metadata
    │   ├── VersionNotFoundError    no such version on the board
    │   └── NoPathError             no plan reaches the wanted version
    ├── EngineError                 an engine adapter failed (load, apply, digest)
    │   ├── EngineUnreachableError  no answer: no connection, or it broke
    │   └── IncompatibleModelError  the engine's model cannot hold the run's tensors
    └── NotReadyError               a component is not ready to serve (maps to 503)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AlreadyExistsError",
    "BaseMismatchError",
    "BoardError",
    "CodecError",
    "ConfigError",
    "ConflictError",
    "EngineError",
    "EngineUnreachableError",
    "FormatError",
    "IncompatibleModelError",
    "LimitError",
    "ManifestError",
    "NoPathError",
    "NotAnObjectError",
    "NotFoundError",
    "NotReadyError",
    "ObjectIntegrityError",
    "PatchDecodeError",
    "PatchError",
    "RollpatchError",
    "StoreError",
    "TargetMismatchError",
    "TooLargeError",
    "TransientStoreError",
    "TrustError",
    "VerificationError",
    "VersionNotFoundError",
    "ViewError",
    "engine_error",
    "error_report",
]


#: Characters of one context value an error's text shows (a hostile 100 KB tensor name
#: must not make a 100 KB log line).
MAX_CONTEXT_CHARS = 200


def _short(value: Any) -> str:
    text = repr(value)
    if len(text) <= MAX_CONTEXT_CHARS:
        return text
    return f"{text[:MAX_CONTEXT_CHARS]}... ({len(text):,} characters)"


class RollpatchError(Exception):
    """Base of every error rollpatch raises on purpose.

    ``context`` holds identifying fields (``tensor=``, ``version=``, ``codec=``, ``key=``...);
    ``hint`` says what the user can do about it. Both are rendered into ``str(err)``.
    """

    def __init__(self, message: str, *, hint: str | None = None, **context: Any) -> None:
        self.message = message
        self.hint = hint
        self.context = {k: v for k, v in context.items() if v is not None}
        super().__init__(self._render())

    def _render(self) -> str:
        text = self.message
        if self.context:
            text += " [" + ", ".join(f"{k}={_short(v)}" for k, v in self.context.items()) + "]"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text


class ConfigError(RollpatchError, ValueError):
    """An option, argument or configuration value is invalid."""


class LimitError(ConfigError):
    """Input exceeds a bound: too large, nested too deep, or sent too slowly."""


class FormatError(RollpatchError):
    """A served format cannot be computed for a tensor (dtype, shape, policy)."""


class ViewError(RollpatchError):
    """A view or a safetensors file is malformed or inconsistent."""


class PatchError(RollpatchError):
    """Base of all patch problems."""


class PatchDecodeError(PatchError):
    """The bytes are not a valid patch: bad magic, version, checksum, bounds or structure."""


class CodecError(PatchError):
    """A codec id is unknown, or a codec payload is inconsistent with its header."""


class VerificationError(PatchError):
    """A digest did not match."""


class BaseMismatchError(VerificationError):
    """The view given to apply is not the patch's base; nothing was written."""


class TargetMismatchError(VerificationError):
    """Applying the patch did not produce the target digest; the write was rolled back."""


class StoreError(RollpatchError):
    """A storage backend failed."""


class NotFoundError(StoreError, KeyError):
    """The key does not exist in the store."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self._render()


class NotAnObjectError(NotFoundError):
    """Something that is not a regular file has the key's name in a ``file://`` store (a
    link, a FIFO, a folder): no object there, and a reader that must have one says so."""


class TooLargeError(StoreError):
    """An object larger than its reader accepts, refused before its body was read (a reader
    that knows what to expect bounds what a store writer can make it allocate)."""


class AlreadyExistsError(StoreError):
    """put-if-absent refused: published objects are immutable."""


class ConflictError(StoreError):
    """A compare-and-swap lost a race (the pointer moved)."""


class TransientStoreError(StoreError):
    """A network or timeout failure: retrying is safe."""


class BoardError(RollpatchError):
    """Problems with versions, manifests, pointers or plans."""


class ManifestError(BoardError):
    """A manifest is malformed or fails verification."""


class ObjectIntegrityError(ManifestError):
    """A stored object does not match its manifest entry (size or BLAKE3): corrupt or
    truncated. ``key`` in the context names it, so a follower can plan around it."""


class TrustError(ManifestError):
    """Signed metadata was refused under the trust root (docs/trust.md).

    ``reason`` says why, as a stable label for logs and metrics: ``unsigned``,
    ``bad_signature``, ``expired``, ``rollback``, ``root`` (the root chain cannot be
    verified) or ``malformed`` (not a valid envelope).
    """

    def __init__(
        self, message: str, *, reason: str, hint: str | None = None, **context: Any
    ) -> None:
        self.reason = reason
        super().__init__(message, hint=hint, reason=reason, **context)


class VersionNotFoundError(BoardError):
    """The board has no such version."""


class NoPathError(BoardError):
    """No plan from the current version reaches the wanted one."""


class EngineError(RollpatchError):
    """An engine adapter failed to load, apply or digest."""


class EngineUnreachableError(EngineError):
    """The engine did not answer: no connection, or the connection broke. A remote engine
    that was unreachable may have restarted from its boot checkpoint meanwhile."""


class IncompatibleModelError(EngineError):
    """The engine's model cannot hold the run's versions: a tensor name, dtype or shape of
    the run's keyframe differs from the model the engine was started with. No retry changes
    it (until the run publishes another layout); the follower remembers it per keyframe."""


class NotReadyError(RollpatchError):
    """A component is not ready to serve yet (loading, recovering)."""


#: Error classes an engine's own process (a vLLM worker, SGLang's extension) may report and
#: :func:`engine_error` re-raises as themselves: the follower treats wrong bits specially.
_ENGINE_PASS_THROUGH = {
    "BaseMismatchError",
    "TargetMismatchError",
    "PatchDecodeError",
    "PatchError",
    "CodecError",
    "ViewError",
    "VerificationError",
    "EngineError",
    "EngineUnreachableError",
    "IncompatibleModelError",
}


def error_report(err: BaseException) -> dict[str, Any]:
    """``err`` as an engine's process reports it to rollpatch (:func:`engine_error` turns it
    back into an exception): ``{"type", "message", "hint", "context"}`` for a
    :class:`RollpatchError` (context values made JSON-able), ``{"type": "InternalError",
    "message"}`` for any other."""
    if isinstance(err, RollpatchError):
        ctx = {
            k: v if isinstance(v, (str, int, float, bool)) or v is None else str(v)
            for k, v in err.context.items()
        }
        return {
            "type": type(err).__name__,
            "message": err.message,
            "hint": err.hint,
            "context": ctx,
        }
    return {"type": "InternalError", "message": f"{type(err).__name__}: {err}"}


def engine_error(report: Mapping[str, Any], *, engine: str | None, what: str) -> RollpatchError:
    """The error an engine's process reported (``{"type", "message", "hint", "context"}``,
    :func:`error_report`) as a rollpatch exception: a class of :data:`_ENGINE_PASS_THROUGH`
    keeps its class, any other becomes an :class:`EngineError` naming it (``what``: who
    failed, for the message; ``engine``: named in the context unless None)."""
    name = str(report.get("type", "EngineError"))
    ctx = dict(report.get("context") or {})
    ctx.setdefault("engine", engine)
    cls = globals().get(name) if name in _ENGINE_PASS_THROUGH else None
    if cls is None:
        return EngineError(
            f"{what} failed ({name}): {report.get('message')}", hint=report.get("hint"), **ctx
        )
    err: RollpatchError = cls(str(report.get("message")), hint=report.get("hint"), **ctx)
    return err

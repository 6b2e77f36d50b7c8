"""The rule every tensor name obeys before rollpatch writes it anywhere (an audit, session 41).

- A name is 1 to :data:`MAX_NAME_BYTES` bytes of UTF-8 (docs/patch-format.md §2): a patch
  header refuses any other, so a checkpoint holding one was cast and published as version 0
  and then every later version failed to apply.
- A name is not one the safetensors format reserves (:data:`RESERVED_NAMES`:
  ``__metadata__``, the header's metadata entry): a tensor under it replaced the metadata and
  made a file nothing could read back.

:func:`check_names` raises :class:`~rollpatch.errors.ViewError` naming the tensor (a prefix
of a long name) and the rule. It runs where names enter (``load_masters``, the publisher's
``engine_names``, the CLI's casts, whose quantised formats add suffixes) and in the
safetensors writer.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ViewError

__all__ = ["MAX_NAME_BYTES", "RESERVED_NAMES", "check_names", "shown_name"]

#: The longest tensor name in bytes of UTF-8 (the patch format's ``MAX_NAME_BYTES``; a test
#: keeps the two equal).
MAX_NAME_BYTES = 1024
#: Names the safetensors format keeps for itself.
RESERVED_NAMES = frozenset({"__metadata__"})
_SHOWN = 80


def shown_name(name: str) -> str:
    """``name``, or its first and last characters and its length when it is long."""
    if len(name) <= _SHOWN:
        return name
    return f"{name[: _SHOWN - 24]}...{name[-24:]} ({len(name)} characters)"


def check_names(names: Iterable[object], *, reserved_only: bool = False) -> None:
    """Raise :class:`ViewError` for the first name that breaks the rule (module docstring);
    ``reserved_only``: only the reserved-name rule (a safetensors file that no patch carries
    may hold a longer name)."""
    for name in names:
        if not isinstance(name, str):
            raise ViewError("a tensor name must be a string", tensor=repr(name)[:_SHOWN], hint=_FIX)
        if name in RESERVED_NAMES:
            raise ViewError(
                f"tensor name {name!r} is reserved by the safetensors format (its metadata entry)",
                tensor=name,
                hint=_FIX,
            )
        if reserved_only:
            continue
        try:
            n = len(name.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate
            raise ViewError(
                "a tensor name is not valid UTF-8", tensor=shown_name(name), hint=_FIX
            ) from None
        if not 0 < n <= MAX_NAME_BYTES:
            raise ViewError(
                f"tensor name of {n} bytes: a name must be 1 to {MAX_NAME_BYTES} bytes of "
                "UTF-8 (docs/patch-format.md §2)",
                tensor=shown_name(name),
                hint=_FIX,
            )


_FIX = "rename the tensor in the checkpoint (its state dict's key) and save it again"

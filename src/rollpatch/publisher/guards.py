"""What the publisher refuses or fixes before a version reaches the board (docs/publisher.md,
*Guards*): a fleet follows whatever LATEST names, and LATEST never moves back.

- :func:`engine_names`: the state dict under the names an engine loads
  (``PublisherConfig.names="unwrap"``): a wrapper's prefix on every name (``torch.compile``'s
  ``_orig_mod.``, DDP's ``module.``) is taken off, and a tied alias (a tensor sharing its
  storage with another, e.g. ``lm_head.weight`` tied to ``model.embed_tokens.weight``)
  is published once, as engines hold it: under the input embedding's name when the aliases
  are an embedding and an output head (:data:`TIED_HEADS`), a ``shared`` embedding's name
  where an encoder-decoder ties one 3 or 4 ways, else under the smallest name,
  whatever the dict's order; before, both reached the board and every engine refused the
  run. Every name then obeys :func:`rollpatch.io.names.check_names` (1-1024 bytes of UTF-8,
  not ``__metadata__``).
- :func:`check_finite`: a served tensor with a NaN or ±inf (a diverged step) fails the
  version (``PublisherConfig.nonfinite="refuse"``); before, BF16 kept them and every engine
  served garbage under a verified label.
- :func:`check_same_model`: a version that adds, drops, reshapes or retypes a tensor fails
  (``PublisherConfig.model_changes="refuse"``): engines started with the run's model cannot
  load it, and a checkpoint of another model published by mistake moved LATEST past every
  engine.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..engines.fit import WRAPPER_PREFIXES
from ..errors import ConfigError, FormatError
from ..io.names import check_names

__all__ = [
    "TIED_HEADS",
    "check_finite",
    "check_same_model",
    "diverged",
    "engine_names",
    "nonfinite",
    "note_names",
]

log = logging.getLogger("rollpatch.publisher")


#: Served kinds with IEEE exponents: (word dtype, every bit but the exponent's). A word is
#: NaN or ±inf when its exponent bits are all ones: ``word | mask`` is then all ones.
_IEEE: dict[str, tuple[np.dtype, int]] = {
    "bf16": (np.dtype(np.uint16), 0x807F),
    "f16": (np.dtype(np.uint16), 0x83FF),
    "f32": (np.dtype(np.uint32), 0x807FFFFF),
}
_CHUNK = 1 << 18  # words per pass of the check (in cache)


def engine_names(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], str, list[str]]:
    """``state_dict`` without a wrapper's prefix shared by every name, and without tied
    aliases (module docstring; the name kept: :func:`_published_first`); also the prefix
    taken off ("" if none) and the aliases dropped. :class:`ViewError` for a name that
    breaks the name rule (:func:`rollpatch.io.names.check_names`)."""
    out = dict(state_dict)
    taken = ""
    while out and (p := next((w for w in WRAPPER_PREFIXES if all(_has(n, w) for n in out)), "")):
        out = {n[len(p) :]: v for n, v in out.items()}
        taken += p
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name in out:
        key = _storage_key(out[name])
        if key is not None:
            groups.setdefault(key, []).append(name)
    dropped: list[str] = []
    for names in groups.values():
        keep = min(names, key=_published_first)
        dropped += [n for n in names if n != keep]
    for name in dropped:
        del out[name]
    check_names(out)
    return out, taken, dropped


#: Modules that are an output head, by their name's components (transformers'
#: ``_tied_weights_keys`` ties these to the input embedding, which is the name its
#: ``save_pretrained`` keeps and engines load: ``lm_head.weight`` (most models),
#: ``embed_out.weight`` (GPT-NeoX), ``output.weight`` (GIT, Meta's own checkpoints),
#: ``proj_out.weight`` (Whisper), ``output_projection.weight`` (BioGPT), ...).
TIED_HEADS = frozenset(
    {
        "lm_head",
        "embed_out",
        "output",
        "proj_out",
        "output_projection",
        "vocab_projector",
        "lm_loss",
        "generator_lm_head",
        "head",
    }
)


def _published_first(name: str) -> tuple[bool, bool, str]:
    """Which alias of one storage is published: not an output head (:data:`TIED_HEADS`:
    the input embedding of a tied head), then a ``shared`` module (the embedding that
    encoder-decoders tie 3 or 4 ways: T5's ``shared.weight``, BART's ``model.shared.weight``,
    the name ``save_pretrained`` keeps; before session 42 the smallest name won there,
    ``decoder.embed_tokens.weight``), then the smallest name; never the dict's order (an
    audit, session 41: a state dict with its keys sorted published ``lm_head.weight``, and
    the same model's folder was then refused as another model)."""
    parts = name.split(".")
    if parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return any(p in TIED_HEADS for p in parts), parts[-1:] != ["shared"], name


def _has(name: object, prefix: str) -> bool:
    return isinstance(name, str) and name.startswith(prefix) and len(name) > len(prefix)


def _storage_key(value: Any) -> tuple[Any, ...] | None:
    """Equal for two tensors that are the same elements of the same memory (a tied alias);
    None for what is not a plain torch tensor or numpy array, or holds no element."""
    if isinstance(value, np.ndarray):
        if value.size == 0:
            return None
        ai = value.__array_interface__
        return ("np", ai["data"][0], value.shape, value.strides, value.dtype.str)
    kind = type(value)
    if not kind.__module__.startswith("torch"):
        return None
    if kind.__name__ == "DTensor":  # FSDP2: tied if this rank's shards are one memory and
        try:  # the global tensors alike (before session 42 never: audit J, a tied head
            local = _storage_key(value.to_local())  # published twice under FSDP2)
        except (RuntimeError, AttributeError, NotImplementedError):
            return None
        return None if local is None else ("dtensor", tuple(value.shape), local)
    if kind.__name__ not in ("Tensor", "Parameter"):
        return None  # a wrapper subclass: its memory is not its own to compare
    try:
        if value.numel() == 0 or value.device.type == "meta":
            return None
        ptr = value.untyped_storage().data_ptr()
        if not ptr:
            return None
        return (
            "torch",
            str(value.device),
            ptr,
            value.storage_offset(),
            tuple(value.shape),
            tuple(value.stride()),
            str(value.dtype),
        )
    except (RuntimeError, AttributeError, NotImplementedError):  # no storage of its own
        return None


def nonfinite(kind: str, words: Any) -> bool:
    """Whether a tensor of ``kind`` whose words are ``words`` (a flat numpy array, or a torch
    tensor on any device) holds a NaN or ±inf; False for kinds without an IEEE exponent."""
    spec = _IEEE.get(kind)
    if spec is None:
        return False
    dtype, mask = spec
    if not isinstance(words, np.ndarray):  # torch
        if words.numel() == 0:
            return False
        if dtype.itemsize != 2 or words.element_size() != 2:  # no uint32 in torch
            return nonfinite(kind, words.detach().cpu().numpy())
        return bool(((words.view(-1) | (mask - (1 << 16))) == -1).any())  # int16 words
    if words.size == 0:
        return False
    flat = words.reshape(-1).view(dtype)
    tmp = np.empty(min(_CHUNK, flat.size), dtype)
    full = (1 << (8 * dtype.itemsize)) - 1
    for s in range(0, flat.size, _CHUNK):
        part = flat[s : s + _CHUNK]
        t = tmp[: part.size]
        np.bitwise_or(part, mask, out=t)
        if t.max() == full:
            return True
    return False


def diverged(masters: Any, error: BaseException | None, *, refuse: bool) -> bool:
    """Whether a snapshot will fail its version: its cast failed (``error``), or it is a
    served view (cast when snapshotted) holding a NaN or ±inf (:func:`check_finite`, when
    ``refuse``: ``PublisherConfig.nonfinite="refuse"``). The
    publisher then does not let it push an older snapshot, the last good version, out of its
    queue (found by an audit, session 38: a good version dropped for a diverged one that then
    failed left the board a version behind). Masters cast later are not checked here."""
    if error is not None:
        return True
    if (
        not refuse
        or not isinstance(masters, Mapping)
        or not all(hasattr(t, "kind") for t in masters.values())
    ):
        return False
    try:
        check_finite(masters, run="", version=0)
    except FormatError:
        return True
    return False


def check_finite(view: Mapping[str, Any], *, run: str, version: int) -> None:
    """Raise :class:`FormatError` naming the first served tensor of ``view`` (kind ``.kind``,
    words ``.data`` or ``.words``) that holds a NaN or ±inf."""
    for name in sorted(view):
        t = view[name]
        words = getattr(t, "words", None)
        if words is None:
            words = t.data
        if nonfinite(t.kind.name, words):
            raise FormatError(
                f"{run}@{version}: tensor {name!r} holds NaN or infinite values "
                "(a diverged step?); not published",
                tensor=name,
                hint="check the loss and the optimizer; PublisherConfig(nonfinite='allow') "
                "publishes them anyway (engines then serve them)",
            )


def check_same_model(
    prev: Mapping[str, Any] | None, view: Mapping[str, Any], *, run: str, version: int, whole: bool
) -> None:
    """Raise :class:`ViewError` for a served name a patch cannot carry
    (:func:`rollpatch.io.names.check_names`: a quantised format's suffixes make names
    longer), and :class:`ConfigError` when ``view`` adds, reshapes or retypes a tensor of
    ``prev`` (the previous version's view of this shard), or drops one (unless ``whole``:
    ``prev`` is a resumed view of every shard, whose other tensors are other ranks')."""
    check_names(view)  # the served names (a quantised format adds suffixes): a patch carries them
    if prev is None:
        return
    changed = sorted(n for n in view if n not in prev or _layout(prev[n]) != _layout(view[n]))
    dropped = [] if whole else sorted(n for n in prev if n not in view)
    if not changed and not dropped:
        return
    raise ConfigError(
        f"{run}@{version}: the model changed: {len(changed)} tensor(s) added, reshaped or "
        f"retyped and {len(dropped)} dropped since the last version; engines started with the "
        "run's model cannot load it (and LATEST never moves back)",
        changed=changed[:5],
        dropped=dropped[:5],
        hint="publish the run's model (the same names and shapes; a wrapped module's "
        "state_dict under its wrapper's names?), a new run for a new model, or "
        "PublisherConfig(model_changes='allow') (CLI --model-changes allow)",
    )


def _layout(t: Any) -> tuple[str, tuple[int, ...]]:
    return t.kind.name, tuple(t.shape)


def note_names(run: str, taken: str, dropped: list[str]) -> None:
    """Log once what :func:`engine_names` did (the caller logs on the first publish only)."""
    if taken:
        log.info("%s: publishing the names without the wrapper prefix %r", run, taken)
    if dropped:
        log.info(
            "%s: %d tied alias(es) not published (each shares its memory with a tensor "
            "published under the embedding's or the smallest name, as engines hold it): %s",
            run,
            len(dropped),
            ", ".join(dropped[:5]),
        )

"""Whether an engine's model can hold a run's versions: every tensor's name, dtype and shape.

An engine started with another model than the run trains (another size, another
architecture, a checkpoint with a tied head where the run publishes an untied one) can never
load a version. The follower checks a keyframe against the engine's tensors
(:meth:`rollpatch.engines.EngineAdapter.model_tensors`) tensor by tensor as each keyframe
shard's header is read, before any of the shard's tensors is fetched, and the name sets once
every shard is read: a difference is an :class:`~rollpatch.errors.IncompatibleModelError`
naming the first tensor that differs. The follower remembers it per keyframe, so no retry
fetches that keyframe again (docs/follower.md, *An engine that cannot hold the run*).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..errors import IncompatibleModelError
from ..kinds import get_kind

__all__ = [
    "FIXED_MODEL",
    "WRAPPER_PREFIXES",
    "FitCheck",
    "ListedTensors",
    "ModelTensors",
    "changed_tensor_set",
    "tensors_of_kinds",
    "tensors_of_view",
]

#: Tensor name -> (safetensors dtype, shape).
ModelTensors = Mapping[str, tuple[str, tuple[int, ...]]]

#: Prefixes a wrapper puts before every name of the module it wraps (``torch.compile``'s,
#: DDP's): the publisher takes them off (``PublisherConfig.names``), engines never have them.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")

_HINT = "start the engine with the model this run trains (same architecture and size)"
#: A version whose tensors differ from the engine's model (added, dropped, reshaped).
FIXED_MODEL = (
    "the engine's model has a fixed set of tensors: the engines keep serving their last version; "
    "start them with the run's new model (a keyframe of it), or publish without the change"
)


def tensors_of_view(view: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of a view (name -> tensor with ``dtype`` and ``shape``)."""
    return {n: (t.dtype, tuple(int(d) for d in t.shape)) for n, t in view.items()}


def tensors_of_kinds(tensors: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors from an engine's ``name -> [kind, shape]`` listing (the vLLM and SGLang
    extensions' ``info``)."""
    return {
        n: (get_kind(str(kind)).dtype, tuple(int(d) for d in shape))
        for n, (kind, shape) in tensors.items()
    }


def changed_tensor_set(name: str, op: str) -> IncompatibleModelError:
    """The refusal of a version that adds or drops tensor ``name`` (``op``: the patch's op)
    for an engine whose model's tensors are fixed."""
    return IncompatibleModelError(
        "the version adds or drops a tensor; the engine's model cannot change",
        tensor=name,
        op=op,
        hint=FIXED_MODEL,
    )


class ListedTensors:
    """For an adapter whose engine lists its tensors in ``info()["tensors"]`` (name ->
    ``[kind, shape]``: the vLLM and SGLang extensions): :meth:`tensors`, read once (and again by
    :meth:`model_tensors`), and :meth:`model_tensors`."""

    _tensors: dict[str, Any] | None = None

    def info(self) -> dict[str, Any]:
        raise NotImplementedError

    def tensors(self) -> dict[str, Any]:
        """Checkpoint name -> [kind, shape] of every tensor the engine holds (cached)."""
        if self._tensors is None:
            self._tensors = dict(self.info()["tensors"])
        return self._tensors

    def model_tensors(self) -> ModelTensors:
        """Read from the engine each time (a keyframe boot, a retry after a refusal: it may
        have been restarted with another model), refreshing :meth:`tensors`' copy."""
        self._tensors = dict(self.info()["tensors"])
        return tensors_of_kinds(self._tensors)


class FitCheck:
    """Checks one version's keyframe against an engine's tensors (``engine``: its name, for
    the messages). Raises :class:`IncompatibleModelError` naming the first difference."""

    def __init__(
        self,
        tensors: ModelTensors,
        *,
        engine: str,
        run: str,
        version: int,
        fmt: str | None = None,
    ) -> None:
        self.tensors = tensors
        #: ``fmt``: the version's served format (a quantised run holds scale tensors, and
        #: other dtypes, than a bf16 model: named in every message)
        self._where = {"engine": engine, "run": run, "version": version, "run_format": fmt}

    def tensor(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        """One keyframe tensor (from a shard's header, or a sliced tensor's manifest entry)."""
        have = self.tensors.get(name)
        if have is None:
            raise IncompatibleModelError(
                "the run has a tensor the engine's model does not",
                tensor=name,
                dtype=dtype,
                shape=tuple(shape),
                hint=self._hint(name),
                **self._where,
            )
        if have != (dtype, tuple(shape)):
            raise IncompatibleModelError(
                "a tensor of the run differs from the engine's model",
                tensor=name,
                run_dtype=dtype,
                run_shape=tuple(shape),
                engine_dtype=have[0],
                engine_shape=have[1],
                hint=_HINT,
                **self._where,
            )

    def _hint(self, name: str) -> str:
        """What to do about a run tensor the engine lacks: a wrapper's prefix (the run was
        published under a wrapped module's names), a tied alias (a head the engine holds
        tied to its embedding), else the model itself."""
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix) and name[len(prefix) :] in self.tensors:
                return (
                    f"the run's names carry a wrapper's prefix {prefix!r}: publish the unwrapped "
                    "module's names (PublisherConfig(names='unwrap'), the default) to a new run"
                )
        if name.endswith("lm_head.weight"):
            return (
                "the engine's model may tie its head to the embedding: publish each tied "
                "tensor once (PublisherConfig(names='unwrap'), the default) to a new run, or "
                + _HINT
            )
        return _HINT

    def names(self, names: Collection[str]) -> None:
        """The keyframe's whole name set (every shard's): the same tensors as the engine's."""
        extra = sorted(set(names) - set(self.tensors))
        if extra:
            raise IncompatibleModelError(
                f"the run has {len(extra)} tensor(s) the engine's model does not",
                tensor=extra[0],
                hint=self._hint(extra[0]),
                **self._where,
            )
        missing = sorted(set(self.tensors) - set(names))
        if missing:
            raise IncompatibleModelError(
                f"the engine's model has {len(missing)} tensor(s) the run does not publish",
                tensor=missing[0],
                hint=_HINT,
                **self._where,
            )

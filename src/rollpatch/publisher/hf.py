"""Publishing from a transformers (or TRL) training loop: :class:`RollpatchCallback`::

    from rollpatch.publisher import Publisher, PublisherConfig
    from rollpatch.publisher.hf import RollpatchCallback

    # one process (DDP/accelerate: the main process only; sharded=False, or with
    # torch.distributed running the publisher would shard across every rank)
    pub = Publisher(
        "s3://bucket/rollpatch", "grpo-run-7", PublisherConfig(format="bf16"), sharded=False
    )
    trainer = GRPOTrainer(..., callbacks=[RollpatchCallback(pub)])
    trainer.train()     # one version per optimizer step; the publisher is closed at the end

This module imports transformers (its ``TrainerCallback`` is the base class); ``import
rollpatch`` and ``import rollpatch.publisher`` never do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError
from .core import Publisher

try:
    from transformers import TrainerCallback
except ImportError as e:  # one line naming the extra, not a bare ModuleNotFoundError
    raise ImportError(
        "rollpatch.publisher.hf needs transformers: "
        "pip install 'rollpatch[reference]' (or pip install transformers)"
    ) from e

__all__ = ["RollpatchCallback", "float_state_dict"]

StateFn = Callable[[Any], Mapping[str, Any]]


def float_state_dict(model: Any) -> dict[str, Any]:
    """``model.state_dict()`` without integer and bool buffers (position ids, masks): the
    floating tensors under their checkpoint names, which is what engines load as weights."""
    return {name: t for name, t in model.state_dict().items() if t.is_floating_point()}


class RollpatchCallback(TrainerCallback):
    """Publishes the model after every ``every``-th optimizer step, and the final weights at
    the end of training when the last step was not one of those; closes the publisher at
    the end of training.

    ``publisher``: an open :class:`~rollpatch.publisher.Publisher`. Each publish goes to
    ``publisher.publish(state_dict_fn(model), step=state.global_step)``; versions are numbered
    by the publisher (0, 1, 2, ...). Under gradient accumulation ``on_step_end`` runs once per
    optimizer step, so a version is a real parameter update.

    Which processes publish: with an unsharded publisher (``publisher.shards == 1``) only the
    main process (``state.is_world_process_zero``), so DDP ranks holding the same weights do
    not publish them N times; construct the publisher there only, with ``sharded=False``
    (with torch.distributed initialised a publisher shards across every rank by default, and
    one constructed on the main process alone fails after ``sharded.HANDSHAKE_S``), and pass
    ``None`` elsewhere.
    With a sharded publisher every rank publishes its own shard, and ``state_dict_fn`` must
    return that rank's disjoint tensors under their full names (e.g. gathered per FSDP unit).

    ``state_dict_fn`` (default :func:`float_state_dict`) maps the model to the tensors to
    publish, e.g. to merge LoRA adapters first. ``publish_initial`` also publishes the weights
    before the first step (on ``on_train_begin``), so rollout engines can boot from the board.
    ``flush_every_step`` waits until each version is durable before training goes on
    (otherwise the upload overlaps the next step, and under a slow uplink the publisher may
    coalesce versions: see docs/publisher.md). ``close_on_end`` closes the publisher in
    ``on_train_end`` (raising the first publishing error, if any nobody saw yet).
    """

    def __init__(
        self,
        publisher: Publisher | None,
        *,
        every: int = 1,
        state_dict_fn: StateFn | None = None,
        publish_initial: bool = False,
        flush_every_step: bool = False,
        close_on_end: bool = True,
    ) -> None:
        if publisher is not None and not isinstance(publisher, Publisher):
            raise ConfigError(
                "RollpatchCallback needs a rollpatch Publisher (or None on ranks "
                "that do not publish)",
                value=type(publisher).__name__,
            )
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError("RollpatchCallback.every must be an int >= 1", value=every)
        if publisher is not None and publisher.shards > 1 and state_dict_fn is None:
            raise ConfigError(
                "a sharded publisher needs state_dict_fn",
                hint="return this rank's own (disjoint) tensors under their full checkpoint names",
                shards=publisher.shards,
            )
        self.publisher = publisher
        self.every = every
        self.state_dict_fn: StateFn = (
            state_dict_fn if state_dict_fn is not None else float_state_dict
        )
        self.publish_initial = publish_initial
        self.flush_every_step = flush_every_step
        self.close_on_end = close_on_end
        self.last_version: int | None = None
        """The version this callback published last (None: none yet)."""
        self.n_published = 0
        """How many versions this callback published."""
        self._last_step: int | None = None  # the trainer's step of the last version

    def _publishes(self, state: Any) -> bool:
        if self.publisher is None:
            return False
        return self.publisher.shards > 1 or bool(state.is_world_process_zero)

    def _publish(self, state: Any, model: Any) -> None:
        if self.publisher is None:  # narrowed for the type checker; _publishes checked it
            return
        if model is None:
            raise ConfigError(
                "the trainer passed no model to RollpatchCallback", step=state.global_step
            )
        version = self.publisher.publish(self.state_dict_fn(model), step=state.global_step)
        self.last_version = version
        self.n_published += 1
        self._last_step = state.global_step
        if self.flush_every_step:
            self.publisher.flush()

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        if self.publish_initial and self._publishes(state):
            self._publish(state, model)

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        if self._publishes(state) and state.global_step % self.every == 0:
            self._publish(state, model)

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        # the final weights, when the last step was not a multiple of ``every``
        if self._publishes(state) and model is not None and self._last_step != state.global_step:
            self._publish(state, model)
        if self.close_on_end and self.publisher is not None:
            self.publisher.close()

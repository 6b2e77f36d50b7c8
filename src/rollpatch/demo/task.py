"""The demo's task: ``1+d`` → the units digit of ``1 + d``, answered with one digit token.

A verifiable reward (1 for the right digit, else 0). The prompt is token ids
``[<bos>, "1", "+", d]`` and the answer is the single next token. After the format warm-up
the model answers with a digit ~99% of the time and picks the right one ~10% of the time, so
the reward starts near 0.1 and RL has a clear signal to climb.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError

__all__ = ["DigitTask"]


@dataclass(frozen=True)
class DigitTask:
    """Token ids of the task's vocabulary (from the tiny model's tokenizer)."""

    bos: int
    plus: int
    digits: tuple[int, ...]  # token id of "0".."9"

    @classmethod
    def from_tokenizer(cls, tok: Any) -> DigitTask:
        """Look the ids up; each digit and "+" must be a single token."""
        ids = [tok.convert_tokens_to_ids(str(i)) for i in range(10)]
        plus = tok.convert_tokens_to_ids("+")
        unk = getattr(tok, "unk_token_id", None)
        if any(i is None or i == unk for i in [*ids, plus]) or tok.bos_token_id is None:
            raise ConfigError("the tokenizer lacks single-token digits, '+' or <bos>")
        return cls(int(tok.bos_token_id), int(plus), tuple(int(i) for i in ids))

    def prompt(self, d: int) -> list[int]:
        """Prompt token ids for digit ``d``."""
        return [self.bos, self.digits[1], self.plus, self.digits[d]]

    def answer(self, d: int) -> int:
        """Token id of the correct answer."""
        return self.digits[(d + 1) % 10]

    def reward(self, d: int, token: int) -> float:
        """1.0 when ``token`` is the right digit, else 0.0."""
        return 1.0 if token == self.answer(d) else 0.0

    def sample(self, rng: np.random.Generator) -> int:
        """A uniformly random task digit."""
        return int(rng.integers(0, 10))

    def text(self, d: int) -> str:
        """Human-readable prompt (for logs)."""
        return f"1+{d}="

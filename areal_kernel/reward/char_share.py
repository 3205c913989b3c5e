"""A graded format reward: the share of a completion's characters drawn
from a set (by default ASCII letters and digits).

Besides being a format reward of its own, it is a signal a random model can
learn: a tiny random Llama with a byte-level tokenizer
(``areal_kernel.models.tiny.make_tiny_byte_chat_llama``) samples about a
quarter of its characters from the default set and, under GRPO, raises that
share within a dozen steps, while a run with ``lr=0`` stays where it began.
The suite's tiny-model learning tests stand on this (see
``areal_kernel.testing.learning``).
"""

from __future__ import annotations

import string

DEFAULT_CHARS = string.ascii_letters + string.digits


def char_share_reward(completion: str, answer: str, *, chars: str = DEFAULT_CHARS) -> float:
    """The fraction of ``completion``'s characters that are in ``chars``
    (0.0 for an empty completion); ``answer`` is not used."""
    if not completion:
        return 0.0
    allowed = set(chars)
    return sum(c in allowed for c in completion) / len(completion)

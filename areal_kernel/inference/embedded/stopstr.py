"""Stop strings for the embedded server, checked on token ids (no torch).

A generation stops right after the token that completes a stop string; that
token stays in the output, so the ids are exactly what was sampled. Only the
tail of the output is decoded per step: a string of ``n`` characters spans at
most ``4 * n`` byte-level tokens, plus a few for a token that starts before
it. Because the check runs after every token, any occurrence found in the
tail has just been completed.
"""

from __future__ import annotations

from typing import Callable, Sequence


class StopStrings:
    """``match(output_ids)``: the stop string the output now contains, or None."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        self.stops = [s for s in stops if s]
        self.decode = decode
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 4

    def match(self, output_ids: Sequence[int]) -> str | None:
        if not self.stops:
            return None
        text = self.decode(list(output_ids[-self.window :]))
        # The earliest-ending occurrence is the one generation reached first.
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), s)
        return best[1] if best else None

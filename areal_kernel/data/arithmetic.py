"""A built-in, offline task: small integer arithmetic questions.

SmolLM2-135M answers single-digit addition about 60% of the time greedily,
which leaves room for RL to show progress within minutes on a CPU.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Iterator, Sequence

from areal_kernel.errors import ConfigError

PROMPT_TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}

Problem = tuple[int, str, int]


def arithmetic_records(
    n: int,
    seed: int,
    *,
    ops: Sequence[str] = ("+",),
    min_operand: int = 0,
    max_operand: int = 9,
) -> list[dict[str, Any]]:
    """``n`` questions ``{"id", "prompt", "answer"}``; the same arguments give
    the same list. Problems are distinct while ``n`` fits the problem space,
    and repeat (in a fresh shuffled order per pass) beyond it."""
    space = _space(ops, min_operand, max_operand)
    _check_n("n", n)
    rng = random.Random(seed)
    rng.shuffle(space)
    problems = itertools.islice(_cycle(space, rng), n)
    return [_record(p, f"arith:{seed}:{i}") for i, p in enumerate(problems)]


def arithmetic_splits(
    n_train: int,
    n_eval: int,
    seed: int,
    *,
    split_seed: int | None = None,
    ops: Sequence[str] = ("+",),
    min_operand: int = 0,
    max_operand: int = 9,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, eval)`` with no problem in both, as long as ``n_eval`` is
    smaller than the problem space (train then repeats problems if needed).
    Eval problems are distinct while ``n_eval`` fits the space.

    ``split_seed`` picks the held-out problems (default: ``seed``). Fix it to
    compare runs of different seeds on the same held-out set: ``seed`` then
    only orders the training stream."""
    space = _space(ops, min_operand, max_operand)
    _check_n("n_train", n_train)
    _check_n("n_eval", n_eval)
    split_rng = random.Random(seed if split_seed is None else split_seed)
    split_rng.shuffle(space)
    held_out = space[: min(n_eval, len(space))]
    eval_problems = list(itertools.islice(_cycle(held_out, split_rng), n_eval)) if n_eval else []
    # Only when eval takes the whole space must train overlap it.
    pool = space[len(held_out) :] or space
    # One generator for both when no split seed is given (the lists stay what they were).
    rng = split_rng if split_seed is None else random.Random(seed)
    train_problems = list(itertools.islice(_cycle(list(pool), rng), n_train))
    train = [_record(p, f"arith:{seed}:train:{i}") for i, p in enumerate(train_problems)]
    evals = [_record(p, f"arith:{seed}:eval:{i}") for i, p in enumerate(eval_problems)]
    return train, evals


def _space(ops: Sequence[str], lo: int, hi: int) -> list[Problem]:
    if isinstance(ops, str):
        ops = (ops,)
    bad = [op for op in ops if op not in _OPS]
    if bad or not ops:
        raise ConfigError(f"arithmetic ops {list(ops)!r} invalid; valid ops: {list(_OPS)}")
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo > hi:
        raise ConfigError(f"arithmetic operands need integers min_operand <= max_operand, got {lo!r}..{hi!r}")
    ordered_ops = list(dict.fromkeys(ops))  # dedupe, keep order (for determinism)
    return [(a, op, b) for op in ordered_ops for a in range(lo, hi + 1) for b in range(lo, hi + 1)]


def _check_n(name: str, n: int) -> None:
    if not isinstance(n, int) or n < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {n!r}")


def _cycle(items: list[Problem], rng: random.Random) -> Iterator[Problem]:
    """The items in order, then reshuffled passes forever."""
    if not items:
        return
    yield from items
    again = list(items)
    while True:
        rng.shuffle(again)
        yield from again


def _record(p: Problem, rid: str) -> dict[str, Any]:
    a, op, b = p
    return {"id": rid, "prompt": PROMPT_TEMPLATE.format(a=a, op=op, b=b), "answer": str(_OPS[op](a, b))}

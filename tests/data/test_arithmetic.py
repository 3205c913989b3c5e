"""The built-in arithmetic task: correct, deterministic, disjoint splits."""

from __future__ import annotations

import operator
import re

import pytest

from areal_kernel.data import arithmetic_records, arithmetic_splits, train_eval_split
from areal_kernel.errors import ConfigError

_Q = re.compile(r"^What is (-?\d+) ([-+*]) (-?\d+)\? Answer with just the number\.$")
_PY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def check_answers(records):
    for r in records:
        m = _Q.match(r["prompt"])
        assert m, r["prompt"]
        a, op, b = int(m[1]), m[2], int(m[3])
        assert r["answer"] == str(_PY[op](a, b)), r


def test_records_are_correct_and_deterministic():
    a = arithmetic_records(50, seed=7, ops=("+", "-", "*"), min_operand=0, max_operand=12)
    check_answers(a)
    assert a == arithmetic_records(50, seed=7, ops=("+", "-", "*"), min_operand=0, max_operand=12)
    assert [r["prompt"] for r in a] != [
        r["prompt"] for r in arithmetic_records(50, seed=8, ops=("+", "-", "*"), max_operand=12)
    ]
    assert len({r["id"] for r in a}) == 50
    assert {r["prompt"].split()[3] for r in a} == {"+", "-", "*"}


def test_defaults_are_single_digit_addition():
    recs = arithmetic_records(100, seed=0)
    check_answers(recs)
    pairs = {tuple(int(x) for x in _Q.match(r["prompt"]).group(1, 3)) for r in recs}
    assert pairs == {(a, b) for a in range(10) for b in range(10)}  # the whole space, each once


def test_more_records_than_problems_repeat():
    recs = arithmetic_records(250, seed=1, max_operand=4)  # 25 problems
    check_answers(recs)
    assert len(recs) == 250 and len({r["prompt"] for r in recs}) == 25
    assert len({r["id"] for r in recs}) == 250


def test_splits_are_disjoint_and_deterministic():
    train, evals = arithmetic_splits(70, 30, seed=3)
    check_answers(train + evals)
    assert len(train) == 70 and len(evals) == 30
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert len({r["prompt"] for r in train + evals}) == 100
    assert (train, evals) == arithmetic_splits(70, 30, seed=3)
    assert not {r["id"] for r in train} & {r["id"] for r in evals}


def test_splits_stay_disjoint_when_train_repeats():
    train, evals = arithmetic_splits(500, 20, seed=0)
    assert len(train) == 500 and len({r["prompt"] for r in evals}) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert len({r["prompt"] for r in train}) == 80  # every remaining problem is used


def test_a_fixed_split_seed_keeps_the_held_out_set_across_run_seeds():
    splits = [arithmetic_splits(200, 32, seed=s, split_seed=0) for s in (1, 2, 3)]
    held_out = [[r["prompt"] for r in evals] for _, evals in splits]
    assert held_out[0] == held_out[1] == held_out[2]
    for train, evals in splits:
        assert not {r["prompt"] for r in train} & set(held_out[0])
    # ... while the run seed still orders the training stream.
    assert [r["prompt"] for r in splits[0][0]] != [r["prompt"] for r in splits[1][0]]
    # Without a split seed the run seed picks the held-out set, as before.
    assert arithmetic_splits(200, 32, seed=1) != arithmetic_splits(200, 32, seed=2)
    assert arithmetic_splits(200, 32, seed=4, split_seed=None) == arithmetic_splits(200, 32, seed=4)


def test_eval_taking_the_whole_space_forces_overlap():
    train, evals = arithmetic_splits(5, 100, seed=0)
    assert len({r["prompt"] for r in evals}) == 100 and len(train) == 5


def test_bad_arguments():
    with pytest.raises(ConfigError, match=r"'/'.*valid ops: \['\+', '-', '\*'\]"):
        arithmetic_records(3, 0, ops=("+", "/"))
    with pytest.raises(ConfigError, match="min_operand <= max_operand"):
        arithmetic_records(3, 0, min_operand=5, max_operand=2)
    with pytest.raises(ConfigError, match="n_eval"):
        arithmetic_splits(3, -1, 0)


def test_train_eval_split():
    recs = [{"id": str(i)} for i in range(20)]
    train, evals = train_eval_split(recs, 0.25, seed=5)
    assert len(evals) == 5 and len(train) == 15
    assert sorted(r["id"] for r in train + evals) == sorted(r["id"] for r in recs)
    assert (train, evals) == train_eval_split(recs, 0.25, seed=5)
    assert evals != train_eval_split(recs, 0.25, seed=6)[1]
    # Order inside each part follows the input.
    assert [int(r["id"]) for r in train] == sorted(int(r["id"]) for r in train)
    assert train_eval_split(recs, 0.0, seed=0) == (recs, [])
    assert len(train_eval_split(recs[:3], 0.01, seed=0)[1]) == 1
    with pytest.raises(ConfigError, match="eval_fraction"):
        train_eval_split(recs, 1.0)
    with pytest.raises(ConfigError, match="leaves no training"):
        train_eval_split(recs[:1], 0.5)

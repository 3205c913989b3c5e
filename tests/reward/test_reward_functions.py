"""math_verify_reward and exact_match_reward, called in-process."""

from __future__ import annotations

import threading

import pytest

from areal_kernel.data import arithmetic_records
from areal_kernel.reward import exact_match_reward, math_verify_reward
from areal_kernel.testing.contracts import RewardContract

RIGHT = ["8", "The answer is 8.", "\\boxed{8}", "3 + 5 = 8", "$8$", " 8\n", "8.0", "So, 5 + 3 = 8. The answer is 8"]
WRONG = ["18", "The answer is 9.", "\\boxed{18}", "", "eight", "80", "8.5"]


@pytest.mark.parametrize("completion", RIGHT)
def test_math_right(completion):
    assert math_verify_reward(completion, "8") == 1.0


@pytest.mark.parametrize("completion", WRONG)
def test_math_wrong(completion):
    assert math_verify_reward(completion, "8") == 0.0


def test_math_symbolic_equivalence():
    assert math_verify_reward("The result is \\frac{1}{2}", "0.5") == 1.0
    assert math_verify_reward("$(x+1)^2$", "$x^2+2x+1$") == 1.0
    assert math_verify_reward("The answer is -2.", "-2") == 1.0


def test_math_rejects_echoing_the_question():
    # "3+5" is 8 symbolically, but on an arithmetic task it restates the question.
    assert math_verify_reward("3+5", "8") == 0.0
    assert math_verify_reward("3+5", "8", numeric_needs_number=False) == 1.0


def test_math_works_outside_the_main_thread():
    # math-verify's own signal-based timeouts would raise here; ours are disabled.
    out = []
    t = threading.Thread(target=lambda: out.append(math_verify_reward("\\boxed{8}", "8")))
    t.start()
    t.join()
    assert out == [1.0]


def test_arithmetic_answers_score_one():
    for r in arithmetic_records(30, seed=2, ops=("+", "-", "*")):
        assert math_verify_reward(f"The answer is {r['answer']}.", r["answer"]) == 1.0
        assert exact_match_reward(r["answer"], r["answer"]) == 1.0
        wrong = str(int(r["answer"]) + 1)
        assert math_verify_reward(wrong, r["answer"]) == 0.0
        assert exact_match_reward(wrong, r["answer"]) == 0.0


@pytest.mark.parametrize("completion", RIGHT[:3] + ["8 apples", "1 + 7 gives 8", "8.0"])
def test_exact_match_numeric_right(completion):
    assert exact_match_reward(completion, "8") == 1.0


@pytest.mark.parametrize("completion", ["18", "The answer is 9.", "8 or 9", "", "eight", "-8"])
def test_exact_match_numeric_wrong(completion):
    assert exact_match_reward(completion, "8") == 0.0


def test_exact_match_text_and_strict():
    assert exact_match_reward("  Paris. ", "paris") == 1.0
    assert exact_match_reward("The  capital is   PARIS", "the capital is paris") == 1.0
    assert exact_match_reward("Lyon", "Paris") == 0.0
    assert exact_match_reward("The answer is 1,000.", "1000") == 1.0
    assert exact_match_reward(" 8 ", "8", strict=True) == 1.0
    assert exact_match_reward("The answer is 8.", "8", strict=True) == 0.0
    assert exact_match_reward("paris", "Paris", strict=True) == 0.0


class TestMathRewardContract(RewardContract):
    """The plugin authors' reward suite on the built-in ``math`` reward."""

    @pytest.fixture
    def reward_target(self) -> str:
        return "areal_kernel.reward.math:math_verify_reward"

    @pytest.fixture
    def reward_cases(self) -> list[tuple[str, str, float]]:
        return [("The answer is 8.", "8", 1.0), ("\\boxed{18}", "8", 0.0), ("eight", "8", 0.0)]


class TestExactMatchRewardContract(RewardContract):
    """The plugin authors' reward suite on the built-in ``exact_match`` reward, with a setting."""

    @pytest.fixture
    def reward_target(self) -> str:
        return "areal_kernel.reward.exact_match:exact_match_reward"

    @pytest.fixture
    def reward_settings(self) -> dict:
        return {"strict": False}

    @pytest.fixture
    def reward_cases(self) -> list[tuple[str, str, float]]:
        return [("So 5 + 3 = 8", "8", 1.0), ("The answer is 9.", "8", 0.0)]

"""math_verify_reward and exact_match_reward, called in-process."""

from __future__ import annotations

import threading

import pytest

from areal_kernel.data import arithmetic_records
from areal_kernel.reward import char_share_reward, exact_match_reward, math_verify_reward
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


def test_char_share_is_the_share_of_allowed_characters():
    assert char_share_reward("ab12", "ignored") == 1.0
    assert char_share_reward("a b!", "") == 0.5
    assert char_share_reward("?? é", "") == 0.0  # non-ASCII letters do not count by default
    assert char_share_reward("", "") == 0.0
    assert char_share_reward("a1a1", "", chars="1") == 0.5


def test_char_share_settings_refuse_an_empty_set():
    from pydantic import ValidationError

    from areal_kernel.reward.settings import CharShareRewardSettings

    with pytest.raises(ValidationError, match="chars"):
        CharShareRewardSettings(chars="")


class TestCharShareRewardContract(RewardContract):
    """The plugin authors' reward suite on the built-in ``char_share`` reward, with a setting."""

    @pytest.fixture
    def reward_target(self) -> str:
        return "areal_kernel.reward.char_share:char_share_reward"

    @pytest.fixture
    def reward_settings(self) -> dict:
        return {"chars": "0123456789"}

    @pytest.fixture
    def reward_cases(self) -> list[tuple[str, str, float]]:
        return [("8", "8", 1.0), ("eight", "8", 0.0), ("8 a", "", 1 / 3)]


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


# The `math` reward reads the completion's final answer (docs/algorithms.md).
# Real completions of SmolLM2-135M-Instruct to the demo's questions (12 new
# tokens, greedy and sampled at 0.7), then a few written to the same rule.
# A stated answer scores 1, however it is phrased ...
STATED = [
    ("1. 5 + 3 = 8\n\n", "8"),
    ("3 + 7 = 10", "10"),
    ("The answer is 11.", "11"),
    ("3 + 0 = 3\n\nIn the context", "3"),  # cut off after the answer
    ("The answer would be 3.", "3"),
    ("3 + 1 is actually 4, which we do", "4"),
    ("8 + 7 is 15, where 1", "15"),  # the last number is not the answer
    ('"2 + 5 = 7."', "7"),
    ("7", "7"),
    ("The sum of 3 and 4 is 7.", "7"),
    ("Answer: $7$", "7"),
    ("**7**", "7"),
    ("To find the sum, add 3 and 4:\n3 + 4 = 7", "7"),
    ("3 plus 4 equals 7", "7"),
    ("The final answer is $\\boxed{7}$", "7"),
]
# ... and a completion that states no answer scores 0, whatever numbers it
# mentions (the last number of each is the right answer, which the earlier
# rule, "the last number in the text", scored 1).
UNSTATED = [
    ("To solve this puzzle, you simply add 3 to the", "3"),  # 3 + 0, cut off mid-sentence
    ("Here's a possible answer: 3 + 0 =", "3"),  # cut off before the answer ("3 + 0" restates the question)
    ("You have 3 apples and get 0 more, so you", "0"),
    ("Let's add 4 and 3 together. First, we", "3"),
    ("The answer is 7 apples, since", "7"),  # the number is inside prose
]


@pytest.mark.parametrize("completion,answer", STATED)
def test_math_stated_final_answers_score_one(completion, answer):
    assert math_verify_reward(completion, answer) == 1.0


@pytest.mark.parametrize("completion,answer", UNSTATED)
def test_math_completions_without_a_final_answer_score_zero(completion, answer):
    assert math_verify_reward(completion, answer) == 0.0


def test_math_question_restated_is_no_answer():
    from areal_kernel.reward.math import final_answer

    assert final_answer("What is 3+4? Let me think") == "3+4"  # math after "is", but the question's
    assert math_verify_reward("What is 3+4? Let me think", "7") == 0.0  # numeric_needs_number


def test_math_takes_the_last_stated_answer():
    # A corrected answer counts, not the first one; a wrong final answer scores 0.
    assert math_verify_reward("3 + 4 = 8. No wait, 3 + 4 = 7.", "7") == 1.0
    assert math_verify_reward("3 + 4 = 7. No wait, 3 + 4 = 8.", "7") == 0.0
    # The boxed answer wins over any later number.
    assert math_verify_reward("\\boxed{7} (checked with 3 + 4 = 7 and 2 + 5)", "7") == 1.0

import time

from areal_kernel.reward.char_share import char_share_reward
from areal_kernel.testing.probe_reward import probe_score

# How long slow_char_share_reward waits per call.
SLOW_REWARD_WAIT_S = 0.5


def text_hash_reward(completion: str, answer: str) -> float:
    """A value in [0, 1] that differs between most completions (the answer is ignored)."""
    return probe_score(completion)


def slow_char_share_reward(completion: str, answer: str) -> float:
    """``char_share`` with its default characters, ``SLOW_REWARD_WAIT_S`` after the call:
    a policy whose rollouts are slow for a reason the machine's load does not change."""
    time.sleep(SLOW_REWARD_WAIT_S)
    return char_share_reward(completion, answer)

"""Rewards: math-verify, exact-match and character-share scorers, and ``RewardPool``, which runs
any reward by import path in worker processes with a per-call timeout.
The scorers import sympy / math-verify only when called."""

from areal_kernel.reward.char_share import char_share_reward
from areal_kernel.reward.exact_match import exact_match_reward
from areal_kernel.reward.math import math_verify_reward
from areal_kernel.reward.pool import BUILTIN_REWARDS, RewardPool, RewardResult, resolve_reward_path

__all__ = [
    "BUILTIN_REWARDS",
    "RewardPool",
    "RewardResult",
    "char_share_reward",
    "exact_match_reward",
    "math_verify_reward",
    "resolve_reward_path",
]

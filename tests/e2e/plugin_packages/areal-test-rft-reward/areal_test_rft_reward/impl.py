from areal_kernel.testing.probe_reward import probe_score


def text_hash_reward(completion: str, answer: str) -> float:
    """A value in [0, 1] that differs between most completions (the answer is ignored)."""
    return probe_score(completion)

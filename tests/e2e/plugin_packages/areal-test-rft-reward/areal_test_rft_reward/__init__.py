"""Test-only rewards for end-to-end tests.

``text_hash``, for the RFT example's test: a tiny random model never solves
a sum, so the math reward would keep nothing; this one keeps about half of
any model's samples, and the test can recompute every score itself.

``slow_char_share``: the kernel's ``char_share`` after a fixed wait, for
``tests/e2e/test_multi_policy.py``'s policy with slow rollouts."""

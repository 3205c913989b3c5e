"""A reward for the RFT example's test: a tiny random model never solves a
sum, so the math reward would keep nothing; this one keeps about half of
any model's samples, and the test can recompute every score itself."""

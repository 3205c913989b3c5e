"""``areal_kernel.testing.noise``: a comparison across code paths passes within
its multiple of the measured floor and fails above it, saying where and by how
much; a floor of exactly zero falls back to a few ulps of the values."""

from __future__ import annotations

import math

import pytest
import torch

from areal_kernel.testing.noise import (
    DEFAULT_ULPS,
    assert_within_noise,
    max_difference,
    measure_noise_floor,
    sum_rounding,
)

REF = [[0.0, -3.25, -7.5], [0.0, -1.0]]


def _shift(rows, i, j, by):
    out = [list(r) for r in rows]
    out[i][j] += by
    return out


def test_ten_times_the_floor_fails_and_says_where():
    floor = measure_noise_floor("logprobs", REF, _shift(REF, 0, 1, 2e-5))
    assert floor.value == pytest.approx(2e-5, rel=1e-6)  # above the ulp bound, 4 x 2**-23 x 7.5 = 3.6e-6
    assert assert_within_noise(_shift(REF, 1, 1, -7e-5), REF, floor, 4.0).ratio == pytest.approx(3.5, rel=1e-6)
    with pytest.raises(AssertionError) as err:
        assert_within_noise(_shift(REF, 1, 1, 2e-4), REF, floor, 4.0)
    msg = str(err.value)
    for part in ("logprobs", "[1][1]", "0.0002", "10 x the noise floor 2e-05", "[0][1]", "allowed: 4 x floor = 8e-05"):
        assert part in msg, (part, msg)


def test_a_zero_floor_falls_back_to_ulps_of_the_values():
    floor = measure_noise_floor("lr", [1e-3, 5e-4], [1e-3, 5e-4], relative=True)
    assert floor.measured.value == 0.0
    # Relative below magnitude 1 is absolute: 4 ulps of float32 at 1e-3.
    assert floor.value == pytest.approx(DEFAULT_ULPS * 2.0**-23 * 1e-3)
    assert_within_noise([1e-3, 5e-4], [1e-3, 5e-4], floor, 1.0)
    with pytest.raises(AssertionError, match="lr"):
        assert_within_noise([1e-3 * (1 + 1e-4), 5e-4], [1e-3, 5e-4], floor, 4.0)
    # Exact zeros stay exact: nothing to scale the ulps by.
    zero = measure_noise_floor("clip_frac", [0.0, 0.0], [0.0, 0.0])
    assert zero.value == 0.0
    with pytest.raises(AssertionError):
        assert_within_noise([0.0, 1e-12], [0.0, 0.0], zero, 4.0)


def test_relative_comparisons_divide_by_the_magnitude_above_one():
    d = max_difference([100.0, 0.5], [100.02, 0.5001], relative=True)
    assert d.value == pytest.approx(2e-4, rel=1e-3) and d.where == "[0]"


def test_tensors_and_mappings_name_the_element():
    ref = {"a.weight": torch.zeros(2, 3), "b.bias": torch.ones(4)}
    alt = {"a.weight": torch.full((2, 3), 1e-6), "b.bias": torch.ones(4)}
    got = {"a.weight": torch.zeros(2, 3), "b.bias": torch.ones(4)}
    got["a.weight"][1, 2] = 1e-5
    floor = measure_noise_floor("weights", ref, alt)
    with pytest.raises(AssertionError, match=r"\['a.weight'\]\[1, 2\]"):
        assert_within_noise(got, ref, floor, 4.0)
    with pytest.raises(AssertionError, match="different keys"):
        assert_within_noise({"a.weight": torch.zeros(2, 3)}, ref, floor, 4.0)
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_within_noise({**got, "b.bias": torch.ones(5)}, ref, floor, 4.0)


def test_nan_fails_and_a_multiple_below_one_is_refused():
    floor = measure_noise_floor("loss", [1.0], [1.0 + 1e-7])
    with pytest.raises(AssertionError, match="inf"):
        assert_within_noise([math.nan], [1.0], floor, 4.0)
    with pytest.raises(ValueError, match="multiple"):
        assert_within_noise([1.0], [1.0], floor, 0.5)


def test_a_derived_bound_stands_in_where_the_alternative_cannot_show_the_rounding():
    # Two runs that reduce a 49152-term sum in the same order agree exactly;
    # the rounding of that sum (sqrt(n) half-ulps) is still there.
    bound = sum_rounding(49152)
    assert bound == pytest.approx(math.sqrt(49152) * 2.0**-24)
    floor = measure_noise_floor("entropy", [5.26], [5.26], relative=True, lower_bound=bound)
    assert floor.measured.value == 0.0 and floor.value == bound
    assert_within_noise([5.26 * (1 + 3 * bound)], [5.26], floor, 4.0)
    with pytest.raises(AssertionError, match="derived rounding bound"):
        assert_within_noise([5.26 * (1 + 10 * bound)], [5.26], floor, 4.0)

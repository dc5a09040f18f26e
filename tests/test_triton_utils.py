"""The launch toolkit's host-side shape helpers against Triton's own, which they replace in launch paths."""

import pytest

triton = pytest.importorskip("triton")

from modeling.ops.triton_utils import cdiv, next_power_of_2  # noqa: E402 (needs triton)


def test_cdiv_is_tritons():
    for a in range(-3, 300):
        for b in (1, 2, 3, 7, 16, 64, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_is_tritons():
    for n in [*range(-4, 1100), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n

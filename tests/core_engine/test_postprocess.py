"""finalize(): Matryoshka truncation before normalization, and each wire encoding's dtype, shape and values."""

from __future__ import annotations

import numpy as np
import pytest

from core_engine.postprocess import finalize


@pytest.fixture
def pooled() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 12)).astype(np.float32) * 3
    x[3] = 0.0  # an all-zero vector must not produce NaN
    return x


def test_full_float32_unnormalized_is_the_input(pooled: np.ndarray) -> None:
    out = finalize(pooled, dimensions=0, normalize=False, encoding="float32", native_int8=False)
    assert out.dtype == np.dtype("<f4") and out.shape == (5, 12)
    np.testing.assert_array_equal(out, pooled)
    assert out is not pooled


def test_matryoshka_truncates_before_normalizing(pooled: np.ndarray) -> None:
    out = finalize(pooled, dimensions=4, normalize=True, encoding="float32", native_int8=False)
    expected = pooled[:, :4] / np.maximum(np.linalg.norm(pooled[:, :4], axis=1, keepdims=True), 1e-12)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    norms = np.linalg.norm(out, axis=1)
    np.testing.assert_allclose(norms[[0, 1, 2, 4]], 1.0, rtol=1e-6)
    assert norms[3] == 0.0 and np.isfinite(out).all()
    # Normalizing first and truncating after would give vectors shorter than 1.
    wrong = (pooled / np.linalg.norm(pooled, axis=1, keepdims=True).clip(1e-12))[:, :4]
    assert not np.allclose(np.linalg.norm(wrong[[0, 1, 2, 4]], axis=1), 1.0)


def test_float16_is_little_endian_half(pooled: np.ndarray) -> None:
    out = finalize(pooled, dimensions=8, normalize=True, encoding="float16", native_int8=False)
    assert out.dtype == np.dtype("<f2") and out.shape == (5, 8)
    ref = finalize(pooled, dimensions=8, normalize=True, encoding="float32", native_int8=False)
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=1e-3)
    assert out.tobytes() == ref.astype("<f2").tobytes()


def test_int8_scales_each_vector_by_its_peak(pooled: np.ndarray) -> None:
    out = finalize(pooled, dimensions=0, normalize=False, encoding="int8", native_int8=False)
    assert out.dtype == np.int8 and out.shape == (5, 12)
    for row in (0, 1, 2, 4):
        x = pooled[row]
        np.testing.assert_array_equal(out[row], np.rint(127 * x / np.abs(x).max()).astype(np.int8))
        assert np.abs(out[row]).max() == 127
    assert not out[3].any()
    # Scale-free: normalizing first changes nothing.
    again = finalize(pooled, dimensions=0, normalize=True, encoding="int8", native_int8=False)
    np.testing.assert_array_equal(again, out)


def test_native_int8_is_round_127_tanh() -> None:
    x = np.array([[0.0, 0.5, -0.5, 3.0, -10.0, 0.003937]], dtype=np.float32)
    out = finalize(x, dimensions=0, normalize=False, encoding="int8", native_int8=True)
    assert out.dtype == np.int8
    expected = [0, round(127 * np.tanh(0.5)), -round(127 * np.tanh(0.5)), round(127 * np.tanh(3.0)), -127, 0]
    assert out[0].tolist() == expected == [0, 59, -59, 126, -127, 0]


def test_binary_packs_sign_bits_per_row(pooled: np.ndarray) -> None:
    out = finalize(pooled, dimensions=10, normalize=True, encoding="binary", native_int8=False)
    assert out.dtype == np.uint8 and out.shape == (5, 2)
    bits = np.unpackbits(out, axis=1)[:, :10]
    np.testing.assert_array_equal(bits, (pooled[:, :10] > 0).astype(np.uint8))
    assert not bits[3].any() and not np.unpackbits(out, axis=1)[:, 10:].any()
    x = np.array([[1, -1, 1, 1, -1, -1, -1, 1, 1]], dtype=np.float32)
    assert finalize(x, dimensions=0, normalize=False, encoding="binary", native_int8=False).tolist() == [[0b10110001, 0b10000000]]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dimensions": 13}, ValueError, "dimensions=13"),
        ({"dimensions": -1}, ValueError, "dimensions=-1"),
        ({"dimensions": 2.0}, TypeError, "dimensions"),
        ({"encoding": "int4"}, ValueError, "encoding 'int4'"),
        ({"encoding": "FLOAT32"}, ValueError, "encoding"),
    ],
)
def test_bad_arguments_name_the_argument(pooled: np.ndarray, kwargs: dict, error: type, match: str) -> None:
    args = {"dimensions": 0, "normalize": True, "encoding": "float32", "native_int8": False, **kwargs}
    with pytest.raises(error, match=match):
        finalize(pooled, **args)


def test_one_dimensional_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="2-D"):
        finalize(np.ones(4, np.float32), dimensions=0, normalize=False, encoding="float32", native_int8=False)

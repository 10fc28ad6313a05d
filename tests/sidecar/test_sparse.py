"""Sparse lexical vectors: BM25 saturation by hand, sorted unique indices, special tokens left out."""

from __future__ import annotations

import numpy as np

from sidecar.sparse import AVGDL, B, K1, SparseParams, sparse_vector


def test_values_follow_bm25_saturation_by_hand():
    ids = [7, 5, 7, 9, 7, 5]
    indices, values = sparse_vector(ids)
    assert indices.tolist() == [5, 7, 9]
    assert indices.dtype == np.uint32 and values.dtype == np.float32
    n = len(ids)
    norm = K1 * (1 - B + B * n / AVGDL)
    expected = [tf * (K1 + 1) / (tf + norm) for tf in (2, 3, 1)]
    np.testing.assert_allclose(values, expected, rtol=1e-6)


def test_special_tokens_are_excluded_and_do_not_count_in_length():
    with_special = sparse_vector([101, 7, 7, 102], special_ids={101, 102})
    without = sparse_vector([7, 7])
    assert with_special[0].tolist() == [7]
    np.testing.assert_array_equal(with_special[1], without[1])


def test_saturation_grows_with_tf_but_stays_below_k1_plus_1():
    values = [sparse_vector([3] * tf)[1][0] for tf in (1, 2, 5, 50)]
    assert values == sorted(values)
    assert values[-1] < K1 + 1


def test_longer_documents_weigh_each_term_less():
    short = sparse_vector([1, 2])[1][0]
    long = sparse_vector([1] + list(range(100, 1100)))[1][0]
    assert long < short


def test_params_and_empty_input():
    indices, values = sparse_vector([101, 102], special_ids=[101, 102])
    assert indices.size == 0 and values.size == 0
    flat = sparse_vector([4, 4, 4], params=SparseParams(k1=0.0))
    np.testing.assert_allclose(flat[1], [1.0])  # k1 = 0: binary presence


def test_deterministic():
    ids = list(np.random.default_rng(0).integers(0, 30000, 500))
    a, b = sparse_vector(ids), sparse_vector(list(reversed(ids)))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])

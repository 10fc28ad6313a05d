"""The engine's packer (core_engine.batch): layout, positions, bucket padding, both ways of filling, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core_engine.batch import SLICED_PACK_SEQS, model_inputs, pack, pack_into, packed_size, regions
from core_engine.graphs import BucketConfig, GraphKey, key_for


def test_exact_key_lays_sequences_end_to_end() -> None:
    buf, key = pack([[7, 8, 9], [5, 6], [4]])
    assert key == GraphKey(tokens=6, slots=3, max_seqlen=3)
    assert buf.dtype == torch.int64 and buf.numel() == packed_size(6, 3) == 3 * 6 + 2 * 3 + 1
    ids, pos, sid, cu, lens = (r.tolist() for r in regions(buf, key))
    assert ids == [7, 8, 9, 5, 6, 4]
    assert pos == [0, 1, 2, 0, 1, 0]  # 0-based within each sequence
    assert sid == [0, 0, 0, 1, 1, 2]
    assert cu == [0, 3, 5, 6]
    assert lens == [3, 2, 1]


def test_bucket_padding_forms_the_last_slot_after_empty_ones() -> None:
    lengths = [3, 5]
    key = key_for(lengths, BucketConfig())
    assert key == GraphKey(tokens=64, slots=4, max_seqlen=64)
    buf, got = pack([[101, 7, 102], [101, 8, 9, 10, 102]], key)
    assert got == key
    ids, pos, sid, cu, lens = (r.tolist() for r in regions(buf, key))
    assert cu == [0, 3, 8, 8, 64]  # slot 2 empty, slot 3 = 56 padding tokens
    assert lens == [3, 5, 0, 56]
    assert ids[8:] == [0] * 56 and pos[8:] == list(range(56)) and sid[8:] == [3] * 56
    assert pos[:8] == [0, 1, 2, 0, 1, 2, 3, 4]


def test_zero_length_sequences_are_empty_slots() -> None:
    buf, key = pack([[1, 2], [], [3]])
    assert regions(buf, key)[3].tolist() == [0, 2, 2, 3]
    assert regions(buf, key)[4].tolist() == [2, 0, 1]


def test_empty_input_and_keys_too_small_are_refused() -> None:
    with pytest.raises(ValueError, match="sequences: empty batch"):
        pack([])
    with pytest.raises(ValueError, match="too small for 2 sequences of 5 tokens"):
        pack([[1, 2, 3], [4, 5]], GraphKey(tokens=4, slots=4, max_seqlen=4))
    with pytest.raises(ValueError, match="too small for 2 sequences"):
        pack([[1, 2, 3], [4, 5]], GraphKey(tokens=8, slots=1, max_seqlen=8))
    with pytest.raises(ValueError, match="pads 3 tokens but has no slot to spare"):
        pack([[1, 2, 3], [4, 5]], GraphKey(tokens=8, slots=2, max_seqlen=8))


def test_model_inputs_are_views_with_the_metadata_of_the_layout() -> None:
    key = GraphKey(tokens=16, slots=4, max_seqlen=16)
    buf, _ = pack([[7, 8, 9], [5, 6]], key)
    input_ids, positions, meta = model_inputs(buf, key, causal=True)
    assert input_ids.data_ptr() == buf.data_ptr() and input_ids.shape == (16,)
    assert positions.tolist()[:5] == [0, 1, 2, 0, 1]
    assert meta.cu_seqlens.dtype == torch.int32 and meta.cu_seqlens.tolist() == [0, 3, 5, 5, 16]
    assert meta.cu_seqlens_cpu.tolist() == [0, 3, 5, 5, 16]  # taken from the buffer on the CPU
    assert meta.seq_ids.tolist() == [0, 0, 0, 1, 1] + [3] * 11
    assert meta.seq_lens.tolist() == [3, 2, 0, 11]
    assert meta.max_seqlen == 16 and meta.causal and meta.num_seqs == 4
    given = torch.tensor([0, 3, 5, 5, 16], dtype=torch.int32)
    assert model_inputs(buf, key, causal=False, cu_seqlens_cpu=given)[2].cu_seqlens_cpu is given


@pytest.mark.parametrize("padded", [False, True])
def test_both_ways_of_packing_write_the_same_buffer(padded: bool) -> None:
    """One sequence at a time (queries) and whole-array (bulk) fill identical buffers, padding or not."""
    rng = np.random.default_rng(7)
    buckets = BucketConfig()
    for count in (1, SLICED_PACK_SEQS, 3, 5, 17, 64):
        seqs = [rng.integers(1, 30000, size=int(n)).tolist() for n in rng.integers(1, 300, size=count)]
        lengths = [len(s) for s in seqs]
        total = sum(lengths)
        key = key_for(lengths, buckets) if padded else GraphKey(total, count, max(lengths))
        bufs = [np.full(packed_size(key.tokens, key.slots), -1, dtype=np.int64) for _ in range(2)]
        ramp = np.arange(key.tokens // 2, dtype=np.int64)  # too short for some: they make their own range
        cus = [pack_into(buf, key, seqs, lengths, total, ramp, sliced=way) for buf, way in zip(bufs, (True, False))]
        np.testing.assert_array_equal(bufs[0], bufs[1])
        assert (bufs[0] >= 0).all()  # every entry written
        np.testing.assert_array_equal(cus[0], cus[1])
        assert cus[0][count] == total and cus[0][-1] == key.tokens
        # pack() is the same packer: it writes the same buffer.
        np.testing.assert_array_equal(pack(seqs, key)[0].numpy(), bufs[0])


@pytest.mark.parametrize("padded", [False, True])
def test_int32_arrays_pack_like_the_lists_they_hold(padded: bool) -> None:
    """A worker process's ids (read-only int32 views into one buffer), alone or among lists, pack
    the buffer their lists do, both ways."""
    rng = np.random.default_rng(11)
    buckets = BucketConfig()
    for count in (1, SLICED_PACK_SEQS, 3, 17, 64):
        lists = [rng.integers(0, 250000, size=int(n)).tolist() for n in rng.integers(1, 300, size=count)]
        ends = np.cumsum([len(s) for s in lists]).tolist()
        flat = np.frombuffer(np.concatenate([np.asarray(s, dtype=np.int32) for s in lists]).tobytes(), np.int32)
        views = [flat[start:end] for start, end in zip([0, *ends], ends)]
        mixed = [v if i % 2 else s for i, (s, v) in enumerate(zip(lists, views))]
        lengths = [len(s) for s in lists]
        total = sum(lengths)
        key = key_for(lengths, buckets) if padded else GraphKey(total, count, max(lengths))
        ramp = np.arange(key.tokens, dtype=np.int64)
        for sliced in (True, False):
            bufs = [np.full(packed_size(key.tokens, key.slots), -1, dtype=np.int64) for _ in range(3)]
            for buf, seqs in zip(bufs, (lists, views, mixed)):
                pack_into(buf, key, seqs, lengths, total, ramp, sliced=sliced)
            np.testing.assert_array_equal(bufs[1], bufs[0])
            np.testing.assert_array_equal(bufs[2], bufs[0])
            assert (bufs[0] >= 0).all()


def test_zero_length_int32_arrays_are_empty_slots() -> None:
    empty = np.zeros(0, dtype=np.int32)
    seqs = [np.array([101, 7, 102], dtype=np.int32), empty, [101, 102], empty]
    for sliced in (True, False):
        buf = np.full(packed_size(5, 4), -1, dtype=np.int64)
        cu = pack_into(buf, GraphKey(5, 4, 3), seqs, [3, 0, 2, 0], 5, np.arange(5, dtype=np.int64), sliced=sliced)
        ids, pos, _, _, lens = regions(buf, GraphKey(5, 4, 3))
        assert ids.tolist() == [101, 7, 102, 101, 102] and pos.tolist() == [0, 1, 2, 0, 1]
        assert cu.tolist() == [0, 3, 3, 5, 5] and lens.tolist() == [3, 0, 2, 0]

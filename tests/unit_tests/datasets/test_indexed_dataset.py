"""Megatron .bin/.idx format: exact bytes, round trips for every dtype, and corrupt files."""

import os
import struct

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    dtype_code,
    optimal_dtype,
)


def write_dataset(prefix, documents, dtype):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in documents:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPE_CODES[code]
    rng = np.random.RandomState(code)
    docs = [rng.randint(0, 100, size=n).astype(dtype) for n in (5, 1, 17, 3)]
    prefix = write_dataset(str(tmp_path / f"d{code}"), docs, dtype)
    with open(prefix + ".idx", "rb") as f:
        assert f.read(18)[-1] == code  # dtype byte after magic (9) + version (8)
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype
    assert len(ds) == 4 and ds.num_documents == 4
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
        assert ds[i].dtype == dtype
    np.testing.assert_array_equal(ds.get(2, offset=3, length=4), docs[2][3:7])
    np.testing.assert_array_equal(ds.get(2, offset=15), docs[2][15:])
    np.testing.assert_array_equal(ds[-1], docs[-1])
    assert [a.tolist() for a in ds[1:3]] == [docs[1].tolist(), docs[2].tolist()]
    assert os.path.getsize(prefix + ".bin") == 26 * dtype.itemsize


def test_exact_header_and_arrays(tmp_path):
    prefix = write_dataset(str(tmp_path / "tiny"), [[1, 2, 3], [7], [4, 5]], np.uint16)
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)
        + struct.pack("<Q", 3)
        + struct.pack("<Q", 4)
        + struct.pack("<3i", 3, 1, 2)
        + struct.pack("<3q", 0, 6, 8)
        + struct.pack("<4q", 0, 1, 2, 3)
    )
    with open(prefix + ".idx", "rb") as f:
        assert f.read() == expected
    with open(prefix + ".bin", "rb") as f:
        assert f.read() == struct.pack("<6H", 1, 2, 3, 7, 4, 5)


def test_multi_sequence_documents_and_empty_document(tmp_path):
    prefix = str(tmp_path / "multi")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    builder.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
    builder.add_document([])
    builder.add_document([9])
    builder.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert ds.sequence_lengths.tolist() == [2, 3, 1]
    assert ds.document_indices.tolist() == [0, 2, 2, 3]
    assert ds.sequence_pointers.tolist() == [0, 8, 20]
    assert ds[1].tolist() == [3, 4, 5]


def test_empty_dataset_opens(tmp_path):
    prefix = write_dataset(str(tmp_path / "empty"), [], np.uint16)
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0


def test_builder_is_atomic(tmp_path):
    prefix = str(tmp_path / "atomic")
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
            builder.add_document([1, 2, 3])
            assert not os.path.exists(prefix + ".bin")  # only a temporary file so far
            raise RuntimeError("crash mid-way")
    assert os.listdir(tmp_path) == []  # nothing at the final paths, temporary file removed


def test_builder_rejects_ids_that_do_not_fit(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        builder.add_document([1, 70000])
    builder.abort()


def test_optimal_dtype_and_codes():
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32
    assert dtype_code(np.uint16) == 8 and dtype_code(np.int32) == 4 and dtype_code(np.float32) == 7
    with pytest.raises(ValueError):
        dtype_code(np.uint32)


@pytest.fixture
def good(tmp_path):
    return write_dataset(str(tmp_path / "good"), [[1, 2, 3], [4, 5]], np.uint16)


def test_missing_files(good):
    os.remove(good + ".bin")
    with pytest.raises(ValueError, match=r"good\.bin does not exist"):
        IndexedDataset(good)
    with pytest.raises(ValueError, match=r"nope\.idx does not exist"):
        IndexedDataset(os.path.join(os.path.dirname(good), "nope"))


def test_corrupt_magic(good):
    with open(good + ".idx", "r+b") as f:
        f.write(b"XXIDIDX\x00\x00")
    with pytest.raises(ValueError, match=r"good\.idx is not a Megatron index file"):
        IndexedDataset(good)


def test_bad_version_and_dtype_code(good):
    with open(good + ".idx", "r+b") as f:
        f.seek(9)
        f.write(struct.pack("<Q", 2))
    with pytest.raises(ValueError, match="version 2"):
        IndexedDataset(good)
    with open(good + ".idx", "r+b") as f:
        f.seek(9)
        f.write(struct.pack("<QB", 1, 9))
    with pytest.raises(ValueError, match="dtype code 9"):
        IndexedDataset(good)


def test_truncated_idx(good):
    size = os.path.getsize(good + ".idx")
    with open(good + ".idx", "r+b") as f:
        f.truncate(size - 8)
    with pytest.raises(ValueError, match=r"good\.idx is .* truncated"):
        IndexedDataset(good)
    with open(good + ".idx", "r+b") as f:
        f.truncate(20)  # shorter than the header
    with pytest.raises(ValueError, match="not a Megatron index file"):
        IndexedDataset(good)


def test_truncated_bin(good):
    with open(good + ".bin", "r+b") as f:
        f.truncate(6)
    with pytest.raises(ValueError, match=r"good\.bin is 6 bytes .* truncated"):
        IndexedDataset(good)


def test_pickle_reopens_by_path(good):
    import pickle

    ds = pickle.loads(pickle.dumps(IndexedDataset(good)))
    assert ds[1].tolist() == [4, 5]


def _header(prefix):
    with open(prefix + ".idx", "rb") as f:
        return struct.unpack("<9sQBQQ", f.read(34))


def test_dtype_code_that_does_not_match_the_bin_is_named(good):
    # uint16 data (2 bytes per token) with an index that claims int32 (code 4).
    with open(good + ".idx", "r+b") as f:
        f.seek(17)
        f.write(bytes([4]))
    with pytest.raises(ValueError, match=r"good\.bin is 10 bytes .*5 tokens of int32 .*holds 2 bytes per token"):
        IndexedDataset(good)


def test_corrupt_pointers_and_lengths_are_found_at_open(good):
    _, _, _, n, _ = _header(good)
    lengths_at, pointers_at = 34, 34 + 4 * n
    original = open(good + ".idx", "rb").read()
    with open(good + ".idx", "r+b") as f:
        f.seek(pointers_at + 8)  # sequence 1's pointer
        f.write(struct.pack("<q", 2))
    with pytest.raises(ValueError, match=r"good\.idx is corrupt: sequence 1 starts at byte 2 .*at byte 6"):
        IndexedDataset(good)
    open(good + ".idx", "wb").write(original)
    with open(good + ".idx", "r+b") as f:
        f.seek(lengths_at)
        f.write(struct.pack("<i", -3))
    with pytest.raises(ValueError, match=r"good\.idx is corrupt: sequence 0 has negative length -3"):
        IndexedDataset(good)
    open(good + ".idx", "wb").write(original)
    with open(good + ".idx", "r+b") as f:
        f.seek(lengths_at + 4)
        f.write(struct.pack("<i", 7))  # longer than the .bin holds
    with pytest.raises(ValueError, match=r"good\.bin is 10 bytes .* truncated"):
        IndexedDataset(good)
    with open(good + ".bin", "ab") as f:
        f.write(b"\0" * 10)  # now the .bin matches the lengths again
    assert IndexedDataset(good)[1].shape == (7,)


def test_validation_is_vectorised_over_chunks(tmp_path, monkeypatch):
    import megatron.core.datasets.indexed_dataset as module

    monkeypatch.setattr(module, "_CHECK_CHUNK", 3)  # several chunks for 8 sequences
    prefix = write_dataset(str(tmp_path / "d"), [[i] * (i + 1) for i in range(8)], np.int32)
    assert IndexedDataset(prefix)[7].tolist() == [7] * 8
    _, _, _, n, _ = _header(prefix)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(34 + 4 * n + 8 * 6)  # sequence 6's pointer, in the third chunk
        f.write(struct.pack("<q", 0))
    with pytest.raises(ValueError, match="sequence 6 starts at byte 0"):
        IndexedDataset(prefix)


def test_fingerprint_follows_the_files(good):
    before = IndexedDataset(good).fingerprint()
    write_dataset(good, [[1, 2], [3, 4, 5]], np.uint16)  # same sizes, other lengths
    after = IndexedDataset(good).fingerprint()
    assert before["idx_size"] == after["idx_size"] and before["bin_size"] == after["bin_size"]
    assert before["index_md5"] != after["index_md5"]

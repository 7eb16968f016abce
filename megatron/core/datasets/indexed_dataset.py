"""Megatron's indexed dataset: token ids in ``PREFIX.bin``, their index in ``PREFIX.idx``.

Byte layout of ``.idx`` (all little-endian), compatible with upstream Megatron-LM files::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code of the .bin (see DTYPE_CODES)
    u64       S = number of sequences
    u64       D = number of document indices (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence byte offsets into .bin
    int64[D]  document indices: 0, then the sequence index that ends each document
    (int8[S]  sequence modes, only in multimodal files; ignored here)

``.bin`` is the token ids of all sequences, concatenated, in the .idx dtype.

Unusual here: the builder writes both files under temporary names and renames them into
place (.bin first, then .idx) only when ``finalize`` succeeds, so an interrupted
preprocessing run never leaves a half-written file at the final path. The reader checks
the header and every size before trusting a byte, and names the file in each error: at
open it validates, vectorised and in chunks, that lengths are non-negative, that the
sequences tile the ``.bin`` back to back in the header's dtype (which catches a dtype
code that does not match the ``.bin``) and that document indices are ordered.
``fingerprint()`` (sizes, mtimes, a digest of the lengths) keys the index caches.
"""

import hashlib
import os
import struct
from collections.abc import Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
_CHECK_CHUNK = 1 << 22  # sequences per vectorised validation step (bounds temporary memory)

DTYPE_CODES = {
    1: np.dtype("<u1"),
    2: np.dtype("<i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}


def dtype_code(dtype) -> int:
    """The .idx code of a numpy dtype (raises ValueError for dtypes the format lacks)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    for code, candidate in DTYPE_CODES.items():
        if candidate == dtype:
            return code
    raise ValueError(
        f"dtype {dtype} cannot be stored in an indexed dataset; use one of {sorted(map(str, DTYPE_CODES.values()))}."
    )


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Token dtype for a vocabulary: uint16 when it has fewer than 65,500 ids, else int32 (as Megatron)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def _tmp_path(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


def _fsync_replace(tmp: str, final: str) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


class IndexedDatasetBuilder:
    """Writes a ``.bin``/``.idx`` pair one document at a time.

    Args:
        bin_path: Final path of the ``.bin`` file; it is written to a temporary file next to it.
        dtype: Token dtype (see ``optimal_dtype``).

    Example::

        builder = IndexedDatasetBuilder("data/corpus_text_document.bin", np.uint16)
        for ids in documents:
            builder.add_document(ids)
        builder.finalize("data/corpus_text_document.idx")
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._code = dtype_code(self.dtype)
        self.bin_path = bin_path
        self._tmp_bin = _tmp_path(bin_path)
        self._file = open(self._tmp_bin, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, tokens, lengths: Sequence[int] | None = None) -> None:
        """Appends one document.

        Args:
            tokens: Token ids (list, numpy array or CPU tensor).
            lengths: Split the document into sequences of these lengths (they must sum to
                ``len(tokens)``). Default: one sequence, or none for an empty document.
        """
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"add_document takes a 1-D sequence of token ids, got shape {array.shape}.")
        if array.size and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            low, high = array.min(), array.max()
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids in [{low}, {high}] do not fit the dataset dtype {self.dtype}; "
                    "use a wider dtype (int32 for vocabularies of 65,500 ids or more)."
                )
        if lengths is None:
            lengths = [array.size] if array.size else []
        if sum(lengths) != array.size:
            raise ValueError(
                f"sequence lengths {list(lengths)} sum to {sum(lengths)}, not the {array.size} tokens given."
            )
        self._file.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path: str) -> None:
        """Writes the index and moves both files to their final paths."""
        self._file.close()
        lengths = np.asarray(self.sequence_lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype("<i8") * self.dtype.itemsize, out=pointers[1:])
        documents = np.asarray(self.document_indices, dtype="<i8")
        tmp_idx = _tmp_path(idx_path)
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        _fsync_replace(self._tmp_bin, self.bin_path)
        _fsync_replace(tmp_idx, idx_path)

    def abort(self) -> None:
        """Closes and deletes the temporary file (call on failure)."""
        self._file.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._file.closed:
            # Left without finalize (or with an error): nothing reaches the final paths.
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx``.

    Args:
        path_prefix: Path without the ``.bin``/``.idx`` suffix.

    Attributes:
        sequence_lengths: int32 [S], tokens per sequence.
        sequence_pointers: int64 [S], byte offset of each sequence in ``.bin``.
        document_indices: int64 [D], 0 then the end sequence index of each document.
        dtype: Token dtype.

    Raises:
        ValueError: A file is missing, has a bad magic, version or dtype code, or its size
            does not match the counts in the header.
    """

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        self._open()

    def _open(self, validate: bool = True) -> None:
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"indexed dataset file {path} does not exist (data prefix {self.path_prefix!r}).")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER.size)
        if len(header) < _HEADER.size or not header.startswith(MAGIC):
            raise ValueError(f"{idx_path} is not a Megatron index file (bad magic {header[:9]!r}, expected {MAGIC!r}).")
        _, version, code, num_sequences, num_documents = _HEADER.unpack(header)
        if version != VERSION:
            raise ValueError(f"{idx_path} has index version {version}; only version {VERSION} is supported.")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path} has unknown dtype code {code}; known codes are {sorted(DTYPE_CODES)}.")
        self.dtype = DTYPE_CODES[code]
        expected = _HEADER.size + num_sequences * (4 + 8) + num_documents * 8
        # Multimodal files append one int8 mode per sequence; we read past it.
        if idx_size not in (expected, expected + num_sequences):
            raise ValueError(
                f"{idx_path} is {idx_size} bytes but its header ({num_sequences} sequences, {num_documents} "
                f"document indices) needs {expected}: the file is truncated or corrupt; regenerate it."
            )
        self._idx_map = np.memmap(idx_path, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx_map, dtype="<i4", count=num_sequences, offset=offset)
        offset += 4 * num_sequences
        self.sequence_pointers = np.frombuffer(self._idx_map, dtype="<i8", count=num_sequences, offset=offset)
        offset += 8 * num_sequences
        self.document_indices = np.frombuffer(self._idx_map, dtype="<i8", count=num_documents, offset=offset)
        if num_documents == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != num_sequences:
            raise ValueError(
                f"{idx_path}: document indices must start at 0 and end at the sequence count {num_sequences}."
            )

        bin_size = os.path.getsize(bin_path)
        if validate:
            self._validate(idx_path, bin_path, bin_size)
        # numpy cannot memory-map an empty file.
        self._bin_map = np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_size else np.empty(0, dtype=np.uint8)

    def _validate(self, idx_path: str, bin_path: str, bin_size: int) -> None:
        """Checks lengths, pointers and document indices against each other and the .bin."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        itemsize = self.dtype.itemsize
        n = len(lengths)
        tokens = int(lengths.sum(dtype=np.int64))
        # Written with another dtype: the .bin size and the last pointer agree on another token size.
        other = [
            k
            for k in (1, 2, 4, 8)
            if k != itemsize and n and bin_size == tokens * k == int(pointers[-1]) + int(lengths[-1]) * k
        ]
        if other:
            raise ValueError(
                f"{bin_path} is {bin_size} bytes but {idx_path} describes {tokens} tokens of {self.dtype} "
                f"({itemsize} bytes each): the .bin holds {other[0]} bytes per token, so the two files were "
                "written with different dtypes. Regenerate the dataset (tools/preprocess_data.py)."
            )
        expected_start = 0  # byte offset where the next sequence must start
        for lo in range(0, n, _CHECK_CHUNK):
            hi = min(n, lo + _CHECK_CHUNK)
            chunk_len = lengths[lo:hi].astype(np.int64)
            if (chunk_len < 0).any():
                bad = lo + int(np.argmax(chunk_len < 0))
                raise ValueError(f"{idx_path} is corrupt: sequence {bad} has negative length {int(lengths[bad])}.")
            ends = expected_start + np.cumsum(chunk_len * itemsize)
            starts = np.empty_like(ends)
            starts[0] = expected_start
            starts[1:] = ends[:-1]
            wrong = starts != pointers[lo:hi]
            if wrong.any():
                bad = lo + int(np.argmax(wrong))
                raise ValueError(
                    f"{idx_path} is corrupt: sequence {bad} starts at byte {int(pointers[bad])} of {bin_path}, but "
                    f"the lengths before it place it at byte {int(starts[bad - lo])}; regenerate the dataset."
                )
            expected_start = int(ends[-1])
        if bin_size != expected_start:
            what = "truncated" if bin_size < expected_start else "longer than its index"
            raise ValueError(
                f"{bin_path} is {bin_size} bytes but {idx_path} describes {tokens} tokens of {self.dtype} = "
                f"{expected_start} bytes: the .bin is {what}. Regenerate the dataset (tools/preprocess_data.py)."
            )
        if len(docs) > 1:
            steps = np.diff(docs)
            if (steps < 0).any() or docs[-1] > n:
                raise ValueError(f"{idx_path} is corrupt: its document indices are not ordered within [0, {n}].")

    def fingerprint(self) -> dict:
        """What the dataset's index caches depend on: file sizes, mtimes, a digest of the lengths."""
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        idx_stat, bin_stat = os.stat(idx_path), os.stat(bin_path)
        digest = hashlib.md5(np.ascontiguousarray(self.sequence_lengths).data).hexdigest()
        digest = hashlib.md5((digest + hashlib.md5(self.document_indices.data).hexdigest()).encode()).hexdigest()
        return {
            "idx_size": idx_stat.st_size,
            "idx_mtime_ns": idx_stat.st_mtime_ns,
            "bin_size": bin_stat.st_size,
            "bin_mtime_ns": bin_stat.st_mtime_ns,
            "index_md5": digest,
        }

    def __getstate__(self):
        # Memory maps are reopened by path in DataLoader workers instead of being pickled.
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state):
        self.path_prefix = state["path_prefix"]
        self._open(validate=False)  # the process that pickled it validated the files

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        """One sequence as a numpy array (a read-only view), or a list for a slice."""
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        n = len(self)
        idx = int(idx)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.path_prefix}")
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of length {size}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, dtype=self.dtype, count=length, offset=start)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


def exists(path_prefix: str) -> bool:
    """True when both ``PREFIX.bin`` and ``PREFIX.idx`` exist."""
    return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(data_file_path(path_prefix))

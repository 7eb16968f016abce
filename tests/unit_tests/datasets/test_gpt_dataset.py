"""GPT samples: index construction (vs. Megatron's loop), contents, caching, determinism, mock data."""

import os

import numpy as np
import pytest
import torch

from megatron.core.datasets import index_cache
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    MockGPTDataset,
    MockGPTLowLevelDataset,
    build_gpt_indices,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.tokenizers import NullTokenizer

EOD = 99_999


def make_docs(lengths):
    # Token ids unique across the corpus, so a sample pins down exactly where it was read.
    return [np.arange(n, dtype=np.int64) + 1000 * i for i, n in enumerate(lengths)]


def write(prefix, docs):
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for d in docs:
        builder.add_document(d)
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.RandomState(0)
    lengths = rng.randint(1, 40, size=60).tolist()
    docs = make_docs(lengths)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    prefix = str(data_dir / "corpus")
    return prefix, docs, write(prefix, docs)


def reference_sample_index(sizes, document_index, seq_length, num_samples):
    """Megatron's build_sample_idx loop, written out step by step."""
    out = [(0, 0)]
    d, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[document_index[d]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d += 1
                offset = 0
        out.append((d, offset))
    return np.array(out)


@pytest.mark.parametrize("seq_length", [1, 5, 16, 64])
def test_sample_index_matches_megatron_loop(seq_length):
    rng = np.random.RandomState(seq_length)
    sizes = rng.randint(0, 30, size=50).astype(np.int32)  # includes empty documents
    sizes[0] = 0
    documents = np.arange(3, 47)
    arrays = build_gpt_indices(sizes, documents, 300, seq_length, seed=5)
    n = len(arrays["sample_index"]) - 1
    expected = reference_sample_index(sizes, arrays["document_index"], seq_length, n)
    np.testing.assert_array_equal(arrays["sample_index"], expected)
    assert n >= 300
    assert sorted(arrays["shuffle_index"].tolist()) == list(range(n))


def test_samples_are_continuous_across_documents(corpus):
    prefix, docs, low = corpus
    seq = 16
    ds = GPTDataset(low, np.arange(10, 50), 100, seq_length=seq, seed=1, eod=EOD, path_prefix=prefix)
    stream = np.concatenate([docs[d] for d in ds.document_index])
    assert set(ds.document_index.tolist()) == set(range(10, 50))
    crossings = 0
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        item = ds[i]
        expected = stream[j * seq : j * seq + seq + 1]
        assert item["tokens"].tolist() == expected[:-1].tolist()
        assert item["labels"].tolist() == expected[1:].tolist()
        crossings += len(set((expected // 1000).tolist())) > 1
    assert crossings > 10  # many samples really do span documents
    assert item["tokens"].dtype == torch.int64 and item["labels"].dtype == torch.int64
    assert item["loss_mask"].dtype == torch.float32 and bool((item["loss_mask"] == 1).all())
    assert item["position_ids"].tolist() == list(range(seq))


def test_epochs_and_separate_final_epoch(corpus):
    prefix, docs, low = corpus
    documents = np.arange(0, 20)
    tokens = int(low.sequence_lengths[documents].sum())
    seq = 8
    per_epoch = (tokens - 1) // seq
    # Two full epochs plus a sliver of a third: the third is shuffled on its own.
    arrays = build_gpt_indices(low.sequence_lengths, documents, 2 * per_epoch + 3, seq, seed=3)
    doc_index = arrays["document_index"]
    assert len(doc_index) == 3 * 20
    assert sorted(doc_index[-20:].tolist()) == list(range(20))
    n_before = (2 * tokens - 1) // seq
    assert sorted(arrays["shuffle_index"][:n_before].tolist()) == list(range(n_before))
    # Almost three whole epochs: no separate final epoch, everything mixed.
    arrays = build_gpt_indices(low.sequence_lengths, documents, 3 * per_epoch - 1, seq, seed=3)
    assert len(arrays["document_index"]) == 60
    assert len(arrays["shuffle_index"]) >= 3 * per_epoch - 1


def test_eod_mask_loss(tmp_path):
    docs = [np.array([5, 6, EOD]), np.array([7, 8, 9, EOD])]
    low = write(str(tmp_path / "eod"), docs)
    ds = GPTDataset(
        low, np.arange(2), 1, seq_length=5, seed=0, eod=EOD, cache_dir=str(tmp_path / "c"), eod_mask_loss=True
    )
    item = ds[0]
    assert bool(((item["tokens"] == EOD) == (item["loss_mask"] == 0)).all())
    assert int((item["loss_mask"] == 0).sum()) == 1


def test_cache_written_then_loaded(corpus, tmp_path):
    prefix, _, low = corpus
    cache = str(tmp_path / "cache")
    first = GPTDataset(low, np.arange(50), 200, seq_length=8, seed=7, eod=EOD, path_prefix=prefix, cache_dir=cache)
    assert not first.cache.cache_hit and first.cache.directory == cache
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and all(f.startswith(first.cache.key) for f in files)
    assert {f.split("-")[-1] for f in files} == {
        "description.txt",
        "document_index.npy",
        "sample_index.npy",
        "shuffle_index.npy",
    }
    assert not any(".tmp" in f for f in files)
    second = GPTDataset(low, np.arange(50), 200, seq_length=8, seed=7, eod=EOD, path_prefix=prefix, cache_dir=cache)
    assert second.cache.cache_hit
    assert isinstance(second.sample_index, np.memmap)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    assert first[3]["tokens"].tolist() == second[3]["tokens"].tolist()
    # A different seed is a different key, so a new build.
    third = GPTDataset(low, np.arange(50), 200, seq_length=8, seed=8, eod=EOD, path_prefix=prefix, cache_dir=cache)
    assert not third.cache.cache_hit and len(os.listdir(cache)) == 8


def test_default_cache_next_to_data_and_tmp_fallback(corpus, tmp_path, monkeypatch):
    prefix, _, low = corpus
    ds = GPTDataset(low, np.arange(50), 10, seq_length=8, seed=1, eod=EOD, path_prefix=prefix)
    assert ds.cache.directory == str(tmp_path / "data" / "cache" / "GPTDataset_indices")
    assert len(os.listdir(ds.cache.directory)) == 4

    # A data folder where the cache folder cannot be created: fall back to the temp dir.
    other = tmp_path / "readonly"
    other.mkdir()
    (other / "cache").write_text("a file where the cache folder would go")
    low2 = write(str(other / "corpus"), make_docs([5, 6, 7]))
    monkeypatch.setattr(index_cache, "TMP_CACHE_ROOT", str(tmp_path / "tmpcache"))
    ds2 = GPTDataset(low2, np.arange(3), 4, seq_length=4, seed=1, eod=EOD, path_prefix=str(other / "corpus"))
    assert ds2.cache.directory == str(tmp_path / "tmpcache" / "GPTDataset_indices")
    again = GPTDataset(low2, np.arange(3), 4, seq_length=4, seed=1, eod=EOD, path_prefix=str(other / "corpus"))
    assert again.cache.cache_hit


def test_unwritable_explicit_cache_is_a_user_error(corpus, tmp_path):
    prefix, _, low = corpus
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--data-cache-path"):
        GPTDataset(
            low, np.arange(5), 4, seq_length=4, seed=1, eod=EOD, path_prefix=prefix, cache_dir=str(blocker / "sub")
        )


def test_deterministic_across_builds(corpus, tmp_path):
    prefix, _, low = corpus

    def build(cache, seed):
        return GPTDataset(
            low,
            np.arange(50),
            100,
            seq_length=12,
            seed=seed,
            eod=EOD,
            path_prefix=prefix,
            cache_dir=str(tmp_path / cache),
        )

    a, b, c = build("a", 11), build("b", 11), build("c", 12)
    assert not b.cache.cache_hit  # built from scratch, not read back
    tokens = lambda ds: [ds[i]["tokens"].tolist() for i in range(20)]  # noqa: E731
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)


def test_mock_documents_match_megatron_formula():
    tok = NullTokenizer(501)  # vocab 501, eod 500
    low = MockGPTLowLevelDataset(tok)
    assert len(low) == 100_000
    expected = np.random.default_rng(0).integers(1, 4096, size=100_000, dtype=np.int32)
    np.testing.assert_array_equal(low.sequence_lengths, expected)
    assert low.sequence_lengths.min() >= 1 and low.sequence_lengths.max() <= 4095
    for i in (0, 1, int(np.argmax(low.sequence_lengths)), int(np.argmin(low.sequence_lengths))):
        n = int(low.sequence_lengths[i])
        doc = low[i]
        assert len(doc) == n and doc[-1] == 500
        np.testing.assert_array_equal(doc[:-1], (np.arange(1, n)) % 501)
    np.testing.assert_array_equal(low.get(0, 3, 4), low[0][3:7])


def test_mock_dataset_uses_gpt_sampling():
    tok = NullTokenizer(128)
    low = MockGPTLowLevelDataset(tok)
    ds = MockGPTDataset(low, np.arange(0, 200), 50, seq_length=32, seed=9, eod=tok.eod)
    assert ds.cache.directory is None  # mock data is not cached unless asked
    stream = np.concatenate([low[d] for d in ds.document_index[:40]])
    for i in range(5):
        j = int(ds.shuffle_index[i])
        if (j + 1) * 32 < len(stream):
            assert ds[i]["tokens"].tolist() == stream[j * 32 : j * 32 + 32].tolist()


def test_re_preprocessed_data_rebuilds_the_cache_and_says_so(corpus, tmp_path, caplog):
    prefix, docs, low = corpus
    cache = str(tmp_path / "cache")
    kwargs = dict(seq_length=8, seed=7, eod=EOD, path_prefix=prefix, cache_dir=cache)
    GPTDataset(low, np.arange(50), 200, **kwargs)
    # Same prefix, same number of documents and tokens, documents cut at other places.
    total = sum(len(d) for d in docs)
    lengths = [total // len(docs)] * len(docs)
    lengths[-1] += total - sum(lengths)
    new_docs = make_docs(lengths)
    new_low = write(prefix, new_docs)
    assert new_low.num_tokens == low.num_tokens and len(new_low) == len(low)
    with caplog.at_level("WARNING", logger=index_cache.__name__):
        fresh = GPTDataset(new_low, np.arange(50), 200, **kwargs)
    assert not fresh.cache.cache_hit
    assert f"rebuilding GPTDataset-train indices for {os.path.abspath(prefix)}: its data files changed" in caplog.text
    expected = build_gpt_indices(new_low.sequence_lengths, np.arange(50), 200, 8, 7)
    np.testing.assert_array_equal(fresh.sample_index, expected["sample_index"])
    for i in range(len(fresh)):
        fresh[i]  # every sample is cut where the new files say
    caplog.clear()
    with caplog.at_level("WARNING", logger=index_cache.__name__):
        assert GPTDataset(new_low, np.arange(50), 200, **kwargs).cache.cache_hit
        GPTDataset(new_low, np.arange(50), 100, **kwargs)  # other settings: a new cache, not a rebuild
    assert "rebuilding" not in caplog.text


def test_reset_position_ids_counts_again_after_each_end_of_document(tmp_path):
    docs = [np.array([5, 6, EOD]), np.array([7, 8, 9, EOD]), np.array([4, 4, 4, 4, 4])]
    low = write(str(tmp_path / "reset"), docs)
    common = dict(seq_length=10, seed=0, eod=EOD, cache_dir=str(tmp_path / "c"))
    item = GPTDataset(low, np.arange(3), 1, reset_position_ids=True, **common)[0]
    tokens, positions = item["tokens"].tolist(), item["position_ids"].tolist()
    want, p = [], 0
    for t in tokens:  # Megatron's loop: the end-of-document token keeps its count, the next starts at 0
        want.append(p)
        p = 0 if t == EOD else p + 1
    assert positions == want and EOD in tokens[:-1]
    plain = GPTDataset(low, np.arange(3), 1, **common)[0]
    assert plain["position_ids"].tolist() == list(range(10)) and torch.equal(plain["tokens"], item["tokens"])


def test_reset_attention_mask_keeps_attention_within_documents(tmp_path):
    """Megatron's loop: start causal, then for each end-of-document input token at i, the queries
    after it lose the keys up to and including it. Without the flag there is no mask at all."""
    docs = [np.array([5, 6, EOD]), np.array([7, 8, 9, EOD]), np.array([4, 4, 4, 4, 4])]
    low = write(str(tmp_path / "mask"), docs)
    common = dict(seq_length=10, seed=0, eod=EOD, cache_dir=str(tmp_path / "c"))
    item = GPTDataset(low, np.arange(3), 1, reset_attention_mask=True, **common)[0]
    tokens = item["tokens"].tolist()
    want = torch.ones(10, 10).tril()
    for i, t in enumerate(tokens):
        if t == EOD:
            want[i + 1 :, : i + 1] = 0
    assert item["attention_mask"].shape == (1, 10, 10) and item["attention_mask"].dtype == torch.bool
    assert torch.equal(item["attention_mask"][0], want.bool()) and EOD in tokens[:-1]
    assert "attention_mask" not in GPTDataset(low, np.arange(3), 1, **common)[0]

"""--data-path / --split parsing, blends and the train/valid/test entry point."""

import numpy as np
import pytest

from megatron.core.datasets import build_train_valid_test_datasets, parse_data_path, parse_split
from megatron.core.datasets.blended_dataset import BlendedDataset, build_blending_indices
from megatron.core.datasets.builder import split_ranges
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.tokenizers import NullTokenizer
from megatron.training.data_config import DataConfig

TOK = NullTokenizer(50_000)


def write(prefix, num_docs, base):
    # Every token of dataset `base` lies in [base, base + 1000), so a sample tells its source.
    rng = np.random.RandomState(base)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for _ in range(num_docs):
        builder.add_document(base + rng.randint(0, 1000, size=rng.randint(5, 30)))
    builder.finalize(prefix + ".idx")
    return prefix


def test_parse_data_path():
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["3 a 1 b"]) == (["a", "b"], [0.75, 0.25])
    assert parse_data_path(["a", "b"]) == (["a", "b"], [0.5, 0.5])
    assert parse_data_path(["a"]) == (["a"], [1.0])
    with pytest.raises(ValueError, match="mixes weights and prefixes"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(ValueError, match="positive sum"):
        parse_data_path(["0", "a", "0", "b"])
    with pytest.raises(ValueError, match="empty"):
        parse_data_path([])


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split("'99,1,0'") == pytest.approx([0.99, 0.01, 0.0])  # quotes of upstream's example scripts
    for bad in ("1,2,3,4", "a,b", "-1,2,0", "0,0,0"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_split_ranges_boundaries():
    assert split_ranges(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(parse_split("90,10,0"), 15) == [(0, 14), (14, 15), None]
    assert split_ranges(parse_split("1,1,1"), 10) == [(0, 3), (3, 7), (7, 10)]
    for n in range(1, 60):
        ranges = [r for r in split_ranges(parse_split("7,2,1"), n) if r]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_blending_indices_follow_weights():
    out = build_blending_indices([0.3, 0.7], 1000)
    idx, sample = out["dataset_index"], out["dataset_sample_index"]
    for n in (10, 100, 1000):
        assert abs(int((idx[:n] == 0).sum()) - 0.3 * n) <= 1  # every prefix is on target
    assert sample[idx == 0].tolist() == list(range(int((idx == 0).sum())))
    assert sample[idx == 1].tolist() == list(range(int((idx == 1).sum())))
    assert idx[:10].tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]  # greedy order, ties to the first
    three = build_blending_indices([0.2, 0.5, 0.3], 10_000)["dataset_index"]
    assert np.bincount(three).tolist() == [2000, 5000, 3000]


def test_split_documents_per_dataset(tmp_path):
    prefix = write(str(tmp_path / "a"), 100, 0)
    cfg = DataConfig(data_path=[prefix], split="80,15,5", data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(cfg, TOK, seq_length=8, seed=1, num_samples=(20, 5, 3))
    assert isinstance(train, GPTDataset)
    assert set(train.document_index.tolist()) == set(range(0, 80))
    assert set(valid.document_index.tolist()) == set(range(80, 95))
    assert set(test.document_index.tolist()) == set(range(95, 100))
    assert len(train) >= 20 and len(valid) >= 5 and len(test) >= 3
    batch = train[0]
    assert batch["tokens"].shape == (8,)


def test_none_for_zero_weight_or_zero_samples(tmp_path):
    prefix = write(str(tmp_path / "a"), 50, 0)
    cfg = DataConfig(data_path=[prefix], split="9,1,0", data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(cfg, TOK, seq_length=8, seed=1, num_samples=(10, 0, 5))
    assert train is not None and valid is None and test is None


def test_blend_proportions_and_sources(tmp_path):
    a = write(str(tmp_path / "a"), 200, 0)
    b = write(str(tmp_path / "b"), 200, 10_000)
    cfg = DataConfig(data_path=["0.25", a, "0.75", b], split="1,0,0", data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(cfg, TOK, seq_length=16, seed=3, num_samples=(400, 0, 0))
    assert isinstance(train, BlendedDataset) and valid is None and test is None
    assert len(train) == 400
    assert all(len(d) >= need for d, need in zip(train.datasets, (101, 302)))  # ceil(ceil(n * w) * 1.005)
    sources = []
    for i in range(len(train)):
        tokens = train[i]["tokens"]
        source = int(tokens[0] >= 10_000)
        assert bool(((tokens >= 10_000) == bool(source)).all())  # a sample never mixes datasets
        assert source == int(train.dataset_index[i])
        sources.append(source)
    assert sources.count(0) == 100 and sources.count(1) == 300

    equal = DataConfig(data_path=[a, b], split="1,0,0", data_cache_path=str(tmp_path / "cache"))
    blend = build_train_valid_test_datasets(equal, TOK, seq_length=16, seed=3, num_samples=(100, 0, 0))[0]
    assert np.bincount(np.asarray(blend.dataset_index)).tolist() == [50, 50]

    again = build_train_valid_test_datasets(cfg, TOK, seq_length=16, seed=3, num_samples=(400, 0, 0))[0]
    assert [again[i]["tokens"].tolist() for i in range(30)] == [train[i]["tokens"].tolist() for i in range(30)]


def test_missing_prefix_errors(tmp_path):
    prefix = write(str(tmp_path / "real"), 10, 0)
    cfg = DataConfig(data_path=[str(tmp_path / "nope")])
    with pytest.raises(ValueError, match=r"nope.*without\s+\.bin/\.idx"):
        build_train_valid_test_datasets(cfg, TOK, seq_length=8, seed=1, num_samples=(1, 0, 0))
    cfg = DataConfig(data_path=[prefix + ".bin"])
    with pytest.raises(ValueError, match="Drop the suffix: --data-path " + prefix):
        build_train_valid_test_datasets(cfg, TOK, seq_length=8, seed=1, num_samples=(1, 0, 0))


def test_empty_split_range_is_a_clear_error(tmp_path):
    prefix = write(str(tmp_path / "small"), 10, 0)
    cfg = DataConfig(data_path=[prefix], split="969,30,1", data_cache_path=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="valid split of .*small no documents"):
        build_train_valid_test_datasets(cfg, TOK, seq_length=4, seed=1, num_samples=(5, 1, 1))


def test_mock_data_entry_point():
    cfg = DataConfig(mock_data=True, vocab_size=1000, split="99,1,0")
    train, valid, test = build_train_valid_test_datasets(
        cfg, NullTokenizer(1000), seq_length=64, seed=1234, num_samples=(64, 16, 8)
    )
    assert isinstance(train, MockGPTDataset) and isinstance(valid, MockGPTDataset) and test is None
    assert int(train.document_index.max()) < 99_000 <= int(valid.document_index.min())
    item = train[0]
    assert item["tokens"].shape == (64,) and int(item["tokens"].max()) <= 1000


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_over_real_data(tmp_path, workers):
    from megatron.core.datasets import build_pretraining_data_loader

    prefix = write(str(tmp_path / "a"), 40, 0)
    cfg = DataConfig(data_path=[prefix], split="1,0,0", data_cache_path=str(tmp_path / "cache"))
    train = build_train_valid_test_datasets(cfg, TOK, seq_length=8, seed=1, num_samples=(16, 0, 0))[0]
    loader = build_pretraining_data_loader(train, 4, 2, 1, 2, num_workers=workers)
    batch = next(iter(loader))
    assert batch["tokens"].shape == (2, 8) and batch["loss_mask"].shape == (2, 8)
    assert batch["tokens"].tolist() == [train[6]["tokens"].tolist(), train[7]["tokens"].tolist()]


def test_per_split_paths_take_all_documents_of_their_own_prefixes(tmp_path):
    a = write(str(tmp_path / "a"), 60, 0)
    b = write(str(tmp_path / "b"), 40, 10_000)
    c = write(str(tmp_path / "c"), 30, 20_000)
    cfg = DataConfig(
        train_data_path=["0.5", a, "0.5", b],
        valid_data_path=[c],
        split="1,0,0",  # unused with per-split paths
        data_cache_path=str(tmp_path / "cache"),
    )
    train, valid, test = build_train_valid_test_datasets(cfg, TOK, seq_length=8, seed=1, num_samples=(40, 10, 5))
    assert isinstance(train, BlendedDataset) and test is None
    assert isinstance(valid, GPTDataset) and set(valid.document_index.tolist()) == set(range(30))
    sources = {int(train[i]["tokens"][0]) // 10_000 for i in range(40)}
    assert sources == {0, 1}
    assert all(int(valid[i]["tokens"][0]) // 10_000 == 2 for i in range(10))


def test_data_args_files(tmp_path):
    import json

    from megatron.training.arguments import parse_args

    a, b = write(str(tmp_path / "a"), 20, 0), write(str(tmp_path / "b"), 20, 10_000)
    (tmp_path / "blend.txt").write_text(f"0.3 {a}\n0.7 {b}\n")
    cfg = parse_args(["--data-args-path", str(tmp_path / "blend.txt"), "--vocab-size", "64"]).resolve()
    assert cfg.data.data_path == ["0.3", a, "0.7", b]
    (tmp_path / "splits.json").write_text(json.dumps({"train": f"1 {a}", "valid": [b], "test": []}))
    cfg = parse_args(["--per-split-data-args-path", str(tmp_path / "splits.json"), "--vocab-size", "64"]).resolve()
    assert (cfg.data.train_data_path, cfg.data.valid_data_path, cfg.data.test_data_path) == (["1", a], [b], [])
    cfg.validate()
    with pytest.raises(ValueError, match="cannot both be set"):
        parse_args(["--data-path", a, "--train-data-path", b, "--vocab-size", "64"]).resolve()
    with pytest.raises(ValueError, match="--eval-iters 5 needs validation data: add --valid-data-path"):
        bad = parse_args(["--train-data-path", a, "--vocab-size", "64", "--eval-iters", "5", "--eval-interval", "2"])
        bad.resolve().validate()


def test_mid_level_dataset_surplus(tmp_path):
    """--mid-level-dataset-surplus: how much more than its share each blend component builds; a blend that
    reads past a component's end names the flag."""
    import pytest
    import torch

    a = write(str(tmp_path / "a"), 200, 0)
    b = write(str(tmp_path / "b"), 200, 10_000)

    def lengths(surplus):
        cfg = DataConfig(
            data_path=["0.25", a, "0.75", b], split="1,0,0", data_cache_path=str(tmp_path / "cache"),
            mid_level_dataset_surplus=surplus,
        )  # fmt: skip
        train = build_train_valid_test_datasets(cfg, TOK, seq_length=16, seed=3, num_samples=(4000, 0, 0))[0]
        return [len(d) for d in train.datasets]

    assert all(n >= need for n, need in zip(lengths(1.0), (2000, 6000)))  # ceil(n * w) * (1 + 1.0)
    assert all(n < need for n, need in zip(lengths(0.005), (2000, 6000)))  # Megatron's default: ~1005, ~3015
    short = [torch.utils.data.TensorDataset(torch.arange(10)), torch.utils.data.TensorDataset(torch.arange(10))]
    with pytest.raises(ValueError, match="raise --mid-level-dataset-surplus"):
        BlendedDataset(short, [0.5, 0.5], 40)

"""tools/preprocess_data.py end to end (subprocess), then read back through the GPT dataset."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets import build_train_valid_test_datasets
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import build_tokenizer
from megatron.training.data_config import DataConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")
ASSETS = os.path.join(REPO, "tests", "assets", "tokenizer")
BPE_FLAGS = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", os.path.join(ASSETS, "vocab.json"),
    "--merge-file", os.path.join(ASSETS, "merges.txt"),
]  # fmt: skip


def run_tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120)


def tool_error(capsys, *args) -> str:
    """Runs the tool in this process (faster than a subprocess) and returns its error text."""
    spec = importlib.util.spec_from_file_location("preprocess_data_under_test", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so pool workers can unpickle its Encoder
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as info:
        module.main(list(args))
    assert info.value.code != 0
    return f"{info.value.code} {capsys.readouterr().err}"


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.mark.parametrize("workers", [1, 2])
def test_end_to_end(tmp_path, workers):
    texts = [f"The train left at {i}:15 and the driver sang song {i}. café" * (1 + i % 3) for i in range(40)]
    records = [{"text": t, "title": f"doc {i}"} for i, t in enumerate(texts)]
    records.insert(5, {"text": "", "title": "empty"})
    path = write_jsonl(tmp_path / "in.jsonl", records)
    prefix = str(tmp_path / "out")
    result = run_tool("--input", path, "--output-prefix", prefix, "--json-keys", "text", "title",
                      "--append-eod", "--workers", str(workers), "--log-interval", "10", *BPE_FLAGS)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(
        [
            "in.jsonl",
            "out_text_document.bin",
            "out_text_document.idx",
            "out_title_document.bin",
            "out_title_document.idx",
        ]
    )
    tok = build_tokenizer(
        DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=BPE_FLAGS[3], merge_file=BPE_FLAGS[5])
    )
    ds = IndexedDataset(prefix + "_text_document")
    assert ds.dtype == np.uint16
    assert ds.num_documents == 41 and len(ds) == 40  # the empty text is a document without sequences
    for i, text in enumerate(texts):  # input order is kept, whatever the worker count
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == text
    assert tok.detokenize(IndexedDataset(prefix + "_title_document")[7].tolist()[:-1]) == "doc 6"

    cfg = DataConfig(data_path=[prefix + "_text_document"], split="1,0,0", data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_train_valid_test_datasets(cfg, tok, seq_length=32, seed=1, num_samples=(10, 0, 0))
    assert train[0]["tokens"].shape == (32,)


def test_null_tokenizer_without_eod(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "4 5"}])
    result = run_tool(
        "--input",
        path,
        "--output-prefix",
        str(tmp_path / "n"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
    )
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert [ds[0].tolist(), ds[1].tolist()] == [[1, 2, 3], [4, 5]]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "ok"}', "{not json", '{"text": "x"}'], "line 2 is not valid JSON"),
        (['{"text": "ok"}', '{"body": "x"}'], "line 2 has no key 'text'"),
        (['["a"]'], "line 1 is a JSON list"),
    ],
)
def test_bad_input_lines(tmp_path, capsys, lines, message):
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    assert message in tool_error(capsys, "--input", path, "--output-prefix", str(tmp_path / "o"), *BPE_FLAGS)
    assert os.listdir(tmp_path) == ["in.jsonl"]  # nothing half-written


def test_missing_input_and_tokenizer_files(tmp_path, capsys):
    error = tool_error(
        capsys, "--input", str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "o"), *BPE_FLAGS
    )
    assert "--input" in error and "none.jsonl does not exist" in error
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    error = tool_error(capsys, "--input", path, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer",
                       "--vocab-file", str(tmp_path / "v.json"), "--merge-file", BPE_FLAGS[5])  # fmt: skip
    assert "--vocab-file" in error and "v.json" in error


def test_tokenizer_metadata(tmp_path, capsys):
    """The file changes nothing in the output when its library is the type's; another library is an error."""
    from megatron.core.tokenizers import write_metadata

    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "Hello world"}, {"text": "café 東京"}])
    good = write_metadata(ASSETS, "megatron", metadata_path=str(tmp_path / "bpe.json"))
    for name, extra in (("plain", []), ("meta", ["--tokenizer-metadata", good])):
        result = run_tool("--input", path, "--output-prefix", str(tmp_path / name), *BPE_FLAGS, *extra)
        assert result.returncode == 0, result.stderr
    for suffix in (".bin", ".idx"):
        with (
            open(tmp_path / f"plain_text_document{suffix}", "rb") as a,
            open(tmp_path / f"meta_text_document{suffix}", "rb") as b,
        ):
            assert a.read() == b.read()
    bad = write_metadata(ASSETS, "huggingface", metadata_path=str(tmp_path / "hf.json"))
    error = tool_error(
        capsys, "--input", path, "--output-prefix", str(tmp_path / "o"), *BPE_FLAGS, "--tokenizer-metadata", bad
    )
    assert f"--tokenizer-metadata {bad}: field 'library' is 'huggingface'" in error


def test_worker_errors_reach_the_user(tmp_path, capsys):
    lines = ['{"text": "fine"}'] * 300 + ["{broken"]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    error = tool_error(capsys, "--input", path, "--output-prefix", str(tmp_path / "o"), "--workers", "2", *BPE_FLAGS)
    assert "line 301 is not valid JSON" in error
    assert os.listdir(tmp_path) == ["in.jsonl"]


@pytest.mark.parametrize("lines, message", [([], "holds no documents"), (["", "  "], "holds no documents")])
def test_empty_input_is_an_error_and_writes_nothing(tmp_path, capsys, lines, message):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines))
    error = tool_error(capsys, "--input", str(path), "--output-prefix", str(tmp_path / "o"), *BPE_FLAGS)
    assert f"--input {path} {message}" in error and "no dataset was written" in error
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_list_fields_are_sentences_and_upstream_flags_parse(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": ["1 2", "", "3"]}, {"text": "4 5"}])
    result = run_tool(
        "--input", path, "--output-prefix", str(tmp_path / "n"), "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100", "--append-eod", "--partitions", "2", "--keep-newlines", "--keep-sequential-samples",
        "--lang", "english",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    # As Megatron: one sequence per non-empty sentence, end-of-document (99) on the last one.
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3, 99], [4, 5, 99]]
    assert list(ds.document_indices) == [0, 2, 3]

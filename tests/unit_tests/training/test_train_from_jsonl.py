"""The real-data path end to end: JSONL -> tools/preprocess_data.py -> pretrain 20 iterations."""

import importlib.util
import json
import os
import sys

from megatron.core import parallel_state
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer, pretrain

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORDS = "the cat sat on a mat while dogs ran past every small house near old river".split()


def preprocess(argv):
    spec = importlib.util.spec_from_file_location("preprocess_tool", os.path.join(REPO, "tools", "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.main(argv)


def write_corpus(path, documents=120):
    texts = []
    with open(path, "w", encoding="utf-8") as f:
        for i in range(documents):
            words = [WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(20 + i % 30)]
            text = " ".join(words).capitalize() + f". Document {i}."
            texts.append(text)
            f.write(json.dumps({"text": text, "id": i}) + "\n")
    return texts


def test_preprocess_jsonl_then_train_20_iterations(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    texts = write_corpus(corpus)
    prefix = str(tmp_path / "corpus")
    preprocess(["--input", str(corpus), "--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer",
                "--append-eod", "--workers", "1"])  # fmt: skip
    data_path = prefix + "_text_document"
    assert os.path.isfile(data_path + ".bin") and os.path.isfile(data_path + ".idx")

    flags = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--data-path", data_path, "--split", "100,0,0", "--tokenizer-type", "ByteLevelTokenizer",
        "--data-cache-path", str(tmp_path / "cache"), "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--num-workers", "0", "--log-interval", "1", "--train-iters", "20",
    ]  # fmt: skip

    # The samples are the corpus: decode the first one back to text.
    probe = build_trainer(flags)
    batch = next(build_data_iterators(probe.cfg, probe.tokenizer, probe.pg, 0)[0])
    parallel_state.destroy(probe.pg)
    sample = [t for t in batch["tokens"][0].tolist() if t < 256]  # drop <eod>
    text = bytes(sample).decode("utf-8", errors="ignore")
    assert any(text[5:40] in t for t in texts), text

    metrics = tmp_path / "m.jsonl"
    trainer = pretrain(flags + ["--metrics-file", str(metrics)])
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    assert [r["iteration"] for r in records] == list(range(1, 21))
    assert trainer.consumed_samples == 160
    first, last = records[0]["lm loss"], records[-1]["lm loss"]
    assert 5.0 < first < 6.5  # about ln(258 bytes + specials) at the start
    assert last < first - 1.5, (first, last)  # bytes of repetitive English are easy to learn
    assert os.listdir(tmp_path / "cache")  # index caches were written where asked

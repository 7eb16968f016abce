"""SentencePiece tokenizer types against what the ``sentencepiece`` package itself returns.

The committed model (``tests/assets/tokenizer/tokenizer.model``, Llama-like) is checked to be what
``tools/make_tiny_sentencepiece.py`` makes; variants (a pad piece, no eos, whitespace collapsing)
are trained here in a few milliseconds each.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.core.tokenizers import SENTENCEPIECE_TYPES, SentencePieceTokenizer, build_tokenizer
from megatron.training.arguments import parse_args
from megatron.training.data_config import DataConfig

spm = pytest.importorskip("sentencepiece")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODEL = os.path.join(REPO, "tests", "assets", "tokenizer", "tokenizer.model")
TEXTS = [
    "",
    "Hello world",
    "The train left at 7:15.\n\n  Twice!",
    "café naïve 東京 🚂 ☯",
    "tabs\tand   spaces  ",
    "unseen: qzxjv ЖЩ",
]


def _tool():
    path = os.path.join(REPO, "tools", "make_tiny_sentencepiece.py")
    spec = importlib.util.spec_from_file_location("make_tiny_sentencepiece", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(tmp_path, name="variant.model", **options) -> str:
    path = tmp_path / name
    path.write_bytes(_tool().train_sentencepiece(**options))
    return str(path)


def _processor(path: str):
    sp = spm.SentencePieceProcessor()
    sp.Load(path)
    return sp


def _build(kind=SENTENCEPIECE_TYPES[0], model=MODEL, **fields):
    return build_tokenizer(DataConfig(tokenizer_type=kind, tokenizer_model=model, **fields))


def test_committed_model_is_what_the_tool_makes():
    tool = _tool()
    first, second = tool.train_sentencepiece(), tool.train_sentencepiece()
    assert first == second  # one trainer thread: the same bytes every run
    with open(MODEL, "rb") as f:
        assert f.read() == first
    assert len(first) < 300_000


@pytest.mark.parametrize("kind", SENTENCEPIECE_TYPES)
def test_ids_and_text_are_the_models(kind):
    tok = _build(kind)
    sp = _processor(MODEL)
    assert isinstance(tok, SentencePieceTokenizer)
    # Current Megatron adds nothing to the model's vocabulary for any of the three names.
    assert tok.vocab_size == sp.get_piece_size() == 512
    assert (tok.eod, tok.eos, tok.bos, tok.pad, tok.unk) == (sp.eos_id(), sp.eos_id(), sp.bos_id(), -1, sp.unk_id())
    assert (tok.unk, tok.bos, tok.eod) == (0, 1, 2)
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids == sp.encode_as_ids(text)  # no BOS, not even for Llama2Tokenizer
        assert tok.detokenize(ids) == sp.decode_ids(ids)
    # Byte fallback, no normalisation: text that does not start with a space comes back exactly.
    for text in TEXTS[1:4] + TEXTS[5:]:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_token_to_id():
    tok = _build()
    sp = _processor(MODEL)
    assert tok.token_to_id("</s>") == sp.eos_id()
    assert tok.token_to_id("<unk>") == sp.unk_id()
    assert tok.token_to_id("▁the") == sp.piece_to_id("▁the") != sp.unk_id()
    assert tok.token_to_id("<fim_prefix>") is None  # the model would map it to unk


def test_pad_and_missing_eos_follow_the_model(tmp_path):
    with_pad = _build(model=_model(tmp_path, "pad.model", pad_id=3))
    sp = _processor(str(tmp_path / "pad.model"))
    assert with_pad.pad == sp.pad_id() == 3 and with_pad.eod == sp.eos_id() == 2
    no_eos = _build(model=_model(tmp_path, "noeos.model", eos_id=-1))
    assert no_eos.eod == -1 and no_eos.bos == 1  # upstream's eod is the model's eos id, -1 here


def test_legacy_special_tokens(tmp_path):
    sp = _processor(MODEL)
    tokens = ["</s>", "<CLS>", "<x>", "<x>y", "<CLS>"]
    tok = _build(tokenizer_sentencepiece_legacy=True, tokenizer_special_tokens=tokens)
    # Pieces the model has keep their ids; new tokens follow its pieces in the order given.
    assert tok.vocab_size == 512 + 3
    ids = {t: tok.token_to_id(t) for t in tokens}
    assert ids == {"</s>": sp.eos_id(), "<CLS>": 512, "<x>": 513, "<x>y": 514}
    sep = sp.piece_to_id("▁")

    def segment(text, after_special):
        out = sp.encode_as_ids(text)
        if after_special and out and out[0] == sep:
            out = out[1:]  # a lone separator piece right after a special token is dropped
        return out

    text = "Hello<CLS> world</s> 7<x>y end"
    expected = (
        segment("Hello", False)
        + [512]
        + segment(" world", True)
        + [sp.eos_id()]
        + segment(" 7", True)
        + [513]  # "<x>" and "<x>y" start at the same place: the one given first wins
        + segment("y end", False)  # upstream trims only text that ends at a special token
    )
    assert tok.tokenize(text) == expected
    assert tok.detokenize(expected) == "Hello <CLS> world </s> 7 <x> y end"
    # Without special tokens the legacy switch changes encoding nothing; decoding strips the ends.
    plain = _build(tokenizer_sentencepiece_legacy=True)
    for text in TEXTS:
        assert plain.tokenize(text) == sp.encode_as_ids(text)
        assert plain.detokenize(sp.encode_as_ids(text)) == sp.decode_ids(sp.encode_as_ids(text)).strip()


def test_special_tokens_need_the_legacy_switch():
    with pytest.raises(ValueError, match="--tokenizer-sentencepiece-legacy"):
        _build(tokenizer_special_tokens=["<CLS>"])
    with pytest.raises(ValueError, match="empty token"):
        _build(tokenizer_sentencepiece_legacy=True, tokenizer_special_tokens=["<CLS>", ""])


@pytest.mark.parametrize("byte_fallback", [True, False])
def test_kept_extra_whitespace(tmp_path, byte_fallback):
    # A model trained with the default normalisation collapses runs of spaces.
    path = _model(
        tmp_path, normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=True, byte_fallback=byte_fallback
    )
    sp = _processor(path)
    collapsing = _build(model=path)
    assert collapsing.removed_extra_spaces
    assert collapsing.tokenize("a  b") == collapsing.tokenize("a b") == sp.encode_as_ids("a b")
    keeping = _build(model=path, tokenizer_sentencepiece_ignore_extra_whitespaces=False)
    # Each extra space becomes a lone separator piece; the marker leaves no id behind (with byte
    # fallback it is three byte pieces, without it one unk).
    ids = keeping.tokenize("a   b  c")
    assert [sp.id_to_piece(i) for i in ids] == ["▁a", "▁", "▁", "▁b", "▁", "▁c"]
    assert sp.decode_ids(ids) == "a   b  c"
    assert keeping.tokenize("a b") == sp.encode_as_ids("a b")  # single spaces are untouched
    # A model that keeps spaces itself is not changed by the switch.
    llama = _build(tokenizer_sentencepiece_ignore_extra_whitespaces=False)
    assert not llama.removed_extra_spaces
    assert llama.tokenize("a   b") == _processor(MODEL).encode_as_ids("a   b")


def test_errors_name_the_flag(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer"))
    with pytest.raises(ValueError, match="--tokenizer-model /no/t.model does not exist"):
        _build(model="/no/t.model")
    not_a_model = tmp_path / "tokenizer.json"
    not_a_model.write_text('{"model": {}}')
    with pytest.raises(ValueError, match="--tokenizer-model .* cannot be loaded as a SentencePiece model"):
        _build(model=str(not_a_model))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # makes `import sentencepiece` fail
    with pytest.raises(ValueError, match="--tokenizer-type Llama2Tokenizer needs .*pip install sentencepiece"):
        _build("Llama2Tokenizer")


def _validate(argv):
    cfg = parse_args(argv).resolve(world_size=1)
    cfg.validate()
    return cfg


BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--mock-data"]  # fmt: skip


def test_flags_parse_and_validate():
    cfg = _validate(
        BASE
        + ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", MODEL]
        + ["--tokenizer-sentencepiece-legacy", "--tokenizer-special-tokens", "<CLS>", "<SEP>"]
        + ["--disable-tokenizer-sentencepiece-ignore-extra-whitespaces", "--vocab-extra-ids", "100"]
    )
    d = cfg.data
    assert d.tokenizer_special_tokens == ["<CLS>", "<SEP>"] and d.tokenizer_sentencepiece_legacy
    assert d.tokenizer_sentencepiece_ignore_extra_whitespaces is False
    assert _validate(BASE + ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", MODEL]).data.tokenizer_type
    with pytest.raises(ValueError, match="--tokenizer-type SentencePieceTokenizer needs --tokenizer-model"):
        _validate(BASE + ["--tokenizer-type", "SentencePieceTokenizer"])
    with pytest.raises(ValueError, match="--tokenizer-special-tokens needs --tokenizer-sentencepiece-legacy"):
        _validate(BASE + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", MODEL,
                          "--tokenizer-special-tokens", "<CLS>"])  # fmt: skip
    with pytest.raises(ValueError, match="--tokenizer-special-tokens with --tokenizer-type NullTokenizer"):
        _validate(BASE + ["--vocab-size", "64", "--tokenizer-special-tokens", "<CLS>"])


@pytest.mark.parametrize("divisible_by, tp, padded", [(128, 1, 512), (100, 1, 600), (128, 8, 1024), (7, 2, 518)])
def test_vocab_padding_by_divisor_times_tp(divisible_by, tp, padded):
    from types import SimpleNamespace

    from megatron.training.data import setup_tokenizer

    cfg = _validate(
        BASE
        + ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", MODEL]
        + ["--make-vocab-size-divisible-by", str(divisible_by)]
    )
    tok = setup_tokenizer(cfg, SimpleNamespace(tp_size=tp))
    assert tok.vocab_size == 512 and cfg.model.vocab_size == padded


def _preprocess(*args):
    tool = os.path.join(REPO, "tools", "preprocess_data.py")
    return subprocess.run([sys.executable, tool, *args], capture_output=True, text=True, timeout=300)


def test_preprocess_then_train(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.training.training import pretrain

    words = "the train left at 7:15 and the driver sang to the valley café".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(8 + i % 9)) + f" <CLS> doc {i}" for i in range(60)]
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    prefix = str(tmp_path / "sp")
    flags = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", MODEL, "--tokenizer-sentencepiece-legacy",
             "--tokenizer-special-tokens", "<CLS>", "--vocab-extra-ids", "0"]  # fmt: skip
    result = _preprocess("--input", str(corpus), "--output-prefix", prefix, "--append-eod", "--workers", "2", *flags)
    assert result.returncode == 0, result.stderr
    tok = _build("Llama2Tokenizer", tokenizer_sentencepiece_legacy=True, tokenizer_special_tokens=["<CLS>"])
    sp = _processor(MODEL)
    ds = IndexedDataset(prefix + "_text_document")
    assert ds.dtype == np.uint16 and len(ds) == len(texts)
    for i, text in enumerate(texts):
        head, tail = (sp.encode_as_ids(part) for part in text.split("<CLS>"))
        assert ds[i].tolist() == head + [512] + tail + [sp.eos_id()]
        assert tok.detokenize(ds[i].tolist()[:-1]) == f"{sp.decode_ids(head)} <CLS> {sp.decode_ids(tail)}".strip()

    argv = BASE[:-1] + ["--global-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--data-path",
                        prefix + "_text_document", "--split", "100,0,0", "--data-cache-path", str(tmp_path / "cache"),
                        "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0", *flags]  # fmt: skip
    trainer = pretrain(argv)
    assert trainer.iteration == 4 and trainer.cfg.model.vocab_size == 640  # 513 ids padded to a multiple of 128
    assert all(math.isfinite(r["lm loss"]) for r in trainer.history)


def test_preprocess_append_eod_needs_an_eos_piece(tmp_path):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "hello"}\n', encoding="utf-8")
    model = _model(tmp_path, "noeos.model", eos_id=-1)
    result = _preprocess("--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--append-eod",
                         "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model)  # fmt: skip
    assert result.returncode != 0 and "--append-eod" in result.stderr and "end-of-sentence" in result.stderr
    result = _preprocess("--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                         "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model)  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_pad_rule_of_the_datasets():
    from types import SimpleNamespace as T

    from megatron.core.datasets.gpt_dataset import pad_id_to_mask

    assert pad_id_to_mask(T(pad=3, eod=2, eos=2)) == 3
    assert pad_id_to_mask(T(pad=-1, eod=2, eos=2)) is None  # the model has no pad piece
    assert pad_id_to_mask(T(pad=2, eod=2)) is None  # pad == end of document (GPT-2, NullTokenizer here)
    assert pad_id_to_mask(T(pad=5, eod=2, eos=5)) is None
    assert pad_id_to_mask(_build()) is None


def test_mock_samples_mask_the_models_pad_id(tmp_path):
    from megatron.core.datasets import build_train_valid_test_datasets

    def first_samples(model):
        tok = _build("GPTSentencePieceTokenizer", model=model)
        cfg = DataConfig(mock_data=True, split="1,0,0")
        train, _, _ = build_train_valid_test_datasets(cfg, tok, seq_length=600, seed=5, num_samples=(4, 0, 0))
        return tok, [train[i] for i in range(4)]

    plain_tok, plain = first_samples(MODEL)
    pad_tok, padded = first_samples(_model(tmp_path, "pad.model", pad_id=3))
    assert pad_tok.pad == 3 and plain_tok.pad == -1 and pad_tok.vocab_size == plain_tok.vocab_size
    masked = 0
    for a, b in zip(plain, padded):  # the same mock documents: ids cycle through the whole vocabulary
        assert torch.equal(a["loss_mask"], torch.ones(600))
        is_pad = a["labels"] == 3
        masked += int(is_pad.sum())
        assert torch.equal(b["loss_mask"], (~is_pad).float())
        assert torch.equal(b["labels"], torch.where(is_pad, 0, a["labels"]))
        assert torch.equal(b["tokens"], torch.where(a["tokens"] == 3, 0, a["tokens"]))
    assert masked > 0

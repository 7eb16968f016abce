"""Fill-in-the-middle samples (``--fim-*``): hand-checked rewrites, invariants, errors, data paths (CPU).

The hand-checked cases use a character tokenizer and a scripted random stream, so each
expected sample is worked out on paper from Megatron's rules (``datasets/fim.py``).
"""

import os

import numpy as np
import pytest
import torch

from megatron.core.datasets import build_train_valid_test_datasets
from megatron.core.datasets.fim import FIMRewriter
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.tokenizers import build_tokenizer
from megatron.training.arguments import parse_args
from megatron.training.data_config import DataConfig
from megatron.training.training import pretrain

ASSETS = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "tokenizer")
VOCAB_FIM, VOCAB, MERGES = (os.path.join(ASSETS, f) for f in ("vocab_fim.json", "vocab.json", "merges.txt"))
NAMES = {
    "prefix": "<fim_prefix>",
    "middle": "<fim_middle>",
    "suffix": "<fim_suffix>",
    "pad": "<fim_pad>",
    "eod": "<|endoftext|>",
}
EOD, PRE, MID, SUF, PAD, SPLIT = 26, 27, 28, 29, 30, 31


class CharTokenizer:
    """a..z are ids 0..25; the FIM tokens 26..30 and ``|`` (31) have names."""

    _named = {"<|endoftext|>": EOD, "<fim_prefix>": PRE, "<fim_middle>": MID, "<fim_suffix>": SUF, "<fim_pad>": PAD}

    def tokenize(self, text):
        return [SPLIT if c == "|" else ord(c) - ord("a") for c in text]

    def detokenize(self, ids):
        assert all(0 <= i < 26 for i in ids), ids  # the rewriter drops the FIM tokens before decoding
        return "".join(chr(ord("a") + i) for i in ids)

    def token_to_id(self, token):
        return {**self._named, "|": SPLIT}.get(token)


class Script:
    """A random stream that returns scripted draws and records the probabilities asked for."""

    def __init__(self, coins, cuts=()):
        self.coins, self.cuts, self.asked = list(coins), list(cuts), []

    def binomial(self, n, p):
        assert n == 1
        self.asked.append(p)
        return self.coins.pop(0)

    def randint(self, low, high, size):
        assert low == 0 and size == 2
        cut = self.cuts.pop(0)
        assert max(cut) < high, (cut, high)
        return np.array(cut)

    def done(self):
        return not self.coins and not self.cuts


def ids(text):
    return [EOD if c == "$" else CharTokenizer().tokenize(c)[0] for c in text]


def rewriter(**kw):
    args = dict(rate=0.5, spm_rate=0.25, token_names=NAMES, seed=7)
    args.update(kw)
    return FIMRewriter(CharTokenizer(), **args)


def test_psm_cuts_at_the_drawn_characters_and_truncates():
    # "abcdefgh", cuts (6, 3) -> sorted 3, 6: prefix abc, middle def, suffix gh; PSM:
    # <pre> a b c <suf> g h <mid> d e f (11 tokens), truncated to the sample's 8.
    rng = Script(coins=[1, 0], cuts=[(6, 3)])
    out = rewriter()(np.array(ids("abcdefgh")), rng)
    assert out.tolist() == [PRE, 0, 1, 2, SUF, 6, 7, MID]
    assert rng.asked == [0.5, 0.25] and rng.done()  # --fim-rate, then --fim-spm-rate


def test_spm_per_document_between_end_tokens():
    # "abc" EOD "de" EOD: doc 1 FIM with cuts 1, 2 -> prefix a, middle b, suffix c, SPM:
    # <pre> <suf> c <mid> a b; then EOD; doc 2 not rewritten, EOD. 10 tokens -> the first 7.
    rng = Script(coins=[1, 1, 0, 0], cuts=[(2, 1)])  # the last coin: the empty piece after the last EOD
    out = rewriter()(np.array(ids("abc$de$")), rng)
    assert out.tolist() == [PRE, SUF, 2, MID, 0, 1, EOD]
    assert rng.asked == [0.5, 0.25, 0.5, 0.5] and rng.done()


def test_empty_documents_are_dropped_and_the_sample_padded():
    # EOD EOD "ab" EOD <empty>: the empty documents and their end tokens go (Megatron's loop),
    # "ab" is kept, the empty piece after the last EOD draws its coin: a b EOD, then 2 pads.
    rng = Script(coins=[0, 0])
    out = rewriter()(np.array(ids("$$ab$")), rng)
    assert out.tolist() == [0, 1, EOD, PAD, PAD]
    assert rng.asked == [0.5, 0.5] and rng.done()


def test_empty_piece_rewritten_is_the_three_sentinels():
    # EOD EOD EOD "ab" EOD <empty>: three empty documents dropped, "ab" kept (coin 0), the empty
    # piece after the last EOD gets FIM (coin 1, cuts 0, 0, PSM): <pre> <suf> <mid>; 6 tokens exactly.
    rng = Script(coins=[0, 1, 0], cuts=[(0, 0)])
    out = rewriter()(np.array(ids("$$$ab$")), rng)
    assert out.tolist() == [0, 1, EOD, PRE, SUF, MID]
    assert rng.done()


def test_split_sample_rewrites_fragments_with_the_fragment_rate():
    # "ab|cd|ef": the sample's coin (--fim-rate) then one coin per fragment (--fim-fragment-rate);
    # fragment cd gets FIM with cuts 0, 2 -> prefix "", middle cd, suffix "", SPM: <pre> <suf> <mid> c d.
    rng = Script(coins=[1, 0, 1, 1, 0], cuts=[(0, 2)])
    fim = rewriter(split_sample="|", fragment_rate=0.75)
    out = fim(np.array([0, 1, SPLIT, 2, 3, SPLIT, 4, 5]), rng)
    assert out.tolist() == [0, 1, SPLIT, PRE, SUF, MID, 2, 3]
    assert rng.asked == [0.5, 0.75, 0.75, 0.25, 0.75] and rng.done()
    rng = Script(coins=[0])  # the sample's coin says no: untouched, no fragment coins drawn
    assert fim(np.array([0, 1, SPLIT, 2]), rng).tolist() == [0, 1, SPLIT, 2] and rng.done()


def test_no_prefix_skips_before_drawing_cuts():
    rng = Script(coins=[1])
    out = rewriter(no_prefix="xy")(np.array(ids("xyzab")), rng)
    assert out.tolist() == ids("xyzab") and rng.done()


def gpt2(vocab=VOCAB_FIM):
    return build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=MERGES))


def test_psm_rewrite_puts_the_text_back_together_with_a_real_tokenizer():
    """rate 1, spm 0 with real draws: every document is <pre> P <suf> S <mid> M and P + M + S
    is its text (the GPT-2 BPE tokenizer of the test assets with the FIM tokens added)."""
    tok = gpt2()
    fim = FIMRewriter(tok, rate=1.0, spm_rate=0.0, token_names=NAMES, seed=1234)
    docs = ["def add(a, b):\n    return a + b\n", "Hello world, fill in the middle."]
    sample = np.array(tok.tokenize(docs[0]) + [tok.eod] + tok.tokenize(docs[1]), dtype=np.int64)
    pre, mid, suf = (tok.token_to_id(NAMES[k]) for k in ("prefix", "middle", "suffix"))
    for index in range(20):
        out = fim(np.concatenate([sample, [tok.eod] * 40]), fim.rng_for("train", index))
        body = out.tolist()
        pieces = []
        while body and body[0] == pre:
            s, m = body.index(suf), body.index(mid)
            end = body.index(tok.eod) if tok.eod in body else len(body)
            prefix, suffix, middle = body[1:s], body[s + 1 : m], body[m + 1 : end]
            pieces.append(tok.detokenize(prefix + middle + suffix))
            body = body[end + 1 :]
        assert pieces[:2] == docs, (index, pieces)
    a = fim(sample, fim.rng_for("train", 3))
    assert torch.equal(torch.from_numpy(a), torch.from_numpy(fim(sample, fim.rng_for("train", 3))))
    outs = {tuple(fim(sample, fim.rng_for("train", i)).tolist()) for i in range(8)}
    assert len(outs) > 1, "different samples draw different cuts"


def test_tokenizers_without_the_fim_tokens_are_a_clear_error():
    with pytest.raises(ValueError, match=r"no token '<fim_prefix>' for --fim-prefix-token"):
        FIMRewriter(gpt2(VOCAB), rate=0.5, spm_rate=0.5, token_names=NAMES)
    null = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=64))
    with pytest.raises(ValueError, match=r"NullTokenizer.*--fim-prefix-token"):
        FIMRewriter(null, rate=0.5, spm_rate=0.5, token_names=NAMES)
    with pytest.raises(ValueError, match=r"no token '<sep>' for --fim-split-sample"):
        FIMRewriter(gpt2(), rate=0.5, spm_rate=0.5, token_names=NAMES, split_sample="<sep>")


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32"]


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--fim-rate", "1.5"], r"--fim-rate must be a probability in \[0, 1\], got 1.5"),
        (["--fim-spm-rate", "-0.1"], "--fim-spm-rate must be a probability"),
        (["--fim-split-sample", "|"], "--fim-split-sample needs --fim-fragment-rate"),
        (["--fim-prefix-token", ""], "--fim-prefix-token must name a token"),
    ],
)
def test_fim_flag_mistakes_name_the_flag(extra, match):
    cfg = parse_args(BASE + ["--fim-data", *extra]).resolve()
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_indexed_data_samples_are_rewritten_and_reproducible(tmp_path):
    tok = gpt2()
    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for i in range(40):
        builder.add_document(np.array(tok.tokenize(f"line {i}: the quick brown fox") + [tok.eod]))
    builder.finalize(prefix + ".idx")
    data = DataConfig(
        data_path=[prefix], split="100,0,0", tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB_FIM, merge_file=MERGES
    )
    data.fim_data, data.fim_rate, data.fim_spm_rate = True, 0.9, 0.5

    def build():
        fim = FIMRewriter.from_config(data, tok, seed=5)
        return build_train_valid_test_datasets(data, tok, seq_length=32, seed=5, num_samples=(16, 0, 0), fim=fim)[0]

    ds, again = build(), build()
    pre, suf = tok.token_to_id("<fim_prefix>"), tok.token_to_id("<fim_suffix>")
    samples = [ds[i] for i in range(16)]
    assert all(s["tokens"].shape == (32,) for s in samples)
    assert sum(int((s["tokens"] == pre).sum()) for s in samples) > 16  # about 0.9 of ~two documents each
    assert sum(int((s["tokens"] == suf).sum()) for s in samples) > 16
    for i in reversed(range(16)):  # another read order, another dataset object: the same samples
        for key in ("tokens", "labels"):
            assert torch.equal(again[i][key], samples[i][key]), (i, key)
    assert torch.equal(samples[3]["labels"][:-1], samples[3]["tokens"][1:])  # shifted by one, as always


def test_mock_data_trains_with_fim():
    trainer = pretrain(
        BASE
        + "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data --num-workers 0 "
        "--log-interval 1 --tokenizer-type GPT2BPETokenizer --fim-data --fim-rate 0.5 --fim-spm-rate 0.5".split()
        + ["--vocab-file", VOCAB_FIM, "--merge-file", MERGES]
    )
    assert [r["iteration"] for r in trainer.history] == [1, 2]
    assert all(np.isfinite(r["lm loss"]) for r in trainer.history)

"""build_tokenizer for every --tokenizer-type, round trips, errors and vocabulary padding."""

import os
import sys

import pytest

from megatron.core.tokenizers import (
    ByteLevelTokenizer,
    GPT2BPETokenizer,
    NullTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)
from megatron.training.data_config import DataConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ASSETS = os.path.join(REPO, "tests", "assets", "tokenizer")
VOCAB, MERGES, HF_JSON = (os.path.join(ASSETS, f) for f in ("vocab.json", "merges.txt", "tokenizer.json"))


def hf_tokenizers():
    """The optional `tokenizers` package, or skip.

    When tests/unit_tests is on sys.path, this test folder itself imports as a namespace
    package called `tokenizers` if the real one is absent, so check for its API.
    """
    module = pytest.importorskip("tokenizers")
    if not hasattr(module, "Tokenizer"):
        pytest.skip("the optional 'tokenizers' package is not installed")
    return module


TEXTS = [
    "",
    "Hello world",
    "The train left at 7:15.\n\n  Twice!",
    "café naïve 東京 🚂",
    "tabs\tand   spaces  ",
    "I'm sure they'll've",
]


def test_null_tokenizer_follows_megatron():
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=1000))
    assert isinstance(tok, NullTokenizer)
    # Current Megatron: --vocab-size is the whole vocabulary, the last id is end-of-document.
    assert tok.vocab_size == 1000 and tok.eod == 999 == tok.vocab_size - 1
    assert tok.tokenize("3 1  4\n999") == [3, 1, 4, 999]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("3 x")
    with pytest.raises(ValueError, match="--vocab-size"):
        tok.tokenize("1000")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=None))


def test_byte_level_round_trip():
    tok = build_tokenizer(DataConfig(tokenizer_type="ByteLevelTokenizer"))
    assert isinstance(tok, ByteLevelTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
        assert tok.detokenize(ids) == text
    ids = tok.tokenize("é") + [256] + tok.tokenize("x") + [257]
    assert tok.detokenize(ids) == "é<eod>x<pad>"


def test_gpt2_bpe_round_trip_and_merges():
    tok = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES))
    assert isinstance(tok, GPT2BPETokenizer)
    assert tok.vocab_size == 411 and tok.eod == 410
    for text in TEXTS:
        assert tok.detokenize(tok.tokenize(text)) == text
    # Frequent words of the training text are single merged tokens; rare text falls back to bytes.
    assert tok.tokenize(" the") == [tok.encoder["Ġthe"]]
    assert len(tok.tokenize(" the")) < len(b" the") and len(tok.tokenize("zzq")) == 3
    # A literal <|endoftext|> is end-of-document, as in Megatron's GPT-2 tokenizer.
    assert tok.tokenize("<|endoftext|>") == [tok.eod]
    assert tok.tokenize(" the<|endoftext|> the") == [tok.encoder["Ġthe"], tok.eod, tok.encoder["Ġthe"]]
    assert tok.detokenize([tok.eod]) == "<|endoftext|>"
    assert tok.detokenize([5000]) == ""  # embedding padding ids are skipped


def test_gpt2_bpe_matches_hugging_face():
    import random

    tokenizers = hf_tokenizers()

    hf = tokenizers.Tokenizer.from_file(HF_JSON)
    tok = GPT2BPETokenizer(VOCAB, MERGES)
    rng = random.Random(0)
    alphabet = "ab c\n\t'sS1²½Ⅻ٣é東🚂\u00a0\u2003\x1c\x85_-!?.,the "
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(500)]
    for text in texts:
        assert tok.tokenize(text) == hf.encode(text, add_special_tokens=False).ids, repr(text)


def test_hugging_face_tokenizer():
    hf_tokenizers()
    tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=HF_JSON))
    assert tok.vocab_size == 411 and tok.eod == 410
    bpe = GPT2BPETokenizer(VOCAB, MERGES)
    for text in TEXTS:
        assert tok.tokenize(text) == bpe.tokenize(text)
        assert tok.detokenize(tok.tokenize(text)) == text
    folder = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=ASSETS))
    assert folder.tokenize("Hello") == tok.tokenize("Hello")


def test_hugging_face_without_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ValueError, match="pip install tokenizers"):
        build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=HF_JSON))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(tokenizer_type="GPT2BPETokenizer", merge_file=MERGES), "needs --vocab-file"),
        (
            dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/no/vocab.json", merge_file=MERGES),
            "--vocab-file /no/vocab.json does not exist",
        ),
        (
            dict(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file="/no/m.txt"),
            "--merge-file /no/m.txt does not exist",
        ),
        (
            dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/no/tok.json"),
            "--tokenizer-model /no/tok.json does not exist",
        ),
        (dict(tokenizer_type="HuggingFaceTokenizer"), "needs --tokenizer-model"),
        (  # a Hub name, as upstream's docs and scripts pass: say there is no download and what to do
            dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="meta-llama/Meta-Llama-3-8B"),
            "no local file or folder, and this trainer does not download from the Hugging Face Hub: fetch it first "
            r"\(e.g. huggingface-cli download meta-llama/Meta-Llama-3-8B .*--tokenizer-type NullTokenizer",
        ),
        (dict(tokenizer_type="SentencePieceTokenizer"), "needs --tokenizer-model"),
        (dict(tokenizer_type="BertWordPieceCase"), "not supported"),
    ],
)
def test_missing_files_name_the_flag(fields, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(DataConfig(**fields))


def test_malformed_vocab_files(tmp_path):
    bad_json = tmp_path / "vocab.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match=f"--vocab-file {bad_json} is not valid JSON"):
        GPT2BPETokenizer(str(bad_json), MERGES)
    no_eod = tmp_path / "noeod.json"
    no_eod.write_text('{"a": 0}')
    with pytest.raises(ValueError, match="<\\|endoftext\\|>"):
        GPT2BPETokenizer(str(no_eod), MERGES)
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match="--merge-file .* line 2"):
        GPT2BPETokenizer(VOCAB, str(bad_merges))


def test_vocab_size_with_padding():
    assert vocab_size_with_padding(50257, 128) == 50304
    assert vocab_size_with_padding(50257, 128, 2) == 50432
    assert vocab_size_with_padding(258, 128) == 384
    assert vocab_size_with_padding(1001, 128) == 1024
    assert vocab_size_with_padding(1024, 128) == 1024
    assert vocab_size_with_padding(7, 1) == 7
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        vocab_size_with_padding(10, 0)


def test_hugging_face_special_tokens_of_the_template(tmp_path):
    """Megatron encodes with the tokenizer's special-token template by default (Llama's BOS, say) and keeps
    special tokens when decoding; --tokenizer-hf-no-include-special-tokens does neither."""
    tokenizers = hf_tokenizers()
    tok = tokenizers.Tokenizer.from_file(HF_JSON)
    bos = "<|endoftext|>"  # the asset's only special token stands in for a BOS
    bos_id = tok.token_to_id(bos)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    default = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path))
    plain = build_tokenizer(
        DataConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path, tokenizer_hf_no_include_special_tokens=True
        )
    )
    ids = default.tokenize("Hello world")
    assert ids[0] == bos_id and ids[1:] == plain.tokenize("Hello world")
    assert default.detokenize(ids) == bos + "Hello world" and plain.detokenize(ids) == "Hello world"


def test_allow_ambiguous_pad_tokens():
    from types import SimpleNamespace

    from megatron.core.datasets.gpt_dataset import pad_id_to_mask

    colliding = SimpleNamespace(pad=7, eod=7)
    assert pad_id_to_mask(colliding) is None  # Megatron's default: such a pad id masks nothing
    assert pad_id_to_mask(colliding, allow_ambiguous=True) == 7  # --allow-ambiguous-pad-tokens
    assert pad_id_to_mask(SimpleNamespace(pad=3, eod=7)) == 3
    from megatron.core.datasets.builder import build_train_valid_test_datasets
    from megatron.core.tokenizers import NullTokenizer

    tok = NullTokenizer(64, pad_id=63)  # the pad id is the end of document (63)

    def masked(**flags):
        cfg = DataConfig(mock_data=True, split="1,0,0", **flags)
        train = build_train_valid_test_datasets(cfg, tok, seq_length=16, seed=1, num_samples=(40, 0, 0))[0]
        return sum(int((train[i]["loss_mask"] == 0).sum()) for i in range(40))

    assert masked() == 0 and masked(allow_ambiguous_pad_tokens=True) > 0  # ends of documents leave the loss

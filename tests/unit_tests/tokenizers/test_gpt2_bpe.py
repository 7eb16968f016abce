"""GPT-2 pre-tokenisation with the standard re module, the byte alphabet, and the test asset."""

import importlib.util
import json
import os

from megatron.core.tokenizers.gpt2_bpe import bpe_merge, bytes_to_unicode, gpt2_pretokenize_pattern, read_merges

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ASSETS = os.path.join(REPO, "tests", "assets", "tokenizer")


def split(text):
    return gpt2_pretokenize_pattern().findall(text)


def test_pretokenize_like_gpt2():
    assert split("I'm  here 123abc!!") == ["I", "'m", " ", " here", " 123", "abc", "!!"]
    assert split("Hello world\n\n") == ["Hello", " world", "\n\n"]
    assert split("x  \ny") == ["x", "  ", "\n", "y"]  # \s+(?!\S) backs off one char before a non-space
    assert split("they'll'VE") == ["they", "'ll", "'", "VE"]  # contractions are lower-case only
    # Unicode classes: ² and Ⅻ are numbers (No, Nl), é and 東 letters.
    assert split("é²Ⅻ 東x") == ["é", "²Ⅻ", " 東x"]
    # U+001C is not White_Space for GPT-2 (Python's \s would say it is).
    assert split("a \x1c b") == ["a", " \x1c", " b"]
    assert "".join(split("any text\t at all  ")) == "any text\t at all  "


def test_byte_alphabet():
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120" and table[0] == "\u0100"
    assert list(table)[:3] == [ord("!"), ord('"'), ord("#")]  # GPT-2's id order
    assert not any(c.isspace() for c in table.values())


def test_bpe_merge_applies_ranks_in_order():
    ranks = {("a", "b"): 0, ("b", "c"): 1, ("ab", "c"): 2}
    assert bpe_merge(tuple("abc"), ranks) == ("abc",)
    assert bpe_merge(tuple("bcab"), ranks) == ("bc", "ab")
    assert bpe_merge(tuple("aaa"), ranks) == ("a", "a", "a")


def test_asset_is_reproducible_from_the_tool():
    spec = importlib.util.spec_from_file_location("make_tiny_bpe", os.path.join(REPO, "tools", "make_tiny_bpe.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    vocab, merges = tool.train_bpe(tool.DEFAULT_CORPUS, 300)
    with open(os.path.join(ASSETS, "vocab.json"), encoding="utf-8") as f:
        assert json.load(f) == vocab
    assert read_merges(os.path.join(ASSETS, "merges.txt")) == merges

"""GPT-2 byte-level BPE in pure Python (no ``regex``, ``tiktoken`` or ``tokenizers`` needed).

Reads the two files GPT-2 ships, ``vocab.json`` (token string -> id) and ``merges.txt``
(one merge ``"a b"`` per line, best first), and reproduces GPT-2's ids:

1. Pre-tokenisation splits text with GPT-2's pattern
   ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``.
   The standard ``re`` module has no ``\\p{..}`` classes, so the letter and number
   classes are generated once from ``unicodedata`` (about 0.15 s, on first use) and
   whitespace is Unicode's White_Space set, as the ``regex`` module has it.
2. Each piece's UTF-8 bytes are mapped to printable characters (GPT-2's byte alphabet),
   then adjacent symbols are merged by merge rank until no ranked pair is left.

A literal ``"<|endoftext|>"`` in the text becomes the end-of-document id, as upstream's
GPT-2 tokenizer does; no other special token is recognised. The end-of-document id at
the end of each document is appended by the caller (``--append-eod``).
"""

import functools
import json
import re
import unicodedata
from collections.abc import Iterable

EOD_TOKEN = "<|endoftext|>"

# Unicode White_Space property (what the ``regex`` module's \s matches). Python's \s also
# matches U+001C..U+001F, which GPT-2's pattern does not treat as space.
_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
)


def _class_from_ranges(predicate) -> str:
    """Returns the body of a regex character class matching every code point where predicate holds."""
    parts = []
    start = None
    for cp in range(0x110001):
        inside = cp <= 0x10FFFF and predicate(unicodedata.category(chr(cp)))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            end = cp - 1
            parts.append(re.escape(chr(start)) if start == end else f"{re.escape(chr(start))}-{re.escape(chr(end))}")
            start = None
    return "".join(parts)


@functools.lru_cache(maxsize=1)
def gpt2_pretokenize_pattern() -> "re.Pattern[str]":
    """GPT-2's pre-tokenisation regex, compiled for the standard ``re`` module."""
    letters = _class_from_ranges(lambda cat: cat[0] == "L")
    numbers = _class_from_ranges(lambda cat: cat[0] == "N")
    space = re.escape(_WHITESPACE)
    pattern = (
        r"'s|'t|'re|'ve|'m|'ll|'d"
        rf"| ?[{letters}]+"
        rf"| ?[{numbers}]+"
        rf"| ?[^{space}{letters}{numbers}]+"
        rf"|[{space}]+(?![^{space}])"
        rf"|[{space}]+"
    )
    return re.compile(pattern)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte value -> one printable character.

    Bytes that are already printable (and not space) stand for themselves; the other 68
    are given the code points 256, 257, ... in byte order, so no symbol is whitespace or
    a control character and vocab.json stays readable.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    # Order matters to callers that build a vocab: printable bytes first, then the rest.
    return {b: mapping[b] for b in [*printable, *(b for b in range(256) if b not in printable)]}


def bpe_merge(symbols: tuple[str, ...], ranks: dict[tuple[str, str], int]) -> tuple[str, ...]:
    """Applies ranked merges to one pre-tokenised piece until no ranked pair remains.

    Args:
        symbols: The piece as single byte-alphabet characters.
        ranks: Merge pair -> rank (lower merges first).

    Returns:
        The merged symbols.
    """
    word = list(symbols)
    while len(word) > 1:
        best = None
        best_rank = None
        for pair in zip(word, word[1:]):
            rank = ranks.get(pair)
            if rank is not None and (best_rank is None or rank < best_rank):
                best, best_rank = pair, rank
        if best is None:
            break
        merged = []
        i = 0
        while i < len(word):
            # Merge every occurrence of the best pair, left to right, without overlaps.
            if i + 1 < len(word) and word[i] == best[0] and word[i + 1] == best[1]:
                merged.append(best[0] + best[1])
                i += 2
            else:
                merged.append(word[i])
                i += 1
        word = merged
    return tuple(word)


def read_merges(path: str) -> list[tuple[str, str]]:
    """Reads merges.txt: an optional ``#version`` line, then one ``left right`` pair a line."""
    merges = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or (line_no == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"--merge-file {path}: line {line_no} is not a 'left right' pair: {line!r}")
            merges.append((parts[0], parts[1]))
    return merges


class GPT2BPETokenizer:
    """Byte-level BPE from GPT-2 style vocab.json + merges.txt (``--tokenizer-type GPT2BPETokenizer``).

    Args:
        vocab_file: Path to vocab.json (token string -> id).
        merge_file: Path to merges.txt.

    Raises:
        ValueError: A file is missing or malformed, or the vocab has no ``<|endoftext|>``.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder: dict[str, int] = json.load(f)
        except OSError as e:
            raise ValueError(
                f"--vocab-file {vocab_file} cannot be read ({e.strerror}); pass the GPT-2 vocab.json."
            ) from e
        except json.JSONDecodeError as e:
            raise ValueError(f"--vocab-file {vocab_file} is not valid JSON ({e}); pass the GPT-2 vocab.json.") from e
        if not isinstance(self.encoder, dict):
            raise ValueError(f"--vocab-file {vocab_file} must hold a JSON object mapping tokens to ids.")
        try:
            merges = read_merges(merge_file)
        except OSError as e:
            raise ValueError(
                f"--merge-file {merge_file} cannot be read ({e.strerror}); pass the GPT-2 merges.txt."
            ) from e
        if EOD_TOKEN not in self.encoder:
            raise ValueError(
                f"--vocab-file {vocab_file} has no {EOD_TOKEN} token, which GPT2BPETokenizer uses as end of document."
            )
        self.decoder: dict[int, str] = {i: t for t, i in self.encoder.items()}
        self.ranks: dict[tuple[str, str], int] = {pair: r for r, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        missing = [c for c in self.byte_encoder.values() if c not in self.encoder]
        if missing:
            raise ValueError(
                f"--vocab-file {vocab_file} lacks {len(missing)} of the 256 byte tokens; it is not a byte-level BPE vocab."
            )
        self._pattern = gpt2_pretokenize_pattern()
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self.encoder[EOD_TOKEN]

    @property
    def pad(self) -> int:
        # GPT-2 has no pad token; Megatron pads with end-of-document.
        return self.eod

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary token (``<|endoftext|>``, ``<fim_prefix>``, ...), None when there is none."""
        return self.encoder.get(token)

    def _piece_ids(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            symbols = tuple(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids = [self.encoder[s] for s in bpe_merge(symbols, self.ranks)]
            if len(self._cache) < 200_000:
                self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        """Text -> token ids."""
        ids: list[int] = []
        for i, part in enumerate(text.split(EOD_TOKEN)):
            if i:
                ids.append(self.eod)
            for piece in self._pattern.findall(part):
                ids.extend(self._piece_ids(piece))
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Token ids -> text. Ids past the vocabulary (embedding padding) are skipped."""
        out = bytearray()
        for i in ids:
            token = self.decoder.get(int(i))
            if token is None:
                continue
            if all(c in self.byte_decoder for c in token):
                out.extend(self.byte_decoder[c] for c in token)
            else:
                # An added token written in plain text (not in the byte alphabet).
                out.extend(token.encode("utf-8"))
        return out.decode("utf-8", errors="replace")

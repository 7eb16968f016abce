"""SentencePiece tokenizers: ``--tokenizer-type SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``
and ``Llama2Tokenizer`` over a ``--tokenizer-model`` file (``*.model``).

Current Megatron builds all three names the same way (its core ``SentencePieceTokenizer``), and so
does this file:

- the vocabulary is the model's pieces, ids ``0..N-1``; nothing is added, so ``vocab_size`` is the
  model's piece count (``--vocab-extra-ids`` is not read);
- ``eod`` is the model's end-of-sentence id (``eos``), ``bos``/``pad``/``unk`` are the model's ids
  (``-1`` where the model has none: a Llama-2 model has no pad);
- ``tokenize`` is the model's plain encoding: no BOS or EOS is added (Llama2Tokenizer included; the
  end-of-document id is appended by ``--append-eod``); ``detokenize`` is the model's decoding.

Two upstream switches change that. ``--tokenizer-sentencepiece-legacy`` with
``--tokenizer-special-tokens T ...`` adds the tokens the model does not have as new ids after its
pieces (in the order given; those it has keep their ids), splits the text at each of them before
encoding (dropping a lone ``▁`` piece right after one), and decodes them as words separated by single
spaces. ``--no-tokenizer-sentencepiece-ignore-extra-whitespaces`` keeps runs of spaces visible to a
model that collapses them, through upstream's marker trick (a ``☯`` placed between doubled spaces, each
part encoded with the marker and the marker's id dropped). Unusual here: on a byte-fallback model the
marker is three byte pieces and all three are dropped (upstream drops the last only, leaving two stray
bytes in the ids).

Megatron's legacy tokenizers (removed in 2026-02) gave these names other vocabularies (SentencePieceTokenizer
added ``<CLS> <SEP> <EOD> <MASK>`` and ``--vocab-extra-ids`` sentinels; Llama2Tokenizer prepended BOS);
runs of that code are not reproduced. The ``sentencepiece`` package is optional and imported only here.
"""

import re
from collections.abc import Iterable, Sequence

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")

# Upstream's marker for a kept space: a symbol no tokenizer is likely to have as a piece.
_SPACE_MARK = "☯"
_DOUBLE_OR_EDGE_SPACE = re.compile(r"(?<= )(?= )|^ | $")
_WORD_SEPARATOR = "▁"  # SentencePiece's whitespace symbol


def _import_sentencepiece(tokenizer_type: str):
    try:
        import sentencepiece
    except ImportError:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} needs the optional 'sentencepiece' package: pip install sentencepiece."
        ) from None
    return sentencepiece


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file as Megatron's SentencePiece tokenizer types read it (module docstring).

    Args:
        model_file: ``--tokenizer-model``: a SentencePiece model file.
        tokenizer_type: The ``--tokenizer-type`` name (for messages; the three names behave the same).
        legacy: ``--tokenizer-sentencepiece-legacy``: allow ``special_tokens``.
        special_tokens: ``--tokenizer-special-tokens``: tokens matched in the text before encoding.
        ignore_extra_whitespaces: False for ``--no-tokenizer-sentencepiece-ignore-extra-whitespaces``.

    Raises:
        ValueError: sentencepiece is not installed, the file is no SentencePiece model, or special
            tokens were given without ``legacy`` (or one is empty).
    """

    def __init__(
        self,
        model_file: str,
        *,
        tokenizer_type: str = "SentencePieceTokenizer",
        legacy: bool = False,
        special_tokens: Sequence[str] = (),
        ignore_extra_whitespaces: bool = True,
    ):
        spm = _import_sentencepiece(tokenizer_type)
        if special_tokens and not legacy:
            raise ValueError(
                f"--tokenizer-special-tokens needs --tokenizer-sentencepiece-legacy with --tokenizer-type "
                f"{tokenizer_type} (Megatron's rule); add the switch or drop the tokens."
            )
        if any(not token for token in special_tokens):
            raise ValueError("--tokenizer-special-tokens holds an empty token; drop it.")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(model_file)
        except (OSError, RuntimeError) as e:
            raise ValueError(
                f"--tokenizer-model {model_file} cannot be loaded as a SentencePiece model ({e}); "
                f"--tokenizer-type {tokenizer_type} reads a SentencePiece .model file."
            ) from e
        self.model_file = model_file
        self.legacy = legacy
        self.ignore_extra_whitespaces = ignore_extra_whitespaces
        self._num_pieces = self._sp.get_piece_size()
        self._vocab_size = self._num_pieces
        self._special: dict[str, int] = {}  # legacy special token -> id, in the order given
        for token in special_tokens:
            self._add_special_token(token)
        self._special_names = {i: t for t, i in self._special.items()}
        self._separator_id = self._sp.piece_to_id(_WORD_SEPARATOR)
        # With byte fallback the marker is encoded as its three UTF-8 byte pieces, not as one unk.
        marker = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE_MARK.encode("utf-8")]
        self._marker_byte_ids = marker if all(self._sp.is_byte(i) for i in marker) else None
        # A model trained to collapse whitespace encodes "x  y" as "x y".
        self.removed_extra_spaces = self._sp.encode_as_pieces("x  y") == self._sp.encode_as_pieces("x y")

    def _add_special_token(self, token: str) -> None:
        unk = self._sp.unk_id()
        piece_id = self._sp.piece_to_id(token)
        if piece_id != unk:
            self._special[token] = piece_id
        elif token not in self._special:
            # Upstream's rule: a token the model maps to unk (its unk piece too) gets the next new id.
            self._special[token] = self._vocab_size
            self._vocab_size += 1

    @property
    def vocab_size(self) -> int:
        """The model's pieces plus the legacy special tokens it did not have."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """End of document: the model's end-of-sentence id (-1 when the model has none)."""
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        """The model's pad id; -1 when it has none."""
        return self._sp.pad_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    def token_to_id(self, token: str) -> int | None:
        """The id of a piece or legacy special token; None when the model would map it to unk."""
        if token in self._special:
            return self._special[token]
        piece_id = self._sp.piece_to_id(token)
        if piece_id == self._sp.unk_id() and token != self._sp.id_to_piece(piece_id):
            return None
        return piece_id

    def _mark_extra_spaces(self, text: str) -> str:
        return _DOUBLE_OR_EDGE_SPACE.sub(f" {_SPACE_MARK} ", text)

    def _encode_keeping_spaces(self, text: str) -> list[int]:
        # Each part carries the marker, so its trailing space is encoded as a piece; the marker's ids go.
        ids: list[int] = []
        for part in text.split(_SPACE_MARK):
            if part:
                part_ids = self._sp.encode_as_ids(part + _SPACE_MARK)
                marker = self._marker_byte_ids
                drop = len(marker) if marker and part_ids[-len(marker) :] == marker else 1
                ids.extend(part_ids[:-drop])
        return ids

    def tokenize(self, text: str) -> list[int]:
        """Text -> ids (the model's encoding; see the module docstring for the two switches)."""
        keep_spaces = self.removed_extra_spaces and not self.ignore_extra_whitespaces
        if keep_spaces:
            text = self._mark_extra_spaces(text).rstrip()
        ids: list[int] = []
        if self.legacy:
            start = 0
            while True:
                found = {t: text.find(t, start) for t in self._special}
                found = {t: i for t, i in found.items() if i >= 0}
                if not found:
                    break
                token = min(found, key=found.get)  # the earliest; ties go to the token given first
                piece_ids = self._sp.encode_as_ids(text[start : found[token]])
                if ids and ids[-1] in self._special_names and piece_ids and piece_ids[0] == self._separator_id:
                    piece_ids = piece_ids[1:]  # "<tok> word": no lone separator piece after a special token
                ids.extend(piece_ids)
                ids.append(self._special[token])
                start = found[token] + len(token)
            text = text[start:]
        ids.extend(self._encode_keeping_spaces(text) if keep_spaces else self._sp.encode_as_ids(text))
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Ids -> text. Legacy: special tokens as words between single spaces, the ends stripped."""
        ids = [int(i) for i in ids]
        if not self.legacy:
            return self._sp.decode_ids(ids)
        text, start = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self._special_names:
                text += self._sp.decode_ids(ids[start:i]) + " " + self._special_names[token_id] + " "
                start = i + 1
        text += self._sp.decode_ids(ids[start:])
        return text.strip()

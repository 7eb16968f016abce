"""Tokenizers selected by ``--tokenizer-type``, and vocabulary padding.

Every tokenizer has the same small surface: ``vocab_size`` (unpadded), ``eod``,
``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``. The core needs no
tokenizer package: NullTokenizer, ByteLevelTokenizer and GPT2BPETokenizer are pure
Python; only HuggingFaceTokenizer imports the optional ``tokenizers`` package and the
SentencePiece types (``sentencepiece_tokenizer.py``) the optional ``sentencepiece``
package, and only when they are asked for.

NullTokenizer follows current Megatron: ``--vocab-size N`` is the whole vocabulary,
ids ``0..N-1``, and the last one, ``N-1``, is the end-of-document id. (Megatron before
2026-04 read N as the text ids and added end-of-document as N; pass ``--vocab-size N+1``
to reproduce such a run's vocabulary.)
"""

import json
import math
import os
from collections.abc import Iterable

from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.metadata import check_tokenizer_type, read_metadata
from megatron.core.tokenizers.sentencepiece_tokenizer import SENTENCEPIECE_TYPES, SentencePieceTokenizer

TOKENIZER_TYPES = (
    "NullTokenizer",
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    *SENTENCEPIECE_TYPES,
)


class NullTokenizer:
    """Text is space-separated integer ids (``--tokenizer-type NullTokenizer --vocab-size N``).

    Args:
        vocab_size: Megatron's ``--vocab-size``: the whole vocabulary, end-of-document included.
        eod_id: ``--null-tokenizer-eod-id`` (None: ``vocab_size - 1``).
        pad_id: ``--null-tokenizer-pad-id`` (-1: no pad id).
    """

    def __init__(self, vocab_size: int, eod_id: int | None = None, pad_id: int = -1):
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size N with N >= 2, got {vocab_size}.")
        self._vocab_size = int(vocab_size)
        self._eod = self._vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= self._eod < self._vocab_size:
            raise ValueError(f"--null-tokenizer-eod-id {eod_id} is outside [0, --vocab-size {vocab_size}).")
        if not -1 <= pad_id < self._vocab_size:
            raise ValueError(f"--null-tokenizer-pad-id {pad_id} is outside [0, --vocab-size {vocab_size}) (-1: none).")
        self._pad = int(pad_id)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        """``"3 1 4"`` -> ``[3, 1, 4]``; any whitespace separates ids."""
        ids = []
        for word in text.split():
            try:
                value = int(word)
            except ValueError:
                raise ValueError(f"NullTokenizer reads space-separated integers, got {word!r} in the text.") from None
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"NullTokenizer id {value} is outside [0, {self.vocab_size}); raise --vocab-size.")
            ids.append(value)
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def token_to_id(self, token: str) -> int | None:
        """Ids have no names here: always None."""
        return None


class ByteLevelTokenizer:
    """UTF-8 bytes as ids 0..255, plus ``<eod>`` = 256 and ``<pad>`` = 257 (vocab 258).

    Needs no files and round-trips any text. Special ids are never produced by
    ``tokenize``; ``detokenize`` writes them as ``<eod>`` / ``<pad>``.
    """

    EOD = 256
    PAD = 257

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def pad(self) -> int:
        return self.PAD

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_to_id(self, token: str) -> int | None:
        """``<eod>`` and ``<pad>``; None for any other name."""
        return {"<eod>": self.EOD, "<pad>": self.PAD}.get(token)

    def detokenize(self, ids: Iterable[int]) -> str:
        out = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            # Decode the bytes collected so far, so a special id never splits a character.
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append({self.EOD: "<eod>", self.PAD: "<pad>"}.get(i, ""))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


# End-of-document names tried, in order, when tokenizer_config.json does not name eos_token.
_HF_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<eod>", "[SEP]")


class HuggingFaceTokenizer:
    """A local Hugging Face ``tokenizer.json`` (``--tokenizer-model``), through the ``tokenizers`` package.

    The end-of-document id is the ``eos_token`` of a ``tokenizer_config.json`` next to
    the file when there is one, else the first of ``<|endoftext|>``, ``</s>``,
    ``<|end_of_text|>``, ``<eos>``, ... found in the vocabulary.

    Args:
        path: Path to tokenizer.json (or a folder holding one).
        include_special_tokens: Encode with the special tokens the tokenizer's template adds (a BOS,
            say) and decode keeping special tokens, as Megatron's default; False is
            ``--tokenizer-hf-no-include-special-tokens``.
    """

    def __init__(self, path: str, include_special_tokens: bool = True):
        self.include_special_tokens = include_special_tokens
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(
                "--tokenizer-type HuggingFaceTokenizer needs the optional 'tokenizers' package: "
                "pip install tokenizers (or use GPT2BPETokenizer with --vocab-file/--merge-file)."
            ) from None
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model {path} does not exist; pass the path of a tokenizer.json.")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"--tokenizer-model {path} cannot be loaded as a tokenizer.json: {e}") from e
        self._eod = self._find_eod(path)

    def _find_eod(self, path: str) -> int:
        names = []
        config_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        names.extend(_HF_EOD_CANDIDATES)
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ValueError(
            f"--tokenizer-model {path} has no end-of-document token (looked for {', '.join(names)}); "
            "add one as a special token or set eos_token in tokenizer_config.json."
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=self.include_special_tokens).ids)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary (or added) token, None when there is none."""
        return self._tok.token_to_id(token)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=not self.include_special_tokens)


def _looks_like_hub_name(path: str) -> bool:
    """``org/name`` (Megatron passes such names to transformers, which downloads them)."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and not path.endswith(".json")


def _require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if not path:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag} PATH.")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path} does not exist or is not a file.")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {path} is not readable.")
    return path


def build_tokenizer(data_config):
    """Builds the tokenizer that ``--tokenizer-type`` names.

    Args:
        data_config: A ``DataConfig`` (only the tokenizer fields are read).

    Returns:
        A tokenizer with ``vocab_size`` (unpadded), ``eod``, ``tokenize`` and ``detokenize``.

    Raises:
        ValueError: Unknown type, a missing/unreadable vocab, merge or model file, or a
            ``--tokenizer-metadata`` file that is unreadable or names another library (``metadata.py``).
    """
    kind = data_config.tokenizer_type
    if data_config.tokenizer_metadata:
        check_tokenizer_type(read_metadata(data_config.tokenizer_metadata), kind)
    if kind == "NullTokenizer":
        return NullTokenizer(
            data_config.vocab_size,
            eod_id=getattr(data_config, "null_tokenizer_eod_id", None),
            pad_id=getattr(data_config, "null_tokenizer_pad_id", -1),
        )
    if kind == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if kind == "GPT2BPETokenizer":
        vocab = _require_file(data_config.vocab_file, "--vocab-file", kind)
        merges = _require_file(data_config.merge_file, "--merge-file", kind)
        return GPT2BPETokenizer(vocab, merges)
    if kind == "HuggingFaceTokenizer":
        path = data_config.tokenizer_model
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        elif path and not os.path.exists(path) and _looks_like_hub_name(path):
            raise ValueError(
                f"--tokenizer-model {path} is no local file or folder, and this trainer does not download from the "
                f"Hugging Face Hub: fetch it first (e.g. huggingface-cli download {path} tokenizer.json "
                "tokenizer_config.json --local-dir DIR) and pass DIR; or, for mock or pretokenized data, use "
                "--tokenizer-type NullTokenizer --vocab-size N."
            )
        include = not getattr(data_config, "tokenizer_hf_no_include_special_tokens", False)
        return HuggingFaceTokenizer(_require_file(path, "--tokenizer-model", kind), include_special_tokens=include)
    if kind in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(
            _require_file(data_config.tokenizer_model, "--tokenizer-model", kind),
            tokenizer_type=kind,
            legacy=data_config.tokenizer_sentencepiece_legacy,
            special_tokens=data_config.tokenizer_special_tokens or (),
            ignore_extra_whitespaces=data_config.tokenizer_sentencepiece_ignore_extra_whitespaces,
        )
    raise ValueError(f"--tokenizer-type {kind} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}.")


def vocab_size_with_padding(
    orig_vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int = 1
) -> int:
    """Pads the vocabulary so the embedding splits evenly (Megatron's rule).

    The padded size is the smallest multiple of ``make_vocab_size_divisible_by * TP``
    that is >= ``orig_vocab_size``.

    Args:
        orig_vocab_size: ``tokenizer.vocab_size``.
        make_vocab_size_divisible_by: ``--make-vocab-size-divisible-by``.
        tensor_model_parallel_size: ``--tensor-model-parallel-size``.
    """
    if make_vocab_size_divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got {make_vocab_size_divisible_by}.")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(orig_vocab_size / multiple) * multiple)

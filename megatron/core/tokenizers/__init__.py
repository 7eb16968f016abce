"""Tokenizers: ``build_tokenizer(data_config)``, ``vocab_size_with_padding`` and metadata files
(``write_metadata`` / ``read_metadata`` for ``--tokenizer-metadata``)."""

from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.metadata import TokenizerMetadata, read_metadata, write_metadata
from megatron.core.tokenizers.sentencepiece_tokenizer import SENTENCEPIECE_TYPES, SentencePieceTokenizer
from megatron.core.tokenizers.tokenizer import (
    TOKENIZER_TYPES,
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)

__all__ = [
    "TOKENIZER_TYPES",
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SENTENCEPIECE_TYPES",
    "SentencePieceTokenizer",
    "TokenizerMetadata",
    "build_tokenizer",
    "read_metadata",
    "vocab_size_with_padding",
    "write_metadata",
]

"""Tokenizers: ``build_tokenizer(data_config)`` and ``vocab_size_with_padding``."""

from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
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
    "build_tokenizer",
    "vocab_size_with_padding",
]

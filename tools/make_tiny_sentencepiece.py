"""Trains a tiny SentencePiece model offline and writes it (``tests/assets/tokenizer/tokenizer.model``).

This is how the SentencePiece test asset was made; it needs the optional ``sentencepiece``
package and nothing outside this repo:

    python tools/make_tiny_sentencepiece.py --output tests/assets/tokenizer/tokenizer.model

The model is shaped like Llama 2's: BPE with byte fallback (any text round-trips), no text
normalisation, spaces kept as they are, digits split, ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2
and no pad piece. It is trained on the built-in corpus of ``tools/make_tiny_bpe.py`` with one
thread, which makes the output the same bytes on every run (``train_sentencepiece`` takes other
options for test variants).
"""

import argparse
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_tiny_bpe import DEFAULT_CORPUS  # noqa: E402

LLAMA_LIKE = {
    "model_type": "bpe",
    "byte_fallback": True,
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "split_digits": True,
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": -1,
}


def train_sentencepiece(text: str = DEFAULT_CORPUS, vocab_size: int = 512, **options) -> bytes:
    """Trains a SentencePiece model on ``text`` (one sentence a line) and returns the model file's bytes.

    Args:
        text: Training text.
        vocab_size: Number of pieces.
        **options: SentencePiece trainer options that replace the Llama-like defaults.
    """
    import sentencepiece

    settings = {**LLAMA_LIKE, **options}
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()),
        model_writer=out,
        vocab_size=vocab_size,
        num_threads=1,
        minloglevel=2,
        **settings,
    )
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="tests/assets/tokenizer/tokenizer.model")
    parser.add_argument("--input", default=None, help="Training text (default: the built-in corpus).")
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    text = DEFAULT_CORPUS
    if args.input:
        with open(args.input, encoding="utf-8") as f:
            text = f.read()
    model = train_sentencepiece(text, args.vocab_size)
    with open(args.output, "wb") as f:
        f.write(model)
    print(f"wrote {args.output}: {args.vocab_size} pieces, {len(model)} bytes")


if __name__ == "__main__":
    main()

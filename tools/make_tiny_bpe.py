"""Trains a tiny GPT-2-style byte-level BPE offline and writes vocab.json + merges.txt.

This is how ``tests/assets/tokenizer/`` was made; it needs nothing beyond this repo.
When the optional ``tokenizers`` package is installed it also writes an equivalent
``tokenizer.json`` for ``--tokenizer-type HuggingFaceTokenizer``.

    python tools/make_tiny_bpe.py --output-dir tests/assets/tokenizer [--input corpus.txt] [--num-merges 300]

Training is the textbook loop: pre-tokenise with GPT-2's pattern, map bytes to GPT-2's
byte alphabet, then repeatedly merge the most frequent adjacent pair (ties broken by the
pair's text, so the output is deterministic). Ids: the 256 byte symbols in GPT-2 order,
then one id per merge, then ``<|endoftext|>``. It is meant for test assets and toy runs,
not for real corpora (it recounts pairs each step).
"""

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.tokenizers.gpt2_bpe import EOD_TOKEN, bytes_to_unicode, gpt2_pretokenize_pattern  # noqa: E402

# A small built-in corpus (written for this repo), with digits, punctuation and non-ASCII text.
DEFAULT_CORPUS = """\
The little train left the station at 7:15 every morning, and the people of the valley
set their clocks by it. It carried milk, letters, and the baker's bread to the towns
along the river. When it snowed, the driver sang to keep awake; when it rained, he told
stories to the passengers who sat near the front.
In 1998 the line was nearly closed. The town held a meeting, and 342 people came. They
said the train was not only a train: it was the way the valley talked to itself. The
council listened, counted the votes, and kept the line open for another twenty years.
Today the train is older, slower and louder than ever. It still leaves at 7:15. The
children still wave at it. The driver's daughter drives it now, and she sings too.
Recipes travel the same way. A café in the next town serves a naïve little cake that
everyone loves; the recipe came from a letter sent on the train in 1971. Grüße aus dem
Tal, the letter began. Nobody in the café speaks German, but they all know those words.
Numbers are tokens too: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2,718 -42 +7 50%.
Code looks like this: def add(a, b): return a + b  # adds two numbers
Punctuation matters!? "Quotes", 'single quotes', (parentheses), [brackets], {braces}.
Tabs\tand  double  spaces and new lines
are whitespace; so are    runs of spaces at the end of a line.
東京 and Κρήτη and Москва are place names; emoji like 🚂 are four bytes in UTF-8.
"""


def train_bpe(text: str, num_merges: int):
    """Returns (vocab dict token->id, merges list of pairs) trained on text."""
    byte_map = bytes_to_unicode()
    words = collections.Counter(gpt2_pretokenize_pattern().findall(text))
    corpus = {tuple(byte_map[b] for b in w.encode("utf-8")): n for w, n in words.items()}
    merges = []
    for _ in range(num_merges):
        pairs = collections.Counter()
        for symbols, n in corpus.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merges.append(best)
        merged = {}
        for symbols, n in corpus.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        corpus = merged
    vocab = {}
    for symbol in byte_map.values():
        vocab[symbol] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab[EOD_TOKEN] = len(vocab)
    return vocab, merges


def write_files(vocab, merges, output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False, indent=0)
        f.write("\n")
    with open(os.path.join(output_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for left, right in merges:
            f.write(f"{left} {right}\n")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        print("tokenizers is not installed: wrote vocab.json and merges.txt only")
        return
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOD_TOKEN])
    tok.save(os.path.join(output_dir, "tokenizer.json"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="Folder for vocab.json, merges.txt (and tokenizer.json).")
    parser.add_argument(
        "--input", default=None, help="UTF-8 text file to train on (default: a built-in paragraph set)."
    )
    parser.add_argument(
        "--num-merges", type=int, default=300, help="Number of merges to learn (fewer if pairs run out)."
    )
    args = parser.parse_args(argv)
    text = DEFAULT_CORPUS
    if args.input is not None:
        if not os.path.isfile(args.input):
            raise SystemExit(f"--input {args.input} does not exist.")
        with open(args.input, encoding="utf-8") as f:
            text = f.read()
    vocab, merges = train_bpe(text, args.num_merges)
    write_files(vocab, merges, args.output_dir)
    print(f"wrote {len(vocab)} tokens ({len(merges)} merges) to {args.output_dir}")


if __name__ == "__main__":
    main()

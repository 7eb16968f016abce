"""Tokenises a JSONL corpus into Megatron's indexed dataset (``.bin`` + ``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 8

Each input line is one JSON object; the text under each ``--json-keys`` key (default
``text``) becomes one document of ``{output-prefix}_{key}_document.bin/.idx``, which is
what ``--data-path {output-prefix}_{key}_document`` reads. Same flags as Megatron's tool.

Lines are tokenised by a pool of ``--workers`` processes (``imap`` in chunks, so the
output order is the input order); with one worker no pool is started. Output files
appear only when the whole input was processed (see ``IndexedDatasetBuilder``). Progress
goes to a tqdm bar when tqdm is installed, else to a line every ``--log-interval``
documents.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, optimal_dtype  # noqa: E402
from megatron.core.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron.training.data_config import DataConfig  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # optional: fall back to periodic log lines
    tqdm = None


# Each process builds its tokenizer once; a module global survives the Encoder being
# pickled again with every chunk of work the pool hands out.
_TOKENIZER = None


class Encoder:
    """Turns one input line into token ids per key."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def initializer(self) -> None:
        global _TOKENIZER
        _TOKENIZER = build_tokenizer(_data_config(self.args))

    @property
    def tokenizer(self):
        if _TOKENIZER is None:
            self.initializer()
        return _TOKENIZER

    def encode(self, numbered_line):
        """(line number, raw line) -> (line number, {key: ids}, bytes read); None ids for blank lines."""
        line_no, line = numbered_line
        if not line.strip():
            return line_no, None, len(line)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{self.args.input}: line {line_no} is not valid JSON ({e.msg}, column {e.colno})."
            ) from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{self.args.input}: line {line_no} is a JSON {type(record).__name__}, expected an object."
            )
        out = {}
        for key in self.args.json_keys:
            if key not in record:
                raise ValueError(
                    f"{self.args.input}: line {line_no} has no key {key!r} (keys: {sorted(record)}); "
                    "choose the text field with --json-keys."
                )
            text = record[key]
            # A list holds the document's sentences: one sequence each (empty ones dropped), as Megatron.
            pieces = text if isinstance(text, list) else [text]
            ids, lengths = [], []
            for piece in pieces:
                if not isinstance(piece, str):
                    raise ValueError(
                        f"{self.args.input}: line {line_no}: {key!r} holds a {type(piece).__name__}, "
                        "expected a string or a list of strings."
                    )
                piece_ids = self.tokenizer.tokenize(piece)
                if piece_ids:
                    ids.extend(piece_ids)
                    lengths.append(len(piece_ids))
            if ids and self.args.append_eod:
                ids.append(self.tokenizer.eod)
                lengths[-1] += 1
            out[key] = (ids, lengths)
        return line_no, out, len(line)


def _data_config(args: argparse.Namespace) -> DataConfig:
    return DataConfig(
        tokenizer_type=args.tokenizer_type,
        vocab_size=args.vocab_size,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        tokenizer_metadata=args.tokenizer_metadata,
        tokenizer_sentencepiece_legacy=args.tokenizer_sentencepiece_legacy,
        tokenizer_special_tokens=args.tokenizer_special_tokens or [],
        tokenizer_sentencepiece_ignore_extra_whitespaces=args.tokenizer_sentencepiece_ignore_extra_whitespaces,
    )


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Tokenise JSONL into Megatron .bin/.idx files.")
    group = parser.add_argument_group("input")
    group.add_argument("--input", required=True, help="JSONL file, one JSON object per line.")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="Keys whose text to tokenise (one output per key)."
    )
    group.add_argument("--split-sentences", action="store_true", help="Not supported (Megatron uses nltk for it).")
    group.add_argument("--keep-newlines", action="store_true", help="Accepted: it only matters with --split-sentences.")
    group.add_argument("--lang", default="english", help="Accepted: the nltk language of --split-sentences.")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (GPT2BPETokenizer).")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (GPT2BPETokenizer).")
    group.add_argument(
        "--tokenizer-model", default=None, help="tokenizer.json (HuggingFaceTokenizer) or a SentencePiece .model file."
    )
    group.add_argument(
        "--tokenizer-metadata",
        default=None,
        help="Tokenizer metadata JSON (megatron.core.tokenizers.write_metadata); its library must be the one "
        "--tokenizer-type reads.",
    )
    group.add_argument(
        "--tokenizer-sentencepiece-legacy",
        action="store_true",
        help="SentencePiece types: allow --tokenizer-special-tokens.",
    )
    group.add_argument(
        "--tokenizer-special-tokens",
        nargs="+",
        default=None,
        help="SentencePiece types with --tokenizer-sentencepiece-legacy: special tokens, in id order.",
    )
    group.add_argument(
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
        dest="tokenizer_sentencepiece_ignore_extra_whitespaces",
        action="store_false",
        help="SentencePiece types: keep runs of spaces visible to a model that collapses them.",
    )
    group.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size (NullTokenizer).")
    group.add_argument(
        "--append-eod", action="store_true", help="Append the end-of-document id to every non-empty document."
    )
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="Writes {prefix}_{key}_document.bin/.idx.")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="Tokenizer processes.")
    group.add_argument("--chunk-size", type=int, default=64, help="Lines handed to a worker at a time.")
    group.add_argument(
        "--log-interval", type=int, default=10000, help="Documents between progress lines (without tqdm)."
    )
    group.add_argument(
        "--partitions", type=int, default=1, help="Accepted: the input is read as one partition (same output)."
    )
    group.add_argument(
        "--keep-sequential-samples", action="store_true", help="Accepted: documents always keep the input order."
    )
    group.add_argument(
        "--vocab-extra-ids", type=int, default=0, help="Accepted and ignored, as Megatron's tool does (it sets 0)."
    )
    args = parser.parse_args(argv)
    if args.split_sentences:
        parser.error("--split-sentences is not supported; drop it (documents are tokenised whole).")
    if args.partitions < 1:
        parser.error(f"--partitions must be >= 1, got {args.partitions}.")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}.")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}.")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input} does not exist.")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        parser.error(f"--output-prefix {args.output_prefix}: folder {out_dir} does not exist.")
    return args


def main(argv=None) -> None:
    args = get_args(argv)
    try:
        tokenizer = build_tokenizer(_data_config(args))  # fail fast, before any worker starts
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.append_eod and tokenizer.eod < 0:
        raise SystemExit(
            f"error: --append-eod: --tokenizer-type {args.tokenizer_type} has no end-of-document id here "
            f"(the model in --tokenizer-model {args.tokenizer_model} has no end-of-sentence piece); drop --append-eod "
            "or use a model with one."
        )
    dtype = optimal_dtype(tokenizer.vocab_size)
    paths = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(p + ".bin", dtype) for key, p in paths.items()}
    encoder = Encoder(args)
    total_bytes = os.path.getsize(args.input)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing") if tqdm is not None else None
    start = time.time()
    docs = tokens = read = 0
    pool = None
    try:
        with open(args.input, encoding="utf-8") as fin:
            numbered = enumerate(fin, start=1)
            if args.workers == 1:
                encoder.initializer()
                results = map(encoder.encode, numbered)
            else:
                pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
                results = pool.imap(encoder.encode, numbered, args.chunk_size)
            for _, ids_by_key, nbytes in results:
                read += nbytes
                if bar is not None:
                    bar.update(nbytes)
                if ids_by_key is None:
                    continue
                for key, (ids, lengths) in ids_by_key.items():
                    builders[key].add_document(ids, lengths)
                    tokens += len(ids)
                docs += 1
                if bar is None and docs % args.log_interval == 0:
                    elapsed = time.time() - start
                    print(
                        f"processed {docs} documents ({docs / elapsed:.1f} docs/s, {read / elapsed / 2**20:.2f} MB/s)",
                        flush=True,
                    )
        if tokens == 0:
            what = (
                "no documents (it is empty or every line is blank)" if docs == 0 else f"{docs} documents but no tokens"
            )
            raise ValueError(f"--input {args.input} holds {what}; no dataset was written. Pass a JSONL file with text.")
        for key, path in paths.items():
            builders[key].finalize(path + ".idx")
    except BaseException as e:
        for builder in builders.values():
            builder.abort()
        if isinstance(e, UnicodeDecodeError):
            raise SystemExit(
                f"error: --input {args.input} is not UTF-8 text ({e.reason} at byte {e.start} of a read block)."
            ) from None
        if isinstance(e, ValueError):
            raise SystemExit(f"error: {e}") from None
        raise
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    elapsed = time.time() - start
    print(
        f"done: {docs} documents, {tokens} tokens in {elapsed:.1f} s; wrote "
        + ", ".join(p + ".bin/.idx" for p in paths.values())
    )


if __name__ == "__main__":
    main()

"""``--tokenizer-metadata``: metadata files written, read, checked, and the tokenizers they give.

A file for each library gives the tokenizer the flags alone give (ids, end-of-document, pad,
vocabulary size and its padding); bad, missing and foreign files fail with a ValueError that
names the flag, the file, the field and the fix.
"""

import json
import os
from types import SimpleNamespace

import pytest

from megatron.core.tokenizers import TokenizerMetadata, build_tokenizer, read_metadata, write_metadata
from megatron.core.tokenizers.metadata import (
    DEFAULT_CLASS_NAME,
    DEFAULT_CLASS_PATHS,
    LIBRARIES,
    UPSTREAM_TEXT_LIBRARIES,
    UPSTREAM_VISION_LIBRARIES,
    default_metadata_path,
)
from megatron.training.arguments import parse_args
from megatron.training.data import setup_tokenizer
from megatron.training.data_config import DataConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ASSETS = os.path.join(REPO, "tests", "assets", "tokenizer")
VOCAB, MERGES, HF_JSON, SP_MODEL = (
    os.path.join(ASSETS, f) for f in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer.model")
)
TEXTS = ["", "Hello world", "The train left at 7:15.\n\n  Twice!", "café naïve 東京 🚂", "tabs\tand   spaces  "]
BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--mock-data"]  # fmt: skip

# (library, the flags of the equivalent command line, the tokenizer file the metadata goes beside,
#  the optional package the tokenizer needs)
CASES = {
    "huggingface": (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", ASSETS], HF_JSON, "tokenizers"),
    "sentencepiece": (
        ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", SP_MODEL]
        + ["--tokenizer-sentencepiece-legacy", "--tokenizer-special-tokens", "<CLS>", "<s>"],
        SP_MODEL,
        "sentencepiece",
    ),
    "megatron": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES], VOCAB, None),
    "null-text": (["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"], ASSETS, None),
}


def _needs(package):
    if package is None:
        return
    module = pytest.importorskip(package)
    if package == "tokenizers" and not hasattr(module, "Tokenizer"):  # this test folder shadows it
        pytest.skip("the optional 'tokenizers' package is not installed")


def _validate(argv):
    cfg = parse_args(BASE + argv).resolve(world_size=1)
    cfg.validate()
    return cfg


def _text(library: str, text: str) -> str:
    """NullTokenizer reads ids, the others text."""
    return " ".join(str(b % 999) for b in text.encode()) if library == "null-text" else text


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("library", list(CASES))
def test_metadata_gives_the_flags_tokenizer(library, tp, tmp_path):
    flags, beside, package = CASES[library]
    _needs(package)
    path = write_metadata(beside, library, metadata_path=str(tmp_path / "meta.json"))
    divisor = ["--make-vocab-size-divisible-by", "96"]
    plain = _validate(flags + divisor)
    with_file = _validate(flags + divisor + ["--tokenizer-metadata", path])
    assert with_file.data.tokenizer_metadata == path and plain.data.tokenizer_metadata is None
    pg = SimpleNamespace(tp_size=tp)
    want, got = setup_tokenizer(plain, pg), setup_tokenizer(with_file, pg)
    assert type(got) is type(want)
    assert (got.vocab_size, got.eod, got.pad) == (want.vocab_size, want.eod, want.pad)
    assert with_file.model.vocab_size == plain.model.vocab_size
    assert plain.model.vocab_size % (96 * tp) == 0 and plain.model.vocab_size >= want.vocab_size
    for text in TEXTS:
        ids = want.tokenize(_text(library, text))
        assert got.tokenize(_text(library, text)) == ids
        assert got.detokenize(ids) == want.detokenize(ids)


def test_write_metadata_writes_upstreams_fields(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(b"x")
    # Beside a file, or inside a folder: upstream's default place.
    beside = write_metadata(str(folder / "tokenizer.model"), "sentencepiece", chat_template="{{ m }}")
    assert beside == str(folder / "tokenizer_metadata.json") == default_metadata_path(str(folder))
    data = json.loads((folder / "tokenizer_metadata.json").read_text())
    assert data == {
        "library": "sentencepiece",
        "class_name": "MegatronTokenizerText",
        "class_path": "megatron.core.tokenizers.text.text_tokenizer",
        "chat_template": "{{ m }}",
    }
    assert read_metadata(beside) == TokenizerMetadata("sentencepiece", "{{ m }}", beside)
    with pytest.raises(ValueError, match="exists; pass overwrite=True"):
        write_metadata(str(folder), "huggingface")
    write_metadata(str(folder), "huggingface", overwrite=True)
    assert read_metadata(beside) == TokenizerMetadata("huggingface", None, beside)


@pytest.mark.parametrize(
    "args, message",
    [
        (("/no/such/tokenizer.json", "huggingface"), "tokenizer_path /no/such/tokenizer.json does not exist"),
        ((HF_JSON, "tiktoken"), "tokenizer_library names library 'tiktoken': TikToken .* not supported yet"),
        ((HF_JSON, "HuggingFace"), "'HuggingFace', which is no tokenizer library .*use one of huggingface"),
        ((HF_JSON, "huggingface", 3), "chat_template must be a string"),
    ],
)
def test_write_metadata_errors(args, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        write_metadata(*args, metadata_path=str(tmp_path / "m.json"))
    assert not (tmp_path / "m.json").exists()


def test_committed_asset_is_what_write_metadata_writes(tmp_path):
    path = write_metadata(HF_JSON, "huggingface", metadata_path=str(tmp_path / "m.json"))
    with open(path, encoding="utf-8") as f, open(os.path.join(ASSETS, "tokenizer_metadata.json")) as g:
        assert f.read() == g.read()


def test_upstream_written_files_are_read(tmp_path):
    """What upstream's writer leaves (compact JSON, its default class at either import path), and a
    hand-written file with the library alone."""
    for class_path in DEFAULT_CLASS_PATHS:
        path = tmp_path / "upstream.json"
        path.write_text(
            json.dumps(
                {
                    "library": "megatron",
                    "class_name": DEFAULT_CLASS_NAME,
                    "class_path": class_path,
                    "chat_template": None,
                }
            )
        )
        assert read_metadata(str(path)).library == "megatron"
    path.write_text('{"library": "null-text"}')
    assert read_metadata(str(path)) == TokenizerMetadata("null-text", None, str(path))
    path.write_text('{"library": "huggingface", "class_name": null, "class_path": "ignored.without.a.name"}')
    assert read_metadata(str(path)).library == "huggingface"  # upstream builds its default class then


def _meta(tmp_path, content) -> str:
    path = tmp_path / "meta.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "cannot be read as JSON"),
        ("[1, 2]", "holds a JSON list, not an object with a 'library' field"),
        ({"chat_template": None}, "has no 'library' field; add one of huggingface, sentencepiece, megatron, null-text"),
        ({"library": "huggingfaces"}, "field 'library' names library 'huggingfaces', which is no tokenizer library"),
        ({"library": None}, "field 'library' names library None"),
        ({"library": ["huggingface"]}, r"field 'library' names library \['huggingface'\], which is no tokenizer"),
        ({"library": "sft"}, "field 'library' names library 'sft': this trainer does not do SFT; set it to one of"),
        ({"library": "byte-level"}, "upstream's byte-level library .* is not this trainer's ByteLevelTokenizer"),
        ({"library": "multimodal"}, "names library 'multimodal': this trainer has no vision tokenizers"),
        (
            {"library": "huggingface", "class_name": "MyTok", "class_path": "my.module"},
            "fields 'class_name' / 'class_path' name the tokenizer class my.module.MyTok; .* remove both fields",
        ),
        (
            {"library": "huggingface", "class_name": DEFAULT_CLASS_NAME},  # no path: not upstream's default
            "name the tokenizer class None.MegatronTokenizerText",
        ),
        ({"library": "huggingface", "chat_template": ["a"]}, "field 'chat_template' must be a string"),
        (
            {"library": "huggingface", "vocab_size": 5, "eos": 1},
            r"field\(s\) 'eos', 'vocab_size' are not metadata fields .*remove them",
        ),
    ],
)
def test_bad_files_name_flag_file_field_and_fix(content, message, tmp_path):
    path = _meta(tmp_path, content)
    with pytest.raises(ValueError, match=message) as e:
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=64, tokenizer_metadata=path))
    assert str(e.value).startswith(f"--tokenizer-metadata {path}")


def test_every_upstream_library_is_read_or_refused(tmp_path):
    for library in UPSTREAM_TEXT_LIBRARIES + UPSTREAM_VISION_LIBRARIES:
        path = _meta(tmp_path, {"library": library})
        if library in LIBRARIES:
            assert read_metadata(path).library == library
        else:
            with pytest.raises(ValueError, match=f"field 'library' names library '{library}': "):
                read_metadata(path)


def test_missing_file_and_folder(tmp_path):
    missing = str(tmp_path / "metadata.json")
    with pytest.raises(ValueError, match=f"--tokenizer-metadata {missing} does not exist; write one with megatron"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=64, tokenizer_metadata=missing))
    with pytest.raises(ValueError, match="is not a file; pass the metadata JSON file itself"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=64, tokenizer_metadata=str(tmp_path)))


@pytest.mark.parametrize(
    "library, fields, message",
    [
        (
            "sentencepiece",
            dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=HF_JSON),
            "field 'library' is 'sentencepiece', but --tokenizer-type HuggingFaceTokenizer reads the 'huggingface' "
            "library; pass --tokenizer-type SentencePieceTokenizer or GPTSentencePieceTokenizer or Llama2Tokenizer",
        ),
        (
            "huggingface",
            dict(tokenizer_type="NullTokenizer", vocab_size=64),  # upstream ignores the file for this type
            "field 'library' is 'huggingface', but --tokenizer-type NullTokenizer reads the 'null-text' library; "
            "pass --tokenizer-type HuggingFaceTokenizer",
        ),
        (
            "megatron",
            dict(tokenizer_type="Llama2Tokenizer", tokenizer_model=SP_MODEL),
            "pass --tokenizer-type GPT2BPETokenizer .*or a metadata file with library 'sentencepiece'",
        ),
        (
            "null-text",
            dict(tokenizer_type="ByteLevelTokenizer"),
            "with --tokenizer-type ByteLevelTokenizer: that type reads no metadata file; drop --tokenizer-metadata",
        ),
    ],
)
def test_library_must_be_the_types(library, fields, message, tmp_path):
    path = write_metadata(ASSETS, library, metadata_path=str(tmp_path / "m.json"))
    with pytest.raises(ValueError, match=message) as e:
        build_tokenizer(DataConfig(tokenizer_metadata=path, **fields))
    assert str(e.value).startswith(f"--tokenizer-metadata {path}")


def test_the_file_is_checked_before_the_tokenizer_files(tmp_path):
    """A Hub name with a metadata file that is not there: the flag's own error comes first."""
    missing = str(tmp_path / "metadata.json")
    with pytest.raises(ValueError, match="--tokenizer-metadata .* does not exist"):
        build_tokenizer(
            DataConfig(
                tokenizer_type="HuggingFaceTokenizer",
                tokenizer_model="meta-llama/Meta-Llama-3-8B",
                tokenizer_metadata=missing,
            )
        )

"""Tokenizer metadata files (``--tokenizer-metadata``): reading, checking and writing them.

A metadata file is the JSON object Megatron's ``MegatronTokenizer.write_metadata`` writes:
``library`` (which tokenizer library reads the tokenizer files), ``class_name`` and
``class_path`` (the Python class that wraps the library), and ``chat_template`` (a Jinja
template, or null). Training reads the file named by ``--tokenizer-metadata``; the
tokenizer's files still come from ``--tokenizer-model`` / ``--vocab-file`` /
``--merge-file`` / ``--vocab-size``, as ``--tokenizer-type`` asks for them. Without the
flag no file is read (Megatron's trainer does not look for one next to the tokenizer
either: it takes the library ``--tokenizer-type`` implies).

The libraries here, and the ``--tokenizer-type`` each one goes with (upstream's classes
only accept the arguments of their own type, so another pairing fails there too):

- ``huggingface``: HuggingFaceTokenizer (a local tokenizer.json, or a folder holding one);
- ``sentencepiece``: SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer;
- ``megatron``: GPT2BPETokenizer (upstream's "Megatron" library: GPT-2 BPE from vocab/merges);
- ``null-text``: NullTokenizer (upstream ignores the file for this type; here it is checked).

Unusual here: the class fields may only name upstream's default text class
(``MegatronTokenizerText``), which is what ``write_metadata`` writes, so files travel
between upstream and this trainer; a custom class is refused, as are the libraries this
trainer does not have (tiktoken, byte-level, sft, multimodal, null-multimodal), fields
upstream never writes, and the ``tokenizer_class`` argument of upstream's writer. The
chat template is checked and kept, and pretraining applies none (neither does upstream's).
"""

import dataclasses
import json
import os

METADATA_FILE_NAME = "tokenizer_metadata.json"

# Upstream's library names (megatron/core/tokenizers/megatron_tokenizer.py).
UPSTREAM_TEXT_LIBRARIES = ("sentencepiece", "huggingface", "megatron", "tiktoken", "byte-level", "null-text", "sft")
UPSTREAM_VISION_LIBRARIES = ("multimodal", "null-multimodal")

# The library each --tokenizer-type here goes with.
LIBRARY_OF_TYPE = {
    "HuggingFaceTokenizer": "huggingface",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "GPT2BPETokenizer": "megatron",
    "NullTokenizer": "null-text",
}
LIBRARIES = ("huggingface", "sentencepiece", "megatron", "null-text")

# Upstream's default text class: write_metadata stores its __module__ (the second path);
# the package re-exports it (the first).
DEFAULT_CLASS_NAME = "MegatronTokenizerText"
DEFAULT_CLASS_PATHS = ("megatron.core.tokenizers.text", "megatron.core.tokenizers.text.text_tokenizer")

_FIELDS = ("library", "class_name", "class_path", "chat_template")

# Why a library upstream has is not read here, and what to do instead.
_OTHER_LIBRARIES = {
    "tiktoken": "TikToken tokenizers (--tokenizer-type TikTokenizer) are not supported yet here",
    "byte-level": (
        "upstream's byte-level library (vocabulary 512, eos 0, pad 1) is not this trainer's ByteLevelTokenizer "
        "(vocabulary 258, end-of-document 256), which needs no metadata file"
    ),
    "sft": "this trainer does not do SFT",
    "multimodal": "this trainer has no vision tokenizers",
    "null-multimodal": "this trainer has no vision tokenizers",
}


@dataclasses.dataclass(frozen=True)
class TokenizerMetadata:
    """A checked metadata file.

    Attributes:
        library: One of ``LIBRARIES``.
        chat_template: The file's Jinja chat template, or None.
        path: The file it was read from.
    """

    library: str
    chat_template: str | None
    path: str


def default_metadata_path(tokenizer_path: str) -> str:
    """Where upstream's writer puts the file: ``tokenizer_metadata.json`` beside the tokenizer file, or
    inside the tokenizer folder."""
    folder = os.path.dirname(tokenizer_path) if os.path.isfile(tokenizer_path) else tokenizer_path
    return os.path.join(folder, METADATA_FILE_NAME)


def _supported_library(library, where: str, fix: str) -> str:
    """Returns ``library`` when this trainer reads it; raises a ValueError saying why not otherwise."""
    if library in LIBRARIES:
        return library
    if isinstance(library, str) and library in _OTHER_LIBRARIES:
        raise ValueError(f"{where} names library {library!r}: {_OTHER_LIBRARIES[library]}; {fix}.")
    known = ", ".join(UPSTREAM_TEXT_LIBRARIES + UPSTREAM_VISION_LIBRARIES)
    raise ValueError(
        f"{where} names library {library!r}, which is no tokenizer library (upstream's are {known}; this "
        f"trainer reads {', '.join(LIBRARIES)}); {fix}."
    )


def write_metadata(
    tokenizer_path: str,
    tokenizer_library: str,
    chat_template: str | None = None,
    overwrite: bool = False,
    metadata_path: str | None = None,
) -> str:
    """Writes a metadata file for ``--tokenizer-metadata``, as upstream's ``MegatronTokenizer.write_metadata``.

    The file holds ``library``, upstream's default ``class_name`` / ``class_path`` and
    ``chat_template``, so upstream reads it too.

    Args:
        tokenizer_path: The tokenizer's file or folder (it must exist); the file goes beside it
            unless ``metadata_path`` is given.
        tokenizer_library: ``huggingface``, ``sentencepiece``, ``megatron`` or ``null-text``.
        chat_template: A Jinja chat template to store, or None.
        overwrite: Replace an existing file.
        metadata_path: Where to write; default ``tokenizer_metadata.json`` beside the tokenizer.

    Returns:
        The path written.

    Raises:
        ValueError: The tokenizer path does not exist, the library is not one this trainer reads,
            the chat template is no string, or the file exists and ``overwrite`` is False.
    """
    if not os.path.exists(tokenizer_path):
        raise ValueError(f"write_metadata: tokenizer_path {tokenizer_path} does not exist; pass the tokenizer's file.")
    library = _supported_library(
        tokenizer_library, "write_metadata: tokenizer_library", f"use one of {', '.join(LIBRARIES)}"
    )
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"write_metadata: chat_template must be a string (Jinja) or None, got {chat_template!r}.")
    path = metadata_path or default_metadata_path(tokenizer_path)
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"write_metadata: {path} exists; pass overwrite=True to replace it.")
    metadata = {
        "library": library,
        "class_name": DEFAULT_CLASS_NAME,
        "class_path": DEFAULT_CLASS_PATHS[1],
        "chat_template": chat_template,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(metadata, f, indent=2)
        f.write("\n")
    return path


def _load_json_object(path: str) -> dict:
    flag = f"--tokenizer-metadata {path}"
    if not os.path.exists(path):
        raise ValueError(
            f"{flag} does not exist; write one with megatron.core.tokenizers.write_metadata(tokenizer_path, "
            "tokenizer_library) or drop the flag (--tokenizer-type alone chooses the tokenizer)."
        )
    if not os.path.isfile(path):
        raise ValueError(f"{flag} is not a file; pass the metadata JSON file itself (e.g. {METADATA_FILE_NAME}).")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} cannot be read as JSON ({e}); write it with write_metadata.") from e
    if not isinstance(data, dict):
        raise ValueError(f"{flag} holds a JSON {type(data).__name__}, not an object with a 'library' field.")
    return data


def read_metadata(path: str) -> TokenizerMetadata:
    """Reads and checks a metadata file (module docstring).

    Args:
        path: ``--tokenizer-metadata``.

    Raises:
        ValueError: Missing or unreadable file, not a JSON object, no or unknown library, a custom
            class, a chat template that is no string, or a field upstream's writer does not write;
            each message names the flag, the file, the field and the fix.
    """
    data = _load_json_object(path)
    flag = f"--tokenizer-metadata {path}"
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(
            f"{flag}: field(s) {', '.join(map(repr, unknown))} are not metadata fields (the fields are "
            f"{', '.join(_FIELDS)}); remove them: the tokenizer's files and flags give everything else."
        )
    if "library" not in data:
        raise ValueError(
            f"{flag} has no 'library' field; add one of {', '.join(LIBRARIES)} (or rewrite it with write_metadata)."
        )
    library = _supported_library(
        data["library"],
        f"{flag}: field 'library'",
        f"set it to one of {', '.join(LIBRARIES)}, or drop the flag",
    )
    # Upstream imports class_path.class_name when class_name is set, and builds its default class otherwise.
    class_name, class_path = data.get("class_name"), data.get("class_path")
    if class_name and not (class_name == DEFAULT_CLASS_NAME and class_path in DEFAULT_CLASS_PATHS):
        raise ValueError(
            f"{flag}: fields 'class_name' / 'class_path' name the tokenizer class {class_path}.{class_name}; this "
            f"trainer builds its own tokenizer for each library and loads no custom class: remove both fields "
            f"(or set them to upstream's default, {DEFAULT_CLASS_NAME} in {DEFAULT_CLASS_PATHS[1]})."
        )
    chat_template = data.get("chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"{flag}: field 'chat_template' must be a string (Jinja) or null, got {chat_template!r}.")
    return TokenizerMetadata(library=library, chat_template=chat_template, path=path)


def check_tokenizer_type(metadata: TokenizerMetadata, tokenizer_type: str) -> None:
    """Raises a ValueError unless ``--tokenizer-type`` goes with the file's library."""
    expected = LIBRARY_OF_TYPE.get(tokenizer_type)
    if expected == metadata.library:
        return
    types = [t for t, lib in LIBRARY_OF_TYPE.items() if lib == metadata.library]
    if expected is None:
        raise ValueError(
            f"--tokenizer-metadata {metadata.path} with --tokenizer-type {tokenizer_type}: that type reads no "
            f"metadata file; drop --tokenizer-metadata."
        )
    raise ValueError(
        f"--tokenizer-metadata {metadata.path}: field 'library' is {metadata.library!r}, but --tokenizer-type "
        f"{tokenizer_type} reads the {expected!r} library; pass --tokenizer-type {' or '.join(types)} (with its "
        f"files), or a metadata file with library {expected!r}."
    )

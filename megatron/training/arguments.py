"""Command-line flags, generated from the config dataclasses of ``RunConfig``.

Every field of every concern (model, parallel, training, ...) becomes one flag: the
field name in kebab-case (``num_layers`` -> ``--num-layers``) unless ``flag_field``
metadata names another. The type comes from the annotation, the ``--help`` text from
the field's attribute docstring (read from the class source with ``ast``), so a flag,
its default and its documentation have one source.

What is unusual:
- Boolean fields whose default is True get a flag that turns them *off*
  (``--disable-bias-linear``, or ``--no-<name>``); with no explicit ``flag`` the
  positive spelling ``--<name>`` is accepted too, as a no-op, because that is what
  Megatron command lines say (``--attention-softmax-in-fp32``).
- Megatron flags that are no config field live in one table, ``KNOWN_MEGATRON_FLAGS``
  (``known_flags.py``). They parse, and then either do nothing (speed and I/O knobs;
  ``RunConfig.ignored_flags`` lists the given ones for the run's start-up line) or
  raise ``ValueError`` naming the flag and the fix, so a Megatron command line never
  fails with a bare "unrecognized arguments".
- Unknown flags exit through argparse as usual, with a "did you mean" suggestion.
- Abbreviations are off (as in Megatron): ``--num-layer`` is an error, not a prefix match.

Parsing fills the dataclasses and nothing else; ``RunConfig.resolve()`` derives the rest and
``RunConfig.validate()`` checks them.
"""

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, Union

from megatron.training.known_flags import KNOWN_MEGATRON_FLAGS, KnownFlag
from megatron.training.run_config import RunConfig

__all__ = ["KNOWN_MEGATRON_FLAGS", "KnownFlag", "build_parser", "flags_markdown", "parse_args"]

# Attribute of RunConfig -> argument-group title shown in --help and the user guide.
_GROUP_TITLES = {
    "model": "model",
    "moe": "mixture of experts",
    "parallel": "parallel",
    "training": "training",
    "optimizer": "optimizer",
    "precision": "precision",
    "ddp": "ddp",
    "data": "data",
    "logging": "logging",
    "checkpoint": "checkpoint",
    "profiling": "profiling",
    "cuda_graph": "cuda graphs",
    "mamba": "mamba and hybrid",
    "linear_attention": "experimental attention variant",
}

_KNOWN_GROUP_TITLE = "Megatron flags not supported here"
_KNOWN_DEST_PREFIX = "_known."


class _FieldFlag(NamedTuple):
    """How one dataclass field maps to the command line."""

    group: str  # attribute of RunConfig
    name: str  # field name
    dest: str  # argparse dest, "<group>.<name>" (field names repeat across groups)
    flags: tuple[str, ...]  # the flag first, then aliases
    kwargs: dict[str, Any]  # argparse add_argument keyword arguments, without dest/help
    help: str
    default_text: str  # for the user guide


@functools.cache
def field_docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right after each field.

    Returns:
        Field name -> docstring, cleaned and joined into one paragraph.
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    class_def = tree.body[0]
    assert isinstance(class_def, ast.ClassDef), cls
    docs = {}
    body = class_def.body
    for stmt, nxt in zip(body, body[1:]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _unwrap_optional(tp: Any) -> Any:
    """``X | None`` (or ``Optional[X]``) -> X; other types unchanged."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _kebab(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise AssertionError(f"config field {field.name} has no default")


def _default_text(default: Any) -> str:
    if isinstance(default, list):
        return " ".join(map(str, default)) if default else "empty"
    return str(default)


def _field_flag(group: str, cls: type, field: dataclasses.Field, hint: Any) -> _FieldFlag | None:
    """Builds the flag description of one field, or None for ``no_flag`` fields."""
    meta = field.metadata
    if meta.get("no_flag"):
        return None
    default = _default_of(field)
    doc = field_docstrings(cls).get(field.name)
    assert doc, f"{cls.__name__}.{field.name} needs an attribute docstring (it becomes the --help text)"
    flag = meta.get("flag") or _kebab(field.name)
    flags = (flag,) + tuple(meta.get("aliases") or ())
    tp = _unwrap_optional(hint)
    kwargs: dict[str, Any] = {"default": default}
    if tp is bool:
        if default:
            kwargs["action"] = "store_false"
            if not meta.get("flag"):
                # --no-<name> turns it off; the plain --<name> (Megatron's spelling) is a no-op.
                flags = (_kebab("no_" + field.name),) + tuple(meta.get("aliases") or ())
            help_text = f"Turn off (on by default): {doc}"
        else:
            kwargs["action"] = "store_true"
            help_text = doc
        return _FieldFlag(group, field.name, f"{group}.{field.name}", flags, kwargs, help_text, "off")
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp) or (str,)
        kwargs["type"] = item
        kwargs["nargs"] = meta.get("nargs") or "*"
    elif tp in (int, float, str):
        kwargs["type"] = tp
        if meta.get("nargs"):
            kwargs["nargs"] = meta["nargs"]
    else:
        raise AssertionError(f"{cls.__name__}.{field.name}: no flag type for {hint!r}; mark it no_flag")
    if meta.get("choices") is not None:
        kwargs["choices"] = tuple(meta["choices"])
    else:
        kwargs["metavar"] = field.name.upper()
    text = _default_text(default)
    # Docstrings of optional fields often say what "unset" means ("Defaults to ...").
    help_text = doc if "default" in doc.lower() else f"{doc} (default: {text})"
    return _FieldFlag(group, field.name, f"{group}.{field.name}", flags, kwargs, help_text, text)


def _groups() -> list[tuple[str, type]]:
    """(RunConfig attribute, config dataclass) for each concern, in declaration order."""
    hints = typing.get_type_hints(RunConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])]


def field_flags() -> list[_FieldFlag]:
    """Every generated flag, grouped by concern in declaration order."""
    out = []
    for group, cls in _groups():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            ff = _field_flag(group, cls, field, hints[field.name])
            if ff is not None:
                out.append(ff)
    return out


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose unknown-flag error suggests the nearest known flag.

    Python 3.14's ``suggest_on_error`` covers misspelt choices; unknown flags are
    matched here so the hint appears on every Python version.
    """

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse signature
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            known = [s for action in self._actions for s in action.option_strings]
            parts = []
            for item in extras:
                flag = item.split("=", 1)[0]
                near = difflib.get_close_matches(flag, known, n=1) if flag.startswith("--") else []
                parts.append(f"{item} (did you mean {near[0]}?)" if near else item)
            self.error("unrecognized arguments: " + " ".join(parts))
        return namespace


def _add_known_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        _KNOWN_GROUP_TITLE,
        "Megatron flags that parse here: some are accepted and ignored, the others stop the run with the reason.",
    )
    for flag, known in KNOWN_MEGATRON_FLAGS.items():
        help_text = known.message.format(value="VALUE") if known.message else f"Accepted, no effect: {known.note}."
        if known.message and known.accepted_values:
            help_text = f"Accepted: {', '.join(known.accepted_values)}. Otherwise: {help_text}"
        dest = _KNOWN_DEST_PREFIX + flag
        if known.nargs == 0:
            group.add_argument(flag, dest=dest, action="store_true", default=False, help=help_text.replace("%", "%%"))
        else:
            group.add_argument(
                flag, dest=dest, nargs=known.nargs, default=None, metavar="VALUE", help=help_text.replace("%", "%%")
            )


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: one argument group per concern of ``RunConfig``."""
    # A short usage line: the generated one runs to ~90 lines and buries the error message.
    kwargs = dict(
        description="Megatron-style GPT pretraining.", usage="%(prog)s [flags] (see --help)", allow_abbrev=False
    )
    if sys.version_info >= (3, 14):
        kwargs["suggest_on_error"] = True  # near-miss hints for misspelt choices
    parser = _Parser(**kwargs)
    groups = {}
    for group, cls in _groups():
        doc = inspect.getdoc(cls) or ""
        groups[group] = parser.add_argument_group(_GROUP_TITLES.get(group, group), doc.splitlines()[0] if doc else None)
    for ff in field_flags():
        arg_group = groups[ff.group]
        arg_group.add_argument(*ff.flags, dest=ff.dest, help=ff.help.replace("%", "%%"), **ff.kwargs)
        if ff.kwargs.get("action") == "store_false" and ff.flags[0] == _kebab("no_" + ff.name):
            # The positive Megatron spelling: sets the default again, i.e. no effect.
            arg_group.add_argument(
                _kebab(ff.name),
                dest=ff.dest,
                action="store_true",
                default=ff.kwargs["default"],
                help="On by default; accepted for Megatron command lines.",
            )
    _add_known_flags(parser)
    return parser


def _check_known_flags(values: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming every given known-but-unsupported flag."""
    errors = []
    for flag, known in KNOWN_MEGATRON_FLAGS.items():
        value = values.get(_KNOWN_DEST_PREFIX + flag)
        if value is None or value is False or known.message is None:
            continue
        shown = " ".join(value) if isinstance(value, list) else str(value)
        if known.nargs != 0 and shown in known.accepted_values:
            continue
        errors.append(known.message.format(value=shown))
    if errors:
        raise ValueError("unsupported Megatron flags:\n  " + "\n  ".join(errors))


def _ignored_flags(values: dict[str, Any]) -> list[str]:
    """The given known flags that are accepted with no effect, in table order."""
    out = []
    for flag, known in KNOWN_MEGATRON_FLAGS.items():
        value = values.get(_KNOWN_DEST_PREFIX + flag)
        if value is None or value is False:
            continue
        if known.message is None or (
            known.nargs != 0
            and " ".join(map(str, value if isinstance(value, list) else [value])) in known.accepted_values
        ):
            out.append(flag)
    return out


def _legacy_spellings(argv: list[str]) -> list[str]:
    """Megatron's deprecated spellings that still work there, rewritten to the current flags
    (with the warning Megatron gives): ``--use-rotary-position-embeddings`` is
    ``--position-embedding-type rope``; ``--no-weight-decay-cond-type apply_wd_to_qk_layernorm``
    is ``--apply-wd-to-qk-layernorm`` (any other value is an error naming the flag)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--use-rotary-position-embeddings":
            warnings.warn(
                "--use-rotary-position-embeddings is deprecated: use --position-embedding-type rope.", stacklevel=3
            )
            out += ["--position-embedding-type", "rope"]
        elif arg == "--no-weight-decay-cond-type" or arg.startswith("--no-weight-decay-cond-type="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in arg else 1
            if value != "apply_wd_to_qk_layernorm":
                raise ValueError(
                    f"--no-weight-decay-cond-type {value!r} is not valid (Megatron's only value is "
                    "apply_wd_to_qk_layernorm); use --apply-wd-to-qk-layernorm."
                )
            warnings.warn("--no-weight-decay-cond-type is deprecated: use --apply-wd-to-qk-layernorm.", stacklevel=3)
            out.append("--apply-wd-to-qk-layernorm")
        else:
            out.append(arg)
        i += 1
    return out


_DASH_VALUE = re.compile(r"^-[\d.]")


def _attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--split -1,2,0`` -> ``--split=-1,2,0``.

    argparse takes a value that starts with '-' and is not a plain number for a flag
    and stops with "expected one argument"; attached to its flag, the value reaches
    the flag's own check, whose error names the flag and the fix.
    """
    out, i = [], 0
    while i < len(argv):
        action = parser._option_string_actions.get(argv[i])
        value = argv[i + 1] if i + 1 < len(argv) else None
        if (
            action is not None
            and action.nargs is None
            and action.option_strings
            and value is not None
            and _DASH_VALUE.match(value)
            and value not in parser._option_string_actions
        ):
            out.append(f"{argv[i]}={value}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    """Parses a command line into a ``RunConfig``.

    Only fills the dataclasses: the caller runs ``cfg = cfg.resolve(world_size)`` and
    ``cfg.validate()``, sets ``model.vocab_size`` from the tokenizer and freezes it.

    Args:
        argv: Arguments without the program name; None reads ``sys.argv[1:]``.

    Raises:
        SystemExit: For unknown flags or malformed values (argparse's usual exit).
        ValueError: For known Megatron flags this trainer does not support.
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    argv = _legacy_spellings(argv)
    namespace = parser.parse_args(_attach_dash_values(parser, argv))
    values = vars(namespace)
    _check_known_flags(values)
    config = RunConfig()
    by_group: dict[str, dict[str, Any]] = {}
    for ff in field_flags():
        value = values[ff.dest]
        by_group.setdefault(ff.group, {})[ff.name] = list(value) if isinstance(value, list) else value
    for group, cls in _groups():
        setattr(config, group, cls(**by_group.get(group, {})))
    config.ignored_flags = _ignored_flags(values)
    config.given_fields = _given_fields(argv)
    return config


def _given_fields(argv: list[str]) -> list[str]:
    """``group.field`` of every field a word of ``argv`` (legacy spellings already rewritten) names."""
    words = {w.split("=", 1)[0] for w in argv if w.startswith("--")}
    return [ff.dest for ff in field_flags() if words.intersection(ff.flags)]


_MD_METAVARS = {int: "N", float: "X", str: "STR"}


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def flags_markdown() -> str:
    """A user-guide section: supported flags per group, then the known-but-unsupported ones."""
    lines = [
        "## Command-line flags",
        "",
        "Generated from the config dataclasses (`python tools/list_flags.py`). Flags follow Megatron's",
        "spelling; booleans are switches. Unknown flags stop the run with a suggestion.",
    ]
    by_group: dict[str, list[_FieldFlag]] = {}
    for ff in field_flags():
        by_group.setdefault(ff.group, []).append(ff)
    for group, cls in _groups():
        doc = (inspect.getdoc(cls) or "").splitlines()
        lines += ["", f"### {_GROUP_TITLES.get(group, group)}", ""]
        if doc:
            lines += [doc[0], ""]
        lines += ["| flag | default | description |", "| --- | --- | --- |"]
        docs = field_docstrings(cls)
        for ff in by_group.get(group, []):
            if "choices" in ff.kwargs:
                value = " {" + ",".join(map(str, ff.kwargs["choices"])) + "}"
            elif ff.kwargs.get("action") is None:
                value = " " + _MD_METAVARS.get(ff.kwargs["type"], "VALUE") + (" ..." if "nargs" in ff.kwargs else "")
            else:
                value = ""
            spellings = ", ".join(f"`{f}{value}`" for f in ff.flags)
            description = docs[ff.name]
            if ff.kwargs.get("action") == "store_false":
                description = f"Turns off (on by default): {description}"
                if ff.flags[0] == _kebab("no_" + ff.name):
                    description += f" `{_kebab(ff.name)}` is accepted and changes nothing."
            default = "unset" if ff.default_text == "None" else ff.default_text
            lines.append(f"| {spellings} | {_md_cell(default)} | {_md_cell(description)} |")
    lines += [
        "",
        "### Megatron flags not supported here",
        "",
        "They parse so that Megatron command lines give a clear answer. *Accepted* ones do nothing",
        "(the behaviour they ask for is what happens anyway); *rejected* ones stop the run with the reason.",
        "",
        "| flag | status | why |",
        "| --- | --- | --- |",
    ]
    for flag, known in KNOWN_MEGATRON_FLAGS.items():
        if known.message is None:
            status, why = "accepted", known.note
        elif known.accepted_values:
            status = "accepted: " + ", ".join(known.accepted_values) + "; other values rejected"
            why = known.message.format(value="VALUE")
        else:
            status, why = "rejected", known.message
        lines.append(f"| `{flag}` | {status} | {_md_cell(why)} |")
    return "\n".join(lines) + "\n"

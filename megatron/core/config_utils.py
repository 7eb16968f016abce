"""Helpers shared by every config dataclass.

Each concern (model, parallel, training, data, logging, cuda graphs, ...) owns a small
dataclass whose fields carry attribute docstrings. `megatron.training.arguments`
turns those fields into Megatron-named, kebab-case command-line flags, so the flag,
its default and its ``--help`` text have one source. ``flag_field`` lets a field
override what the generator would infer (flag name, aliases, choices, nargs).

Config classes derive from ``Freezable``: once a run's config is resolved and the
tokenizer has set the vocabulary size, ``freeze`` makes it read-only, so no stage can
change a value another stage has already read.
"""

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any


def flag_field(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    flag: str | None = None,
    aliases: Sequence[str] = (),
    choices: Sequence[Any] | None = None,
    nargs: str | None = None,
    no_flag: bool = False,
):
    """A dataclass field with command-line metadata.

    Args:
        default: The field default.
        default_factory: Factory for mutable defaults (lists).
        flag: Flag name to use instead of ``--<field-name-in-kebab-case>``. For a bool
            field whose default is True, this is the flag that stores False
            (for example ``--disable-bias-linear`` for ``add_bias_linear``).
        aliases: Further spellings accepted for the same flag.
        choices: Allowed values.
        nargs: argparse ``nargs`` for list-valued fields.
        no_flag: The field is derived or internal and gets no flag.
    """
    meta = {"flag": flag, "aliases": tuple(aliases), "choices": choices, "nargs": nargs, "no_flag": no_flag}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def require(condition: bool, message: str) -> None:
    """Raises ``ValueError(message)`` when a user-facing condition fails."""
    if not condition:
        raise ValueError(message)


class Freezable:
    """Base of the config dataclasses: ``freeze(config)`` makes an instance read-only.

    After freezing, assigning or deleting a field raises ``FrozenInstanceError`` naming
    it. Lists held by a frozen config are not copied into tuples (the code compares them
    with lists); mutating them in place is not caught.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(_frozen_message(self, name))
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(_frozen_message(self, name))
        object.__delattr__(self, name)


def _frozen_message(config: Any, name: str) -> str:
    return (
        f"cannot set {type(config).__name__}.{name}: the run config is read-only once set-up is done "
        "(every derived value is computed in RunConfig.resolve()); change the flag instead, or work on "
        "config_utils.thawed_copy(config)."
    )


def _configs(config: Any):
    """``config`` and every config dataclass nested in its fields (each once)."""
    seen, stack = set(), [config]
    while stack:
        c = stack.pop()
        if id(c) in seen or not dataclasses.is_dataclass(c) or isinstance(c, type):
            continue
        seen.add(id(c))
        yield c
        stack.extend(getattr(c, f.name) for f in dataclasses.fields(c))


def freeze(config: Any) -> Any:
    """Makes ``config`` and the config dataclasses nested in it read-only; returns it."""
    for c in _configs(config):
        if isinstance(c, Freezable):
            object.__setattr__(c, "_frozen", True)
    return config


def is_frozen(config: Any) -> bool:
    return bool(getattr(config, "__dict__", {}).get("_frozen", False))


def thawed_copy(config: Any) -> Any:
    """A deep copy of ``config`` that can be changed again (tests, tools)."""
    out = copy.deepcopy(config)
    for c in _configs(out):
        c.__dict__.pop("_frozen", None)
    return out

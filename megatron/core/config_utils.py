"""Helpers shared by every config dataclass.

Each concern (model, parallel, training, data, logging, cuda graphs, ...) owns a small
dataclass whose fields carry attribute docstrings. `megatron.training.arguments`
turns those fields into Megatron-named, kebab-case command-line flags, so the flag,
its default and its ``--help`` text have one source. ``flag_field`` lets a field
override what the generator would infer (flag name, aliases, choices, nargs).
"""

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

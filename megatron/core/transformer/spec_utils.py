"""Module specs: which class builds each part of a layer, chosen outside the layer.

A ``ModuleSpec`` names a module class (or factory function), fixed keyword
arguments and, for composite modules, a ``submodules`` object (usually a dataclass
of further specs). ``build_module`` instantiates a spec with the call-site
arguments, so e.g. a layer can swap its MLP for an MoE layer without code changes.
"""

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class ModuleSpec:
    """What to build.

    Attributes:
        module: Class (or factory function) to call.
        params: Keyword arguments fixed by the spec; call-site keyword arguments win.
        submodules: Specs of the module's children, passed as ``submodules=`` when not None.
    """

    module: type | Callable
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    submodules: Any = None


def build_module(spec: ModuleSpec | type | Callable, *args, **kwargs):
    """Builds ``spec`` with the given arguments.

    Args:
        spec: A ``ModuleSpec``, or directly a class / factory function.
        *args: Positional arguments for the constructor.
        **kwargs: Keyword arguments; they override ``spec.params``.

    Returns:
        The built module.
    """
    if not isinstance(spec, ModuleSpec):
        if not callable(spec):
            raise TypeError(f"build_module expects a ModuleSpec, a class or a factory, got {spec!r}")
        return spec(*args, **kwargs)
    merged = {**spec.params, **kwargs}
    if spec.submodules is not None:
        merged["submodules"] = spec.submodules
    return spec.module(*args, **merged)

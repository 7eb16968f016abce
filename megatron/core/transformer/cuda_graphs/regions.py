"""Graph regions as layer classes declare them, and the one resolver of scope lists.

A layer class says which parts of its ``forward`` can be captured and under what rules::

    class TransformerLayer(torch.nn.Module):
        graph_regions = GraphRegions(
            RegionSpec("attn", "_forward_attention"),
            RegionSpec("mlp", "_forward_mlp"),
            whole=("attn", "mlp"),
        )

``--cuda-graph-scope`` names regions (``attn mlp moe_router ...``); the empty list means
whole layers. :func:`resolve` turns a scope list and the layer classes of a model into
what to capture in each class, and is the only place scope rules live: unknown or
repeated names, scopes no layer offers, ``requires`` / ``excludes`` between scopes,
regions that exist only under some configs (``when``), and when a layer is captured
whole. It needs classes and the config only, so it runs before the model is built.

Unusual here: a region is never assumed to tile ``forward``. A layer is captured whole
only when every scope in its ``whole`` tuple is selected (or the list is empty), so an
MoE layer whose experts run eagerly between graphed router and postprocess is never
turned into one graph by selecting all of its regions.

Discovery (:func:`graphable_layers`) asks blocks for their layers (``graph_layers()``),
so a submodule that happens to declare regions is never wrapped twice. A model may
declare its loss head (:class:`HeadRegion`, attribute ``graph_head``); it joins the
graphs when the region that feeds it (the last layer's ``ends`` region, or the whole
last layer) is graphed, and no Mamba layer stays eager (:func:`head_joins`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

VALID_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
WHOLE_LAYER = "layer"
IMPLIED_REGIONS = ("moe_postprocess",)
"""Regions no scope names: a ``RegionSpec`` with ``selected_by`` is graphed when that scope is."""

Condition = Callable[[Any], "str | None"]
"""``condition(config) -> None`` when allowed under this config, else the reason (text)."""


@dataclasses.dataclass(frozen=True)
class RegionSpec:
    """One graphable region of a layer class.

    Attributes:
        name: Scope name (one of ``VALID_SCOPES``), ``"layer"`` for a whole layer, or
            one of ``IMPLIED_REGIONS`` (then ``selected_by`` is set).
        method: Name of the layer method that runs the region.
        requires: Scopes that must be selected together with this one.
        excludes: Scopes that cannot be selected together with this one.
        when: ``when(config)`` is None when the region exists under ``config``, else
            the reason it does not (shown to the user).
        selected_by: For a region no scope names: the scope that selects it too (its
            rules are that scope's; ``when`` still applies to the region itself).
    """

    name: str
    method: str
    requires: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    when: Condition | None = None
    selected_by: str | None = None

    @property
    def scope(self) -> str:
        """The ``--cuda-graph-scope`` name that selects this region."""
        return self.selected_by or self.name

    def unavailable(self, config: Any) -> str | None:
        return None if self.when is None else self.when(config)


WHOLE = RegionSpec(WHOLE_LAYER, "forward")


class GraphRegions:
    """The regions a layer class declares.

    Args:
        *specs: The regions, in the order ``forward`` runs them.
        whole: Scopes that together cover ``forward``: selecting all of them (or an empty
            scope list) captures the layer as one graph. ``()``: never whole.
        whole_when: Like ``RegionSpec.when``, for capturing the layer whole.
        ends: The region whose output is the layer's output (it feeds the next layer or
            the loss head). Default: the last of ``whole``, if any.
    """

    def __init__(
        self,
        *specs: RegionSpec,
        whole: tuple[str, ...] = (),
        whole_when: Condition | None = None,
        ends: str | None = None,
    ):
        names = [s.name for s in specs]
        assert len(set(names)) == len(names), f"region declared twice: {names}"
        assert all(n in VALID_SCOPES or n in IMPLIED_REGIONS for n in names), f"unknown region name in {names}"
        assert all((s.name in IMPLIED_REGIONS) == (s.selected_by is not None) for s in specs), names
        assert all(s.scope in names for s in specs), f"selected_by names an undeclared region in {names}"
        assert set(whole) <= set(names), f"whole={whole} names undeclared regions"
        self.specs = tuple(specs)
        self.whole = tuple(whole)
        self.whole_when = whole_when
        self.ends = ends if ends is not None else (whole[-1] if whole else None)

    def by_name(self) -> dict[str, RegionSpec]:
        return {s.name: s for s in self.specs}

    def whole_unavailable(self, config: Any) -> str | None:
        if not self.whole:
            return "it declares no set of regions that covers its whole forward"
        return None if self.whole_when is None else self.whole_when(config)


@dataclasses.dataclass(frozen=True)
class HeadRegion:
    """A model's loss head as a graphable region (``graph_head`` on the model class).

    Attributes:
        method: Name of the model method that runs the head.
        shared_params: ``shared_params(model)`` lists parameters that eager code also
            differentiates (a tied embedding weight); autograd must sum both parts in the
            parameter's dtype before they reach ``main_grad``, as in eager.
        present: ``present(model)`` is False on a stage without the head.
    """

    method: str
    shared_params: Callable[[torch.nn.Module], list[torch.nn.Parameter]] = lambda model: []
    present: Callable[[torch.nn.Module], bool] = lambda model: True


def regions_of(layer_class: type) -> GraphRegions | None:
    regions = getattr(layer_class, "graph_regions", None)
    return regions if isinstance(regions, GraphRegions) else None


def _flag(scopes: Sequence[str]) -> str:
    return "--cuda-graph-scope " + " ".join(scopes) if scopes else "--cuda-graph-scope (empty: whole layers)"


def check_scope_names(scopes: Sequence[str]) -> None:
    """Raises ``ValueError`` for an unknown scope name or one named twice."""
    for scope in scopes:
        if scope not in VALID_SCOPES:
            raise ValueError(
                f"--cuda-graph-scope: unknown scope {scope!r}; valid scopes are {' '.join(VALID_SCOPES)} "
                "(an empty list graphs whole layers)."
            )
    repeated = sorted({s for s in scopes if list(scopes).count(s) > 1})
    if repeated:
        raise ValueError(f"--cuda-graph-scope lists {' '.join(repeated)} more than once; name each scope once.")


def resolve(
    scopes: Sequence[str], layer_classes: Iterable[type], config: Any = None
) -> dict[type, tuple[RegionSpec, ...]]:
    """What to capture in each layer class, in forward order.

    Args:
        scopes: The ``--cuda-graph-scope`` list (empty: whole layers).
        layer_classes: The layer classes of the model (any order, repeats allowed).
        config: The model config the ``when`` conditions read.

    Returns:
        ``{layer class: regions}``; ``(WHOLE,)`` for a layer captured whole, ``()`` for a
        layer that stays eager.

    Raises:
        ValueError: naming the flag, the scope and the fix, for every rule above.
    """
    scopes = list(scopes)
    check_scope_names(scopes)
    classes = list(dict.fromkeys(layer_classes))
    declared = [(c, regions_of(c)) for c in classes]
    declared = [(c, r) for c, r in declared if r is not None]
    kinds = ", ".join(c.__name__ for c, _ in declared) or "(none)"

    reasons: dict[str, list[str | None]] = {}  # scope -> per declaring class: None if available
    for _cls, regions in declared:
        for spec in regions.specs:
            if spec.selected_by is None:
                reasons.setdefault(spec.name, []).append(spec.unavailable(config))
    for scope in scopes:
        if scope not in reasons:
            names = " ".join(sorted(reasons)) or "nothing"
            raise ValueError(
                f"--cuda-graph-scope {scope}: this model has no {scope!r} region (its layers {kinds} offer: "
                f"{names}). Drop the scope, or leave the list empty to graph whole layers."
            )
        if None not in reasons[scope]:
            raise ValueError(f"--cuda-graph-scope {scope}: not available with this model: {reasons[scope][0]}.")
    for _cls, regions in declared:
        specs = regions.by_name()
        for scope in scopes:
            spec = specs.get(scope)
            if spec is None:
                continue
            for need in spec.requires:
                if need not in scopes:
                    raise ValueError(
                        f"--cuda-graph-scope {scope} needs {need} as well (the {scope} graph reads what the "
                        f"{need} graph returns); add {need}."
                    )
            for other in spec.excludes:
                if other in scopes:
                    raise ValueError(
                        f"--cuda-graph-scope {scope} cannot be combined with {other} ({scope} already covers "
                        f"what {other} would capture); keep one of them."
                    )

    plan: dict[type, tuple[RegionSpec, ...]] = {}
    for cls, regions in declared:
        whole_reason = regions.whole_unavailable(config)
        if not scopes:
            if whole_reason is not None:
                raise ValueError(
                    f"{_flag(scopes)}: {cls.__name__} cannot be captured whole: {whole_reason}. Name the "
                    f"regions to graph instead ({' '.join(s.name for s in regions.specs)})."
                )
            plan[cls] = (WHOLE,)
            continue
        if whole_reason is None and set(regions.whole) <= set(scopes):
            plan[cls] = (WHOLE,)
            continue
        plan[cls] = tuple(s for s in regions.specs if s.scope in scopes and s.unavailable(config) is None)
    return plan


def graphable_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of every block of ``model`` (modules with ``graph_layers()``), in order."""
    layers: list[torch.nn.Module] = []
    for module in model.modules():
        graph_layers = getattr(module, "graph_layers", None)
        if callable(graph_layers):
            layers.extend(graph_layers())
    return layers


def head_region(model: torch.nn.Module) -> tuple[torch.nn.Module, HeadRegion] | None:
    """``(module, head)`` of the one module that declares a present loss head, or None."""
    found = []
    for module in model.modules():
        head = getattr(type(module), "graph_head", None)
        if isinstance(head, HeadRegion) and head.present(module):
            found.append((module, head))
    if len(found) > 1:
        raise ValueError(f"{len(found)} modules declare a loss head region; expected at most one")
    return found[0] if found else None


def head_follows(last_layer_regions: Sequence[RegionSpec], last_layer_class: type) -> bool:
    """Whether the loss head joins the graphs: the region feeding it is graphed."""
    if not last_layer_regions:
        return False
    last = last_layer_regions[-1].name
    regions = regions_of(last_layer_class)
    return last == WHOLE_LAYER or (regions is not None and last == regions.ends)


def head_joins(selected: dict[type, Sequence[RegionSpec]], stage_classes: Sequence[type]) -> bool:
    """Whether the loss head joins the graphs of a stage whose layers have ``stage_classes``, in
    forward order: the region feeding it is graphed (:func:`head_follows`) and no Mamba layer of the
    stage stays eager (:func:`leaves_a_scan_eager`). ``attach`` routes it so; the memory report plans it so."""
    if not stage_classes:
        return False
    last = stage_classes[-1]
    return head_follows(selected[last], last) and not leaves_a_scan_eager(selected, stage_classes)


def leaves_a_scan_eager(selected: dict[type, Sequence[RegionSpec]], layer_classes: Iterable[type]) -> bool:
    """Whether a layer offering the ``mamba`` region stays eager. The loss head then stays eager
    too: that layer's eager backward (the scan's working memory) is the eager cache's peak, and a
    graphed head's share of the pool would sit unused beside it."""
    return any(
        not selected[c] and (regions := regions_of(c)) is not None and "mamba" in regions.by_name()
        for c in layer_classes
    )

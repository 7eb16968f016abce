"""Graph memory per layer and region: what the pool holds against what eager must keep.

:func:`eager_report` describes a run from its configuration alone (the analytic
activation budgets of ``activations.py``, static input/output sizes from the shapes);
:func:`graphed_report` adds what a captured :class:`GraphSession` really holds: pool
growth at each region's captures, bytes of static buffers held strongly and released
through weak references, and the pool's reserved / live bytes from an allocator
snapshot filtered by the pool id. ``budgets.check_budgets`` turns a graphed report into
a memory-regression check. Tables, JSON and a PNG chart render either report.

What is unusual here: a region's pool growth is read from the pool's reserved bytes
recorded after every capture event (``SlotGraphs.pool_reserved_after``), so the pool
memory a region *caused* is attributed even though one pool is shared by all of them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import torch

from megatron.core.transformer.cuda_graphs import regions as regions_lib
from megatron.core.transformer.cuda_graphs.activations import (
    Kernels,
    Shapes,
    flash_dq_accumulator_bytes,
    layer_part_kinds,
    num_slots,
    region_activation_bytes,
    region_transient_bytes,
)
from megatron.core.transformer.cuda_graphs.plan import CommRecv, in_backward_pool

__all__ = [
    "RegionMemory",
    "LayerMemory",
    "MemoryReport",
    "eager_report",
    "graphed_report",
    "format_table",
    "plot_layers",
]

MIB = 2**20


@dataclasses.dataclass
class RegionMemory:
    """One graph region (or, eager-only, one region the scopes would graph)."""

    name: str
    layer: str
    scope: str
    kinds: tuple[str, ...]
    activation_bytes: int
    static_input_bytes: int
    static_output_bytes: int
    slot: int = 0
    pool_reserved_growth_bytes: int | None = None
    pool_live_after_fwd_delta_bytes: int | None = None
    strong_bytes: int | None = None
    weak_bytes: int | None = None
    must_keep_bytes: int = 0
    """What the region legitimately keeps after capture: shared wgrads, outputs without a
    backward, and buffers communication keeps for good (a pipeline receive's input, a
    send's output or dgrad waited on only after the cycle)."""
    chunk: int = 0
    """The model chunk the region belongs to: a slot serving several chunks runs one
    micro-batch of one chunk at a time (a *run*), so its pool needs the largest run."""
    turn_bytes: int = 0
    """Eager memory the first eager turn moves into the pool at this region's backward capture
    (``turn.shape_pool``): the loss head's work, which eager keeps in its cache instead."""
    transient_bytes: int = 0
    """Working memory its backward allocates beyond its saved tensors' gradients
    (``activations.region_transient_bytes``: the PyTorch Mamba scan's)."""


@dataclasses.dataclass
class LayerMemory:
    """One layer: what eager keeps for backward, and where a graphed run keeps it."""

    name: str
    eager_bytes: int
    graphed_pool_bytes: int | None
    eager_part_bytes: int
    """Analytic activations of the layer's parts that stay eager in the graphed run."""

    @property
    def graphed_bytes(self) -> int | None:
        return None if self.graphed_pool_bytes is None else self.graphed_pool_bytes + self.eager_part_bytes


@dataclasses.dataclass
class MemoryReport:
    argv: list[str]
    mode: str
    """``graphed`` or ``eager-only``."""
    note: str
    regions: list[RegionMemory]
    layers: list[LayerMemory]
    totals: dict[str, Any]

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        for layer, row in zip(data["layers"], self.layers):
            layer["graphed_bytes"] = row.graphed_bytes
        return json.dumps(data, indent=1)


# ---------------------------------------------------------------------- analytic side
def _element(sh: Shapes) -> int:
    return sh.element_bytes


def static_io_bytes(kinds: Sequence[str], sh: Shapes) -> tuple[int, int]:
    """(input, output) bytes of a region's static buffers, from the shapes."""
    t, h, e = sh.tokens, sh.hidden, _element(sh)
    hidden = t * h * e
    first, last = kinds[0], kinds[-1]
    if first == "postprocess":
        return hidden + t * 8, t * 4  # hidden + labels -> fp32 per-token loss
    if first == "moe_preprocess":
        m = num_slots(sh)
        return hidden + t * sh.experts * 5, m * h * e + m * 12 + sh.experts * 8
    inp = hidden + (sh.seq * sh.kv_channels * 4 if sh.rope and "attn" in kinds else 0)
    if last == "moe_router":
        out = 2 * hidden if sh.shared_ffn else hidden
        return inp, out + t * sh.experts * 5
    return inp, hidden


def _layer_classes(cfg) -> list[type]:
    if cfg.mamba.hybrid_layer_pattern is not None:
        from megatron.core.models.hybrid.hybrid_model import pattern_layer_classes

        return pattern_layer_classes(cfg.mamba)
    from megatron.core.transformer.moe.moe_layer import MoETransformerLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if cfg.linear_attention.enabled:  # gated delta net layers: the classes the layer specs build
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

        return [spec.module for spec in get_gpt_decoder_layer_specs(cfg.model)]
    if cfg.moe.enabled:
        return [MoETransformerLayer if flag else TransformerLayer for flag in cfg.moe.moe_layer_pattern]
    return [TransformerLayer] * cfg.model.num_layers


def _kinds(scope: str, layer_class: type) -> tuple[str, ...]:
    return layer_part_kinds(layer_class) if scope == regions_lib.WHOLE_LAYER else (scope,)


def _activation(kinds: Sequence[str], sh: Shapes, k: Kernels) -> int:
    return sum(region_activation_bytes(kind, sh, k) for kind in kinds)


def region_kinds(region) -> tuple[str, ...]:
    """The activation kinds a session's region covers: the loss head, a whole layer's parts, or its scope."""
    scope = region.name.rsplit(".", 1)[-1]
    if scope == "postprocess":
        return ("postprocess",)
    if region.method_name == "forward":
        return layer_part_kinds(type(region.module))
    return (scope,)


def chunk_activation_bytes(session, chunks: Sequence[Any], cfg, kernels: Kernels) -> list[int]:
    """Per model chunk: the analytic bytes one micro-batch's graphed regions of the chunk keep
    for backward (what the chunk's micro-batch takes in its graph slot's pool)."""
    sh = Shapes.from_config(cfg)
    per_module: dict[int, int] = {}  # a layer may hold several regions (attn, mlp)
    for r in session.regions:
        per_module[id(r.module)] = per_module.get(id(r.module), 0) + _activation(region_kinds(r), sh, kernels)
    return [sum(per_module.get(id(m), 0) for m in chunk.modules()) for chunk in chunks]


def _eager_parts(layer_class: type, graphed: Sequence[str]) -> tuple[str, ...]:
    """Kinds of ``layer_class`` that run eagerly when ``graphed`` scopes are captured."""
    parts = layer_part_kinds(layer_class)
    if regions_lib.WHOLE_LAYER in graphed:
        return ()
    rest = []
    for part in parts:
        if part in graphed:
            continue
        if part == "moe":  # router / preprocess graphed: the experts and unpermute stay eager
            if "moe_router" in graphed:
                rest.append("moe_experts")
                if "moe_preprocess" not in graphed:
                    rest.append("moe_preprocess")
                continue
        rest.append(part)
    return tuple(rest)


def planned_regions(cfg) -> list[tuple[str, type, str]]:
    """``(layer name, layer class, scope)`` of every region the config graphs, in forward order
    (the loss head last, as ``attach`` routes it). Pure: nothing is built."""
    classes = _layer_classes(cfg)
    g = cfg.cuda_graph
    selected = regions_lib.resolve(g.cuda_graph_scope, classes, cfg.model)
    out = []
    for i, cls in enumerate(classes):
        for spec in selected[cls]:
            out.append((f"decoder.layers.{i}", cls, spec.name))
    if g.cuda_graph_postprocess and regions_lib.head_joins(selected, classes):
        out.append(("", None, "postprocess"))
    return out


def eager_report(cfg, kernels: Kernels, argv: Sequence[str] = (), note: str = "", sm_count: int = 132) -> MemoryReport:
    """The analytic report of a validated ``RunConfig`` (``model.vocab_size`` padded).

    ``sm_count`` (default: an H200's 132) sizes flash attention's deterministic-mode
    backward temporaries in the totals."""
    sh = Shapes.from_config(cfg)
    classes = _layer_classes(cfg)
    planned = planned_regions(cfg) if cfg.cuda_graph.enabled else []
    rows = []
    for layer, cls, scope in planned:
        kinds = ("postprocess",) if cls is None else _kinds(scope, cls)
        inp, out = static_io_bytes(kinds, sh)
        name = f"{layer}.{scope}" if layer else scope
        act, transient = _activation(kinds, sh, kernels), region_transient_bytes(kinds, sh, kernels)
        rows.append(RegionMemory(name, layer or "postprocess", scope, kinds, act, inp, out, transient_bytes=transient))
    layers = []
    by_layer: dict[str, list[str]] = {}
    for layer, _, scope in planned:
        by_layer.setdefault(layer or "postprocess", []).append(scope)
    for i, cls in enumerate(classes):
        name = f"decoder.layers.{i}"
        eager = _activation(layer_part_kinds(cls), sh, kernels)
        graphed = by_layer.get(name)
        rest = _eager_parts(cls, graphed) if graphed else layer_part_kinds(cls)
        layers.append(LayerMemory(name, eager, None, _activation(rest, sh, kernels) if rest else 0))
    head = region_activation_bytes("postprocess", sh, kernels)
    layers.append(LayerMemory("postprocess", head, None, 0 if "postprocess" in by_layer else head))
    totals = {
        "eager_activation_bytes": sum(row.eager_bytes for row in layers),
        "graphed_activation_bytes": sum(r.activation_bytes for r in rows),
        "regions": len(rows),
    }
    if any("attn" in layer_part_kinds(cls) for cls in classes):
        # One attention backward's fp32 dQ accumulator: a temporary at the pool's peak
        # (attn graphed) or at the eager cache's (attn eager); deterministic mode splits it.
        # The flag, or the process's setting the kernels follow (an earlier run may have set it).
        deterministic = bool(cfg.training.deterministic_mode) or torch.are_deterministic_algorithms_enabled()
        totals["attn_bwd_dq_accumulator_bytes"] = flash_dq_accumulator_bytes(
            sh, deterministic=deterministic, sm_count=sm_count
        )
        totals["attn_bwd_dq_accumulator_splits"] = (
            (sm_count + sh.micro_batch * sh.heads - 1) // (sh.micro_batch * sh.heads) if deterministic else 1
        )
    return MemoryReport(list(argv), "eager-only", note, rows, layers, totals)


# ---------------------------------------------------------------------- measured side
def _nbytes(t) -> int:
    return int(t.untyped_storage().nbytes())


def _meta_bytes(metas) -> int:
    total = 0
    for m in metas:
        shape = getattr(m, "shape", None)
        if shape is None:
            continue  # a non-tensor argument
        n = 1
        for d in shape:
            n *= int(d)
        total += n * _dtype_bytes(m.dtype)
    return total


def _dtype_bytes(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def graphed_report(
    session,
    cfg,
    kernels: Kernels,
    argv: Sequence[str] = (),
    segments: list[dict] | None = None,
    note: str = "",
    sm_count: int | None = None,
) -> MemoryReport:
    """The report of a captured ``session`` of the run ``cfg`` describes.

    Args:
        session: A captured ``GraphSession`` (regions, cycles, buffers, pools).
        cfg: The run's validated ``RunConfig``.
        kernels: Kernel facts of the device (``Kernels.probe``).
        argv: The command line, for the record.
        segments: An allocator snapshot (``torch.cuda.memory_snapshot()``); taken here
            when None. Only our pools' segments are counted.
        sm_count: SMs of the device (default: read from the pool's device).
    """
    import torch

    from megatron.core.transformer.cuda_graphs.pool import pool_stats_from_segments
    from megatron.core.transformer.cuda_graphs.weak import is_weak_ref

    if sm_count is None:
        device = next(iter(session.pools.values())).device
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    base = eager_report(cfg, kernels, argv, sm_count=sm_count)
    sh = Shapes.from_config(cfg)
    if segments is None:
        from megatron.core.transformer.cuda_graphs.pool import _snapshot_segments

        segments = _snapshot_segments()
    growth: dict[tuple[int, int], int] = {}
    live_fwd: dict[tuple[int, int], int] = {}
    shared = session.backward_pool is not None
    bwd_reserved = bwd_live = 0  # the shared backward pool's, across slots in capture order
    for slot, cycle in session.cycles.items():
        reserved = live = 0
        for event in cycle:
            graphs = session.regions[event.region].slots[slot]
            in_shared = shared and in_backward_pool(event, session.forwards_in_backward_pool)
            before, before_live = (bwd_reserved, bwd_live) if in_shared else (reserved, live)
            r = graphs.pool_reserved_after.get(event.phase, before)
            li = graphs.pool_live_after.get(event.phase, before_live)
            key = (event.region, slot)
            growth[key] = growth.get(key, 0) + r - before
            if event.phase == "fwd":
                live_fwd[key] = li - live
            if in_shared:
                bwd_reserved, bwd_live = r, li
            else:
                reserved, live = r, li
    strong: dict[tuple[int, int], dict[int, int]] = {}
    weak: dict[tuple[int, int], dict[int, int]] = {}
    for slot, buffers in session.buffers.items():
        for key, t in buffers.items():
            if t is None:
                continue
            owner = (key[1], slot)  # ("shared", -1, group): the shared inputs' row
            (weak if is_weak_ref(t) else strong).setdefault(owner, {})[t.data_ptr()] = _nbytes(t)
    rows = []
    for region in session.regions:
        scope = region.name.rsplit(".", 1)[-1]
        layer = region.name.rsplit(".", 1)[0] if "." in region.name else region.name
        kinds = region_kinds(region)
        if region.method_name == "forward" and scope != "postprocess":
            scope = regions_lib.WHOLE_LAYER
        inp = _meta_bytes(region.arg_meta or ())
        out = _meta_bytes(region.output_meta)
        for slot, graphs in sorted(region.slots.items()):
            key = (region.index, slot)
            held = dict(strong.get(key, {}))
            for g in graphs.shared_grads:
                if g is not None:
                    held[g.data_ptr()] = _nbytes(g)
            keep = sum(_nbytes(p) for p in region.shared_params)
            if not region.has_backward:
                keep += out
            turn_bytes = 0
            turns = session.turn_plan
            if turns is not None and turns.first is not None:  # the first backward's static gradients, held
                turn_bytes = turns.shaped_bytes if turns.first_region == region.index else 0
                kept = [session.buffers[slot].get(k) for k in turns.keep if k[1] == region.index]
                keep += sum(_nbytes(t) for t in kept if t is not None)
            for c in session.comms.get(slot, ()):  # received into, or read by a send waited on after the cycle
                t = session.buffers.get(slot, {}).get(c.key)
                held_for_good = isinstance(c, CommRecv) or c.until is None
                if held_for_good and c.key[1] == region.index and t is not None:
                    keep += _nbytes(t)
            rows.append(
                RegionMemory(
                    region.name,
                    layer,
                    scope,
                    kinds,
                    _activation(kinds, sh, kernels),
                    inp,
                    out,
                    slot,
                    growth.get(key),
                    live_fwd.get(key),
                    sum(held.values()),
                    sum(weak.get(key, {}).values()),
                    keep,
                    session.chunk_of(region.index),
                    turn_bytes,
                    region_transient_bytes(kinds, sh, kernels),
                )
            )
    for slot in session.buffers:
        shared = (-1, slot)
        if shared in strong or shared in weak:
            rows.append(
                RegionMemory(
                    "shared inputs",
                    "shared",
                    "shared",
                    (),
                    0,
                    0,
                    0,
                    slot,
                    None,
                    None,
                    sum(strong.get(shared, {}).values()),
                    sum(weak.get(shared, {}).values()),
                )
            )
    pool_growth: dict[str, int] = {}
    for row in rows:
        if row.pool_reserved_growth_bytes is not None:
            pool_growth[row.layer] = pool_growth.get(row.layer, 0) + row.pool_reserved_growth_bytes
    layers = [
        LayerMemory(layer.name, layer.eager_bytes, pool_growth.get(layer.name, 0), layer.eager_part_bytes)
        for layer in base.layers
    ]
    reserved = live = 0
    for pool in session.all_pools():
        s = pool_stats_from_segments(segments, pool.handle, pool.device)
        reserved += s.reserved_bytes
        live += s.live_bytes
    totals = dict(base.totals)
    totals.update(
        {
            "graphed_activation_bytes": sum(r.activation_bytes for r in rows if r.slot == 0),
            "regions": len(session.regions),
            "graphs": session.num_graphs(),
            "slots": len(session.pools),
            "pool_reserved_bytes": reserved,
            "pool_live_bytes": live,
            "strong_bytes": sum(r.strong_bytes or 0 for r in rows),
            "weak_bytes": sum(r.weak_bytes or 0 for r in rows),
            "capture_seconds": float(session.capture_seconds),
            "forward_transient_ops": sum(r.transients_routed for r in session.regions),  # in the backward pool
        }
    )
    return MemoryReport(list(argv), "graphed", note, rows, layers, totals)


# ---------------------------------------------------------------------- rendering
def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def format_table(report: MemoryReport) -> str:
    """The report as text: a header, one line per region, one per layer, the totals."""
    lines = [f"CUDA graph memory report ({report.mode})"]
    if report.note:
        lines.append(report.note)
    head = (
        f"{'region':34} {'slot':>4} {'act MiB':>8} {'tmp MiB':>7} {'in MiB':>7} {'out MiB':>7} {'pool+ MiB':>9} "
        f"{'fwd live+':>9} {'strong':>7} {'weak':>7}"
    )
    lines += ["", head, "-" * len(head)]
    for r in report.regions:
        lines.append(
            f"{r.name[-34:]:34} {r.slot:4d} {_mib(r.activation_bytes):>8} {_mib(r.transient_bytes):>7} "
            f"{_mib(r.static_input_bytes):>7} "
            f"{_mib(r.static_output_bytes):>7} {_mib(r.pool_reserved_growth_bytes):>9} "
            f"{_mib(r.pool_live_after_fwd_delta_bytes):>9} {_mib(r.strong_bytes):>7} {_mib(r.weak_bytes):>7}"
        )
    head = f"{'layer':34} {'eager MiB':>10} {'graphed MiB':>12} {'in pool':>9} {'eager part':>10}"
    lines += ["", head, "-" * len(head)]
    for layer in report.layers:
        lines.append(
            f"{layer.name:34} {_mib(layer.eager_bytes):>10} {_mib(layer.graphed_bytes):>12} "
            f"{_mib(layer.graphed_pool_bytes):>9} {_mib(layer.eager_part_bytes):>10}"
        )
    lines.append("")
    lines.append(
        " | ".join(
            f"{k}: {_mib(v)} MiB" if k.endswith("_bytes") else f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
            for k, v in report.totals.items()
        )
    )
    lines.append(
        "act: analytic activations eager keeps for the region's backward; tmp: its backward's working memory "
        "beyond their gradients, where known; pool+: pool growth at its captures; "
        "fwd live+: pool live bytes added by its forward capture; strong/weak: its static buffers held / "
        "released after capture."
    )
    return "\n".join(lines)


def plot_layers(report: MemoryReport, path: str) -> None:
    """A PNG bar chart of eager vs graphed memory per layer (matplotlib, imported here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [layer.name.replace("decoder.layers.", "L") for layer in report.layers]
    eager = [layer.eager_bytes / MIB for layer in report.layers]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(names) + 2), 4))
    width = 0.4 if report.mode == "graphed" else 0.8
    ax.bar([i - width / 2 if report.mode == "graphed" else i for i in x], eager, width, label="eager (analytic)")
    if report.mode == "graphed":
        pool = [(layer.graphed_pool_bytes or 0) / MIB for layer in report.layers]
        rest = [layer.eager_part_bytes / MIB for layer in report.layers]
        ax.bar([i + width / 2 for i in x], pool, width, label="graphed: pool growth")
        ax.bar([i + width / 2 for i in x], rest, width, bottom=pool, label="graphed: eager parts (analytic)")
    ax.set_xticks(list(x), names, rotation=90, fontsize=7)
    ax.set_ylabel("MiB")
    ax.set_title(f"activation memory per layer ({report.mode})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

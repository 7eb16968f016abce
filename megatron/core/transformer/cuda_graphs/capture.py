"""Capture: every region's graphs, slot by slot, in recorded order, into each slot's pool.

Runs once, at the end of the recording iteration:

1. Warm up each region of every slot on sample data (one pass also finds its
   parameters). Real backwards run, so fused wgrads land in ``main_grad``: a host copy
   restores it, and the RNG states are restored too, so capture changes no number of
   the run.
2. For each slot, walk its cycle: allocate the static inputs the plan gives a buffer of
   their own (into the slot's pool, on the capture stream), capture the forward or
   backward graph, and right after each event turn the buffers whose last reader it was
   into non-owning views (``weak.make_weak_ref``): the pool hands their memory to the
   graphs captured next.
3. Bake: give every region, per slot, the buffer objects its replays use.

With one slot this is exactly one shared pool captured in execution order. With
``share_backward`` (``plan.backward_runs_alone``) every slot's backward graphs and their
static gradient buffers go into one backward pool instead, and each dgrad the plan
keeps past the backward run (``Plan.persistent``: a send reads it later) is copied, by
the backward graph itself, into a buffer of the slot's own pool. Forwards of
``forwards_in_backward_pool`` (``plan.forwards_next_to_backward``) are captured into the
backward pool too; their static inputs stay in the slot's pool. The other forwards' transients
go there as well (``transients.py``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any

import torch

from megatron.core.transformer.cuda_graphs import transients
from megatron.core.transformer.cuda_graphs.plan import FWD, Event, Plan, in_backward_pool
from megatron.core.transformer.cuda_graphs.pool import GraphPool, allocate_into_pool
from megatron.core.transformer.cuda_graphs.region import GraphedRegion, TensorMeta, ValueArg
from megatron.core.transformer.cuda_graphs.scratch import capture_scratch_into
from megatron.core.transformer.cuda_graphs.streams import side_stream
from megatron.core.transformer.cuda_graphs.turn import shape_pool
from megatron.core.transformer.cuda_graphs.weak import make_weak_ref

Buffers = dict[Any, torch.Tensor | None]


def fill_sample(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.normal_()
    else:
        t.zero_()


def sample_tensor(meta: TensorMeta) -> torch.Tensor:
    t = torch.empty(meta.shape, dtype=meta.dtype, device=meta.device)
    fill_sample(t)
    return t.requires_grad_(meta.requires_grad)


def warmup_order(cycles: dict[int, list[Event]]) -> list[int]:
    """Every region of every slot once, by first forward: the regions warmed up (and whose
    parameters are found) before capture. With model chunks (VPP) a slot's cycle holds
    only the chunks it served, so no single cycle need name them all."""
    return list({e.region: None for cycle in cycles.values() for e in cycle if e.phase == FWD})


def capture_all(
    regions: list[GraphedRegion],
    cycles: dict[int, list[Event]],
    plans: dict[int, Plan],
    warmup_steps: int,
    share_backward: bool = False,
    forwards_in_backward_pool: frozenset[int] = frozenset(),
    keep: frozenset = frozenset(),
    turn_pattern: list[int] | None = None,
    scratch_to_backward: bool = False,
    forward_transients: bool = False,
) -> tuple[dict[int, GraphPool], GraphPool | None, dict[int, Buffers]]:
    """Captures every slot's cycle; returns each slot's pool, the shared backward pool
    (None unless ``share_backward``) and each slot's static buffers. Regions in
    ``forwards_in_backward_pool`` capture their forward where backwards go: the shared
    backward pool, or without one the slot's own pool like any forward. Buffers in
    ``keep`` (owner keys) are held for good instead of released. ``turn_pattern``: the
    eager turn's allocations (``turn.shape_pool``), made and freed in the backward pool
    before the first backward graph when the training runs on the capture stream.
    ``scratch_to_backward``: forwards captured into a slot's pool put their scratch blocks
    (``scratch.scratch``) in the shared backward pool (``scratch.capture_scratch_into``).
    ``forward_transients``: forwards captured into a slot's pool put their transients in the shared
    backward pool (``transients.py``; each region's op log is taken after its warm-up)."""
    fwd_order = [regions[r] for r in warmup_order(cycles)]
    logs: dict[int, list[transients.OpRecord]] = {}  # region -> the op log its forward capture follows
    pools: dict[int, GraphPool] = {}
    all_buffers: dict[int, Buffers] = {}
    # Capture where the training runs, unless that is the default stream (which cannot
    # be captured): one set of per-stream resources (cuBLAS workspaces) serves both.
    caller = torch.cuda.current_stream()
    shared_stream = caller != torch.cuda.default_stream()
    stream = caller if shared_stream else side_stream()
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    saved_grads = _save_main_grads(regions)
    gc_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection during capture can free another graph's tensors
    try:
        torch.cuda.synchronize()
        # With a capture stream of its own: iteration 1 ran every GEMM eagerly on the
        # caller's stream, so cuBLAS holds workspaces for it, and the graphs get their
        # own. Drop the caller's: eager GEMMs that remain (partial scopes) re-create them
        # on first use; with whole layers graphed none remain.
        if not shared_stream:
            torch._C._cuda_clearCublasWorkspaces()
        # The eager cache still holds the recording iteration's activations; warm-up
        # would stack its own allocations on top of that eager-peak cache (on another
        # stream it could not even reuse them), and the pools are separate anyway.
        torch.cuda.empty_cache()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for region in fwd_order:
                args = region.sample_args(sample_tensor)
                region.discover_params(args)
                region.warmup(args, max(warmup_steps - 1, 0))
                if forward_transients and share_backward:
                    logs[region.index] = transients.log_forward(region.fn, region.sample_args(sample_tensor))
                del args
        torch.cuda.synchronize()
        # Hand the eager cache (iteration 1's activations, warm-up temporaries) back to
        # the driver: from now on graphed regions allocate from the pools instead.
        torch.cuda.empty_cache()
        backward_pool = GraphPool() if share_backward else None
        for slot, cycle in cycles.items():
            pools[slot] = GraphPool()
            all_buffers[slot] = _capture_slot(
                regions,
                slot,
                cycle,
                plans[slot],
                pools[slot],
                stream,
                backward_pool or pools[slot],
                forwards_in_backward_pool,
                keep,
                turn_pattern if shared_stream else None,
                scratch_to_backward,
                logs,
            )
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    finally:
        if gc_enabled:
            gc.enable()
        torch.set_rng_state(cpu_rng)
        torch.cuda.set_rng_state(cuda_rng)
        for grad, saved in saved_grads:
            grad.copy_(saved)
    for slot, cycle in cycles.items():
        bake(regions, slot, cycle, plans[slot], all_buffers[slot])
    return pools, backward_pool, all_buffers


def _capture_slot(
    regions: list[GraphedRegion],
    slot: int,
    cycle: list[Event],
    plan: Plan,
    pool: GraphPool,
    stream,
    backward_pool: GraphPool,
    forwards_in_backward_pool: frozenset[int] = frozenset(),
    keep: frozenset = frozenset(),
    turn_pattern: list[int] | None = None,
    scratch_to_backward: bool = False,
    transient_logs: dict[int, list[transients.OpRecord]] | None = None,
) -> Buffers:
    """Captures one slot's cycle: forwards into ``pool``, backwards into ``backward_pool``
    (the same pool unless the slots share one for their backward graphs), and so are the
    forwards of ``forwards_in_backward_pool``. ``turn_pattern`` shapes the backward pool
    once the first backward graph's static inputs are there. ``scratch_to_backward``: the
    scratch blocks of forwards captured into ``pool`` allocate in ``backward_pool``, and so do the
    transients of the forwards ``transient_logs`` has a log of (``transients.TransientRouter``)."""
    buffers: Buffers = {}
    shared = backward_pool is not pool
    persistent = set(plan.persistent()) if shared else set()

    def static(key, meta: TensorMeta, fill: Callable[[torch.Tensor], None], into: GraphPool) -> torch.Tensor:
        owner = plan.owner(key)
        if owner not in buffers:
            with torch.cuda.stream(stream), allocate_into_pool(into):
                buf = torch.empty(meta.shape, dtype=meta.dtype, device=meta.device)
            with torch.cuda.stream(stream):
                fill(buf)
            buffers[owner] = buf
        return buffers[owner]

    for position, event in enumerate(cycle):
        region = regions[event.region]
        if event.phase == FWD:
            args = []
            for i, meta in enumerate(region.arg_meta):
                if isinstance(meta, ValueArg):
                    args.append(meta.value)
                    continue
                buf = static(("input", region.index, i), meta, fill_sample, pool)
                args.append(buf.detach().requires_grad_(True) if meta.requires_grad else buf)
                del buf
            into = backward_pool if in_backward_pool(event, forwards_in_backward_pool) else pool
            log = (transient_logs or {}).get(event.region) if into is not backward_pool else None
            routing = transients.router(log, pool, backward_pool) if log else None
            detour = scratch_to_backward and into is not backward_pool
            with capture_scratch_into(pool, backward_pool) if detour else contextlib.nullcontext():
                outs = region.capture_forward(slot, args, into, stream, routing)
            if routing is not None:
                routing.check(region.name)
                region.transients_routed += routing.routed
            buffers.update({("output", region.index, j): o for j, o in enumerate(outs)})
            # No stray local may keep a buffer alive past its planned release.
            del args, outs
        else:
            grad_outputs = [
                static(("grad_output", region.index, j), meta, torch.Tensor.zero_, backward_pool) if rg else None
                for j, (rg, meta) in enumerate(zip(region.output_requires_grad, region.output_meta))
            ]
            keys = [("grad_input", region.index, i) for i, rg in enumerate(region.input_requires_grad) if rg]
            # Dgrads read after the backward run (sent): the graph copies them into the slot's pool.
            metas = [m for m, rg in zip(region.arg_meta, region.input_requires_grad) if rg]
            copy_into = [
                static(key, meta, torch.Tensor.zero_, pool) if key in persistent else None
                for key, meta in zip(keys, metas)
            ]
            if turn_pattern is not None:  # the first backward: the turn runs just before it
                shape_pool(turn_pattern, backward_pool, stream)
                turn_pattern = None
            dgrads = region.capture_backward(slot, grad_outputs, backward_pool, stream, copy_into)
            buffers.update(zip(keys, dgrads))
            del grad_outputs, dgrads
        for key in plan.releases_at(position):
            if key in keep:
                continue
            t = buffers.get(key)
            if t is not None:
                buffers[key] = make_weak_ref(t)
            del t
        stats = (backward_pool if in_backward_pool(event, forwards_in_backward_pool) else pool).stats()
        graphs = region.slots[slot]
        graphs.pool_reserved_after[event.phase] = stats.reserved_bytes
        graphs.pool_live_after[event.phase] = stats.live_bytes
    return buffers


def bake(regions: list[GraphedRegion], slot: int, cycle: list[Event], plan: Plan, buffers: Buffers) -> None:
    """Gives each region of ``slot`` the buffer objects (weak or strong) its replays use."""

    def get(key):
        return buffers.get(plan.owner(key))

    for region in regions:
        if region.index not in {e.region for e in cycle}:
            continue
        inputs = []
        fwd_position = plan.position(FWD, region.index)
        for i, meta in enumerate(region.arg_meta):
            if not isinstance(meta, TensorMeta):
                continue
            key = ("input", region.index, i)
            src = region.sources[i]
            # A hand-off is never copied into: it is the producer's output buffer.
            # The first reader of a shared buffer copies; the others find it filled.
            copy = src.kind == "own" or (
                src.kind == "shared" and plan.buffers[plan.owner(key)].readers[0] == fwd_position
            )
            if src.kind == "shared" and not copy:
                continue
            inputs.append((i, get(key), copy))
        outputs = [get(("output", region.index, j)) for j in range(region.num_outputs)]
        grad_outputs = [
            (get(("grad_output", region.index, j)), True)
            if rg and ("grad_output", region.index, j) in plan.buffers
            else None
            for j, rg in enumerate(region.output_requires_grad)
        ]
        grad_inputs = [
            (get(("grad_input", region.index, i)), plan.buffers[("grad_input", region.index, i)].copy_out)
            for i, rg in enumerate(region.input_requires_grad)
            if rg and ("grad_input", region.index, i) in plan.buffers
        ]
        region.finish_capture(slot, inputs, outputs, grad_outputs, grad_inputs)


def poison_plan(plan: Plan, buffers: Buffers) -> dict[int, list[torch.Tensor]]:
    """Debug mode: per cycle position, the floating buffers that die with that event.

    They are dead from there until their next writer, so a later read (an aliasing bug)
    sees NaN instead of stale but plausible numbers. Memory that a kept buffer still
    uses is never poisoned.
    """
    strong_late = {}
    for key, spec in plan.buffers.items():
        t = buffers.get(key)
        if spec.alias_of is None and t is not None and spec.dead_after is None:
            strong_late[t.data_ptr()] = key
    poison: dict[int, list[torch.Tensor]] = {}
    for key, spec in plan.buffers.items():
        t = buffers.get(key)
        if spec.alias_of is not None or t is None or spec.dead_after is None or t.data_ptr() in strong_late:
            continue
        if t.is_floating_point():
            poison.setdefault(spec.dead_after, []).append(t)
    return poison


def _save_main_grads(regions: list[GraphedRegion]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(main_grad, host copy) of every parameter a region may touch (once, at capture)."""
    params = {id(p): p for r in regions for p in r.module.parameters() if hasattr(p, "main_grad")}
    return [(p.main_grad, p.main_grad.to("cpu")) for p in params.values()]

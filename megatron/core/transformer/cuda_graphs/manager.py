"""The per-run graph manager: routes regions through record -> capture -> replay.

Lifecycle (training only; eval and no-grad calls always run eagerly):

1. ``apply(model)`` patches each selected region method on its layer instance to go
   through the manager (model classes carry no capture code).
2. Iteration 1 runs eagerly and records every region's forward and backward, in order,
   plus where each tensor argument came from (a hand-off from the previous region's
   output, a tensor shared by many regions, or a tensor of its own).
3. ``end_of_iteration()`` after iteration 1: warm up each region, then capture every
   forward and backward graph in the recorded order into one pool, following the
   hand-off plan (``buffers.py``) and releasing buffers through weak references as soon
   as the plan allows.
4. Later iterations replay. Each replay checks it is the event the capture order
   expects next; the wrong order raises instead of silently reading freed memory.
"""

import gc
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from megatron.core.transformer.cuda_graphs import regions as regions_lib
from megatron.core.transformer.cuda_graphs.buffers import (
    BWD,
    FWD,
    OWN,
    Event,
    Plan,
    RegionIO,
    Source,
    build_plan,
    split_cycle,
)
from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.cuda_graphs.replay import GraphReplay
from megatron.core.transformer.cuda_graphs.runner import GraphedRegion

RECORD, CAPTURED, OFF = "record", "captured", "off"


class CudaGraphManager:
    """Owns the regions, the shared pool, the recorded order and the replay cursor.

    Args:
        config: The ``--cuda-graph-*`` settings.
        on_wgrad_ready: Called after every backward replay as ``(params, event,
            event_only)``: the parameters whose main_grad the graph completed, the CUDA
            event recorded after it (DDP waits on it before reducing), and parameters
            the graph wrote part of (a tied weight) whose bucket must wait on the event
            but which eager autograd completes later.
    """

    def __init__(self, config: CudaGraphConfig, *, on_wgrad_ready: Callable | None = None):
        self.config = config
        self.on_wgrad_ready = on_wgrad_ready
        self.regions: list[GraphedRegion] = []
        self.state = OFF
        if config.enabled:
            if torch.cuda.is_available():
                self.state = RECORD
            else:
                warnings.warn(
                    "--cuda-graph-impl local: CUDA is not available, so CUDA graphs are off and the run is eager.",
                    stacklevel=2,
                )
        self.order: list[Event] = []
        self.cycle: list[Event] = []
        self.cursor = 0
        self.plan: Plan | None = None
        self.pool = None
        self.buffers: dict[Any, torch.Tensor | None] = {}
        self.capture_seconds = 0.0
        self._outputs: dict[int, Any] = {}
        self._inputs: dict[int, Any] = {}
        self._shared_groups = 0
        self._anchor: torch.Tensor | None = None
        self._poison: dict[int, list[torch.Tensor]] = {}
        self._debug_checked: dict[int, int] = {}

    @property
    def active(self) -> bool:
        return self.state != OFF

    # ------------------------------------------------------------------ setup
    def apply(self, model: torch.nn.Module) -> "CudaGraphManager":
        """Routes the selected regions of every graphable layer of ``model`` through us."""
        layers = regions_lib.graphable_layers(model)
        model_config = getattr(layers[0], "config", None) if layers else None
        selected = regions_lib.resolve(self.config.cuda_graph_scope, [type(layer) for layer in layers], model_config)
        if not self.config.enabled:
            return self
        names = {m: n for n, m in model.named_modules()}
        picked = [
            (layer, spec.method, f"{names[layer]}.{spec.name}", [])
            for layer in layers
            for spec in selected[type(layer)]
        ]
        head = regions_lib.head_region(model)
        if (
            head is not None
            and self.config.cuda_graph_postprocess
            and layers
            and regions_lib.head_follows(selected[type(layers[-1])], type(layers[-1]))
        ):
            module, spec = head
            picked.append((module, spec.method, f"{names[module]}.postprocess".lstrip("."), spec.shared_params(module)))
        for module, method, name, shared in picked:
            region = GraphedRegion(self, module, method, name, len(self.regions), shared_params=shared)
            self.regions.append(region)
            setattr(module, method, self._route(region))
        return self

    def _route(self, region: GraphedRegion) -> Callable:
        def routed(*args, **kwargs):
            return self.dispatch(region, args, kwargs)

        routed.__wrapped__ = region.fn
        return routed

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, region: GraphedRegion, args, kwargs):
        if (
            self.state == OFF
            or not region.module.training
            or not torch.is_grad_enabled()
            or (self.state == CAPTURED and torch.cuda.is_current_stream_capturing())
        ):
            return region.fn(*args, **kwargs)
        args = region.bind(args, kwargs)
        if self.state == RECORD:
            return region.record_forward(args)
        region.check_args(args)
        outs = GraphReplay.apply(region, self._anchor, *args)
        if (
            self.config.cuda_graph_debug
            and self._debug_checked.get(region.index, 0) < self.config.cuda_graph_debug_replays
        ):
            self._debug_compare(region, args, outs)
        return region._join_outputs(outs)

    # ------------------------------------------------------------------ recording
    def record_event(self, event: Event) -> None:
        if self.state == RECORD:
            self.order.append(event)

    def note_output(self, t: torch.Tensor, region: int, index: int) -> None:
        self._outputs[id(t)] = (weakref.ref(t), region, index)

    def source_of(self, t: torch.Tensor, region: int, arg: int) -> Source:
        """Where a region's tensor argument comes from, judged by tensor identity."""
        hit = self._outputs.get(id(t))
        if hit is not None and hit[0]() is t:
            return Source("handoff", hit[1], hit[2])
        seen = self._inputs.get(id(t))
        if seen is not None and seen[0]() is t:
            ref, first_region, first_arg, group = seen
            if group is None:
                group = self._shared_groups
                self._shared_groups += 1
                self.regions[first_region].sources[first_arg] = Source("shared", index=group)
                self._inputs[id(t)] = (ref, first_region, first_arg, group)
            return Source("shared", index=group)
        self._inputs[id(t)] = (weakref.ref(t), region, arg, None)
        return OWN

    # ------------------------------------------------------------------ replay checks
    def check_order(self, event: Event, region: GraphedRegion) -> None:
        expected = self.cycle[self.cursor]
        if event != expected:
            want = self.regions[expected.region]
            raise RuntimeError(
                f"CUDA graph replay out of capture order: expected the {expected.phase} graph of {want.name} "
                f"(event {self.cursor} of {len(self.cycle)} in the cycle), got the {event.phase} graph of "
                f"{region.name}. Graphs share one memory pool and are only correct when replayed in capture "
                "order, once per micro-batch."
            )
        self.cursor = (self.cursor + 1) % len(self.cycle)

    def after_replay(self) -> None:
        """Debug mode: poison the buffers that died with the event that just replayed.

        They are dead from here until their next writer, so a later read (an aliasing
        bug) sees NaN instead of stale but plausible numbers.
        """
        position = (self.cursor - 1) % len(self.cycle)
        for t in self._poison.get(position, ()):
            t.fill_(float("nan"))

    def wgrads_ready(self, params, event, event_only=()) -> None:
        if self.on_wgrad_ready is not None:
            self.on_wgrad_ready(params, event, event_only)

    def end_of_iteration(self) -> None:
        """Called by the trainer after every training iteration."""
        if self.state == RECORD and self.order:
            self.capture()
        elif self.state == CAPTURED and self.cursor != 0:
            raise RuntimeError(
                f"CUDA graphs: the iteration ended in the middle of a replay cycle ({self.cursor} of "
                f"{len(self.cycle)} events ran); a forward without its backward breaks buffer reuse."
            )

    def start_recording(self) -> None:
        """Records even without CUDA, to inspect the order and plan (CPU tests)."""
        self.state = RECORD

    def make_plan(self) -> Plan:
        """The cycle and hand-off plan of what the recording iteration saw."""
        self.cycle = split_cycle(self.order)
        ios = [RegionIO(r.name, list(r.sources), r.input_requires_grad, r.output_requires_grad) for r in self.regions]
        self.plan = build_plan(self.cycle, ios)
        return self.plan

    # ------------------------------------------------------------------ capture
    def capture(self) -> None:
        from megatron.core.transformer.cuda_graphs.mempool import GraphPool, allocate_into_pool
        from megatron.core.transformer.cuda_graphs.streams import side_stream
        from megatron.core.transformer.cuda_graphs.weakref import make_weak_ref

        start = time.perf_counter()
        plan = self.make_plan()
        self._outputs.clear()
        self._inputs.clear()
        device = torch.cuda.current_device()
        self.pool = pool = GraphPool()
        # Capture where the training runs, unless that is the default stream (which cannot
        # be captured): one set of per-stream resources (cuBLAS workspaces) serves both.
        caller = torch.cuda.current_stream()
        shared_stream = caller != torch.cuda.default_stream()
        stream = caller if shared_stream else side_stream()
        cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
        # Warm-up runs real backwards: fused wgrads land in main_grad. Keep a host copy.
        saved_grads = self._save_main_grads()
        gc_enabled = gc.isenabled()
        gc.collect()
        gc.disable()  # a collection during capture can free another graph's tensors
        try:
            torch.cuda.synchronize()
            # With a capture stream of its own: iteration 1 ran every GEMM eagerly on the
            # caller's stream, so cuBLAS holds two 32 MiB workspaces (Hopper) for it, and the
            # graphs get their own. Drop the caller's: eager GEMMs that remain (partial
            # scopes) re-create them on first use; with whole layers graphed none remain.
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None and not shared_stream:
                clear_workspaces()
            # The eager cache still holds the recording iteration's activations; warm-up
            # would stack its own allocations on top of that eager-peak cache (on another
            # stream it could not even reuse them), and the pool is separate anyway.
            torch.cuda.empty_cache()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for region in self._fwd_ordered_regions():
                    args = region.sample_args(self._sample)
                    region.discover_params(args)
                    region.warmup(args, max(self.config.cuda_graph_warmup_steps - 1, 0))
                    del args
            torch.cuda.synchronize()
            # Hand the eager cache (iteration 1's activations, warm-up temporaries) back to
            # the driver: from now on graphed regions allocate from the pool instead.
            torch.cuda.empty_cache()
            buffers: dict[Any, torch.Tensor | None] = {}

            def static(key, meta, fill):
                owner = plan.owner(key)
                if owner not in buffers:
                    shape, dtype, dev, _ = meta
                    with torch.cuda.stream(stream), allocate_into_pool(pool):
                        buf = torch.empty(shape, dtype=dtype, device=dev)
                    with torch.cuda.stream(stream):
                        fill(buf)
                    buffers[owner] = buf
                return buffers[owner]

            for position, event in enumerate(self.cycle):
                region = self.regions[event.region]
                if event.phase == FWD:
                    args = []
                    for i, (kind, meta) in enumerate(region.arg_meta):
                        if kind == "value":
                            args.append(meta)
                            continue
                        buf = static(("input", region.index, i), meta, _fill_sample)
                        args.append(buf.detach().requires_grad_(True) if meta[3] else buf)
                        del buf
                    outs = region.capture_forward(args, pool, stream)
                    buffers.update({("output", region.index, j): o for j, o in enumerate(outs)})
                    # No stray local may keep a buffer alive past its planned release.
                    del args, outs
                else:
                    grad_outputs = [
                        static(("grad_output", region.index, j), meta, _fill_zero) if rg else None
                        for j, (rg, meta) in enumerate(zip(region.output_requires_grad, region.output_meta))
                    ]
                    dgrads = region.capture_backward(grad_outputs, pool, stream)
                    keys = [("grad_input", region.index, i) for i, rg in enumerate(region.input_requires_grad) if rg]
                    buffers.update(zip(keys, dgrads))
                    del grad_outputs, dgrads
                for key in plan.releases_at(position):
                    t = buffers.get(key)
                    if t is not None:
                        buffers[key] = make_weak_ref(t)
                    del t
                pool_stats = pool.stats()
                region.pool_reserved_after[event.phase] = pool_stats.reserved_bytes
                region.pool_live_after[event.phase] = pool_stats.live_bytes
                pool.register_graph()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
        finally:
            if gc_enabled:
                gc.enable()
            torch.set_rng_state(cpu_rng)
            torch.cuda.set_rng_state(cuda_rng)
            for grad, saved in saved_grads:
                grad.copy_(saved)
        self.buffers = buffers
        self._bake(buffers)
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.state = CAPTURED
        self.cursor = 0
        self.capture_seconds = time.perf_counter() - start
        pool.add_capture_time(self.capture_seconds)
        pool.strong_bytes = self.strong_bytes()

    def _save_main_grads(self) -> list[Any]:
        """(main_grad, host copy) of every parameter a region may touch (once, at capture)."""
        params = {id(p): p for r in self.regions for p in r.module.parameters() if hasattr(p, "main_grad")}
        return [(p.main_grad, p.main_grad.to("cpu")) for p in params.values()]

    def _fwd_ordered_regions(self) -> list[GraphedRegion]:
        return [self.regions[e.region] for e in self.cycle if e.phase == FWD]

    @staticmethod
    def _sample(_i, meta) -> torch.Tensor:
        shape, dtype, device, rg = meta
        t = torch.empty(shape, dtype=dtype, device=device)
        _fill_sample(t)
        return t.requires_grad_(rg)

    def _bake(self, buffers) -> None:
        plan = self.plan
        get = lambda key: buffers.get(plan.owner(key))  # noqa: E731
        for region in self.regions:
            inputs = []
            for i, (kind, _meta) in enumerate(region.arg_meta):
                if kind != "tensor":
                    continue
                key = ("input", region.index, i)
                src = region.sources[i]
                # A hand-off is never copied into: it is the producer's output buffer.
                # The first reader of a shared buffer copies; the others find it filled.
                copy = src.kind == "own" or (
                    src.kind == "shared"
                    and plan.buffers[plan.owner(key)].readers[0] == self.cycle.index(Event(FWD, region.index))
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
                if rg
            ]
            region.finish_capture(inputs, outputs, grad_outputs, grad_inputs)
        if self.config.cuda_graph_debug:
            self._plan_poison(buffers)

    def _plan_poison(self, buffers) -> None:
        strong_late = {}
        for key, spec in self.plan.buffers.items():
            t = buffers.get(key)
            if spec.alias_of is None and t is not None and spec.dead_after is None:
                strong_late[t.data_ptr()] = key
        for key, spec in self.plan.buffers.items():
            t = buffers.get(key)
            if spec.alias_of is not None or t is None or spec.dead_after is None or t.data_ptr() in strong_late:
                continue
            if t.is_floating_point():
                self._poison.setdefault(spec.dead_after, []).append(t)

    # ------------------------------------------------------------------ accounting
    def strong_bytes(self) -> int:
        """Bytes of static buffers we still hold strongly (each storage counted once)."""
        from megatron.core.transformer.cuda_graphs.weakref import is_weak_ref

        seen = {}
        held = list(self.buffers.values()) + [g for r in self.regions for g in r.shared_grads]
        for t in held:
            if t is not None and not is_weak_ref(t):
                seen[t.data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def num_graphs(self) -> int:
        return sum((r.fwd_graph is not None) + (r.bwd_graph is not None) for r in self.regions)

    def stats(self) -> dict[str, Any]:
        """Plain-typed accounting for logs, metrics and tools (takes an allocator snapshot)."""
        if self.pool is None:
            return {"graphs": 0}
        s = self.pool.stats()
        return {
            "graphs": self.num_graphs(),
            "pool_reserved_bytes": int(s.reserved_bytes),
            "pool_live_bytes": int(s.live_bytes),
            "strong_bytes": int(self.strong_bytes()),
            "capture_seconds": float(self.capture_seconds),
            "regions": [
                {
                    "name": r.name,
                    "pool_reserved_after_fwd": r.pool_reserved_after.get(FWD),
                    "pool_reserved_after_bwd": r.pool_reserved_after.get(BWD),
                    "pool_live_after_fwd": r.pool_live_after.get(FWD),
                    "pool_live_after_bwd": r.pool_live_after.get(BWD),
                }
                for r in self.regions
            ],
        }

    # ------------------------------------------------------------------ debug
    def _debug_compare(self, region: GraphedRegion, args, outs) -> None:
        self._debug_checked[region.index] = self._debug_checked.get(region.index, 0) + 1
        with torch.no_grad():
            ref = region._split_outputs(region.fn(*args))
        for j, (got, want) in enumerate(zip(outs, ref)):
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2, equal_nan=False):
                diff = (got.float() - want.float()).abs().max().item()
                raise RuntimeError(
                    f"--cuda-graph-debug: replay of {region.name} output {j} differs from an eager run "
                    f"(max abs diff {diff:.3e}); a static buffer was overwritten before it was read."
                )


def _fill_sample(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.normal_()
    else:
        t.zero_()


def _fill_zero(t: torch.Tensor) -> None:
    t.zero_()

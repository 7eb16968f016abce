"""What is live in our graph pool at its high-water mark, grouped by allocation site.

The pool's reserved size is set during capture, at the moment its live bytes peak;
replays allocate nothing. This tool records the allocator's history while iteration 1
records and captures, replays the trace of the pool's segments, finds that moment and
prints what was live then: bytes and block count per allocation site (the innermost
frames in this repository), and which capture (region, forward or backward) was running;
then each time a segment grew though its free bytes would have held the request (fragmentation).

The traces are read by ``tools/alloc_trace.py``; this tool runs the training that records them.

``--dump FILE`` writes the trace read (with allocation sites) as gzipped JSON, small enough
to copy off the GPU machine and study there.

With ``--steady`` it looks at a steady-state iteration instead (the third): the pools no
longer allocate then, so the device's peak is the pools' reserved bytes plus the peak of
everything else; it prints that peak and what was live at it, grouped the same way. Run
it for an eager mode too (``--mode eager``) to see what the graphs added and removed.

With ``--growth`` it lists every growth of the eager cache (the segments outside our pools), from
before the model is built to the end of iteration 3: the phase, the request that made it, whether the
segment's free bytes would have held it; then each phase's peak reserved memory (which phase sets the
run's: the capture or the steady iterations), and what lives outside the pools when the capture starts
and at the end, made after the model's build. It shows where a graphed run's cache reserves more than
it holds (``--empty-cache-after-capture``: what if the capture ended by releasing the unused pages).

``--vpp-rank R`` runs the model as two chunks in the interleaved order of rank R of a
two-stage pipeline, in one process (``simulate.forward_backward_chunks``, as the one-GPU
VPP memory test does); the capture analysis follows slot 0's pool, or with
``--all-pools`` every slot's pool and the shared backward pool.

Usage (on a GPU):
    python tools/pool_peak.py --config dense8 --mode local:attn [--extra=--deterministic-mode]
    python tools/pool_peak.py --config dense8 --mode eager --steady
    python tools/pool_peak.py --config dense8 --mode local:layer --steady --vpp-rank 1 \
        --extra="--global-batch-size 8 --untie-embeddings-and-output-weights --deterministic-mode"
"""

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.transformer.cuda_graphs.pool import _pool_id  # noqa: E402
from tools.alloc_trace import (  # noqa: E402
    allocation_site,
    by_site,
    cache_growth,
    capture_at,
    last_mark,
    live_outside,
    outside_peak,
    pool_growth,
    pool_peak,
    pool_segments,
    segment_pool,
    segments_at_peak,
)


def main():
    import torch

    import pretrain_hybrid
    from megatron.core import parallel_state
    from megatron.core.transformer.cuda_graphs import region as runner
    from megatron.training.data import build_data_iterators
    from megatron.training.training import build_trainer
    from tools.graph_bench import COMMON, CONFIGS, mode_flags

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="dense8")
    parser.add_argument("--mode", default="local:attn", help="a local:* mode of graph_bench.py")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--extra", default="", help="more training flags, e.g. --extra=--deterministic-mode (the = form)"
    )
    parser.add_argument("--steady", action="store_true", help="the device peak of iteration 3 (see the docstring)")
    parser.add_argument("--vpp-rank", type=int, choices=(0, 1), help="two chunks in rank R's interleaved order")
    parser.add_argument("--all-pools", action="store_true", help="every slot's pool and the shared backward pool")
    parser.add_argument(
        "--growth", action="store_true", help="every growth of the eager cache from the model's build on (docstring)"
    )
    parser.add_argument(
        "--empty-cache-after-capture",
        action="store_true",
        help="with --growth: what if the eager cache's unused pages went back to the driver once the capture ends",
    )
    parser.add_argument(
        "--dump",
        help="gzipped JSON for offline study: the first pool's capture trace (with --all-pools one file per pool, "
        "the pool's name before .json; with --steady: the measured iteration's)",
    )
    args = parser.parse_args()

    argv = f"{CONFIGS[args.config]} {COMMON} --train-iters 10 {mode_flags(args.mode)} {args.extra}".split()
    providers = pretrain_hybrid.providers(argv)
    if args.steady or args.growth:
        from megatron.core.transformer.cuda_graphs.pool import use_expandable_segments

        use_expandable_segments()  # eager on the allocator settings graphs use, for a fair comparison
    if args.growth:
        return growth(lambda: with_schedule(build_trainer(argv, **providers), args.vpp_rank), args)
    if args.steady:
        return steady(with_schedule(build_trainer(argv, **providers), args.vpp_rank), args)
    trainer = with_schedule(build_trainer(argv, **providers), args.vpp_rank)
    device = torch.cuda.current_device()
    captures = []  # (trace length when the capture began, region, phase)

    def note(method, phase):
        def wrapped(self, *a, **k):
            captures.append((len(torch.cuda.memory._snapshot()["device_traces"][device]), self.name, phase))
            return method(self, *a, **k)

        return wrapped

    runner.GraphedRegion.capture_forward = note(runner.GraphedRegion.capture_forward, "forward")
    runner.GraphedRegion.capture_backward = note(runner.GraphedRegion.capture_backward, "backward")
    it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
    trainer.model.train()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    trainer.train_step(it)  # iteration 1: records, then captures every graph
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if not trainer.graphs.captured:
        raise SystemExit(f"--mode {args.mode} captured no graphs")
    session = trainer.graphs
    pools = {f"slot {s}": p for s, p in session.pools.items()}
    if session.backward_pool is not None:
        pools["shared backward"] = session.backward_pool
    for name in pools if args.all_pools else list(pools)[:1]:
        handle = pools[name].handle
        if args.dump:  # with --all-pools one file per pool: FILE with the pool's name before the suffix
            path = args.dump if not args.all_pools else args.dump.replace(".json", f".{name.replace(' ', '_')}.json")
            dump_trace(snapshot, handle, device, captures, path)
        peak, at, blocks = pool_peak(snapshot, handle, device)
        print(
            f"{args.config} {args.mode}: {name} pool reserved {pools[name].stats().reserved_bytes / 2**20:.1f} MiB; "
            f"live peak {peak / 2**20:.1f} MiB during the {capture_at(captures, at)}"
        )
        for site, nbytes, n in by_site(blocks)[: args.top]:
            print(f"  {nbytes / 2**20:9.1f} MiB  x{n:<4d} {site}")
        print("pool segments (reserved, live at the peak, stream):")
        for total, live, stream in segments_at_peak(snapshot, handle, device, blocks):
            print(f"  {total / 2**20:9.1f} MiB reserved {live / 2**20:9.1f} MiB live  stream {stream:#x}")
        grew = [g for g in pool_growth(snapshot, handle, device) if g.fragmented]
        print(
            f"growth the free bytes would have held ({len(grew)}: the reserve grew for want of a free run long enough):"
        )
        for g in grew:
            print(
                f"  +{g.mapped / 2**20:.1f} MiB to {g.reserved / 2**20:.1f} for {g.request / 2**20:.1f} MiB, "
                f"{g.live / 2**20:.1f} MiB live, during the {capture_at(captures, g.index)}: {g.site}"
            )
    parallel_state.destroy(trainer.pg)


def dump_trace(snapshot: dict, pool_id, device: int, captures: list, path: str) -> None:
    """Writes one pool's segments and its alloc/free trace and the captures' start indices (see ``_dump``)."""
    segments = [
        {"address": s["address"], "total_size": s["total_size"], "stream": s.get("stream", 0)}
        for s in pool_segments(snapshot, [pool_id], device)
    ]
    ranges = [(s["address"], s["address"] + s["total_size"]) for s in segments]

    def in_pool(e: dict) -> bool:
        return e.get("addr") is not None and any(lo <= e["addr"] < hi for lo, hi in ranges)

    _dump(path, snapshot, device, segments, in_pool, captures=captures)


def dump_steady(snapshot: dict, device: int, path: str) -> None:
    """Writes the measured iteration's whole alloc/free trace and every segment of the device (see ``_dump``)."""
    segments = [
        {k: s.get(k) for k in ("address", "total_size", "stream", "segment_pool_id", "allocated_size")}
        for s in snapshot["segments"]
        if s.get("device", device) == device
    ]
    _dump(path, snapshot, device, segments, lambda e: True)


def _dump(path: str, snapshot: dict, device: int, segments: list, keep, **extra) -> None:
    """Gzipped JSON of ``segments`` and the trace entries ``keep`` accepts, each as
    ``[index, action, address, size, allocation site]``: small enough to copy off the GPU machine."""
    import gzip
    import json

    trace = [
        [i, e["action"], e.get("addr"), e.get("size"), allocation_site(e, depth=4)]
        for i, e in enumerate(snapshot["device_traces"][device])
        if keep(e)
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"segments": segments, "trace": trace, **extra}, f, default=str)


def with_schedule(trainer, vpp_rank: int | None):
    """``trainer``, running two chunks in rank ``vpp_rank``'s interleaved order when given."""
    if vpp_rank is not None:
        import functools

        from megatron.core.pipeline_parallel import simulate

        trainer.schedule = functools.partial(
            simulate.forward_backward_chunks, num_chunks=2, pp_size=2, pp_rank=vpp_rank
        )
    return trainer


class StepTrace:
    """The simulated schedule's steps (``--vpp-rank``), each with the bytes allocated
    outside our pools when it starts and at its peak, while ``on``."""

    def __init__(self):
        from megatron.core.pipeline_parallel import simulate

        self.rows: list[tuple[object, int, int]] = []  # (SlotStep, start, peak)
        self.on = False
        self.pool_live = 0  # our pools' live blocks count as allocated; replays allocate none
        real = simulate.slot_steps

        def traced(order, weights=None):
            steps = real(order, weights)
            return self._wrap(steps) if self.on else steps

        simulate.slot_steps = traced

    def _wrap(self, steps):
        import torch

        trace = self

        class Steps(list):
            def __iter__(self):
                for step in list.__iter__(self):
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start = torch.cuda.memory_allocated()
                    yield step
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated()
                    trace.rows.append((step, start - trace.pool_live, peak - trace.pool_live))

        return Steps(steps)

    def print(self) -> None:
        for step, start, peak in self.rows:
            print(
                f"  {step.phase} chunk {step.chunk} micro-batch {step.microbatch} slot {step.slot}: "
                f"starts at {start / 2**20:8.1f} MiB, peaks at {peak / 2**20:8.1f} MiB"
            )


def growth(build, args) -> None:
    """Prints every growth of the eager cache (the segments outside our pools) from before the model is
    built to the end of iteration 3, with the phase it happened in, the request that made it, and whether
    the segment's free bytes would have held that request; then what the cache and the pools reserve, and
    each phase's peak reserved memory, and what lives outside the pools at the capture's start and at the
    end, made after the build. With ``--empty-cache-after-capture``, ``torch.cuda.empty_cache()`` runs
    once the capture ends."""
    import torch

    from megatron.core import parallel_state
    from megatron.training.data import build_data_iterators

    device = torch.cuda.current_device()
    marks = []  # (trace length, phase beginning there)
    peaks = []  # (phase, its peak reserved bytes)

    def mark(phase: str | None) -> None:
        torch.cuda.synchronize()
        if marks:
            peaks.append((marks[-1][1], torch.cuda.max_memory_reserved()))
        torch.cuda.reset_peak_memory_stats()
        if phase is not None:
            marks.append((len(torch.cuda.memory._snapshot()["device_traces"][device]), phase))

    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    mark("the model's build")
    trainer = build()
    it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
    trainer.model.train()
    session = trainer.graphs
    if session is not None and session.active:
        capture = session.capture

        def marked_capture():
            mark("the capture")
            capture()
            if args.empty_cache_after_capture:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            mark("iteration 1 after the capture")

        session.capture = marked_capture
    for i in (1, 2, 3):
        mark(f"iteration {i}")
        trainer.train_step(it)
    mark(None)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    pools = [p.handle for p in session.all_pools()] if session is not None and session.captured else []
    rows = cache_growth(snapshot, pools, device)
    mib = 2**20
    print(f"{args.config} {args.mode} {args.extra}: every growth of the eager cache ({len(rows)}; * the free bytes")
    print("would have held the request; reserved and live: that stream's segments of that block size)")
    for g in rows:
        print(
            f"  {'*' if g.fragmented else ' '} +{g.mapped / mib:.1f} MiB to {g.reserved / mib:.1f} for "
            f"{g.request / mib:.2f} MiB, {g.live / mib:.1f} MiB live, during {last_mark(marks, g.index)[1]}: {g.site}"
        )
    ours = {_pool_id(p) for p in pools}
    cache = [s for s in snapshot["segments"] if segment_pool(s) not in ours]
    for kind in ("large", "small"):
        held = [s for s in cache if s.get("segment_type") == kind]
        print(
            f"eager cache at the end, {kind} blocks: reserved {sum(s['total_size'] for s in held) / mib:.1f} MiB, "
            f"allocated {sum(s['allocated_size'] for s in held) / mib:.1f} MiB, "
            f"{len({s.get('stream') for s in held})} stream(s)"
        )
    built = next(at for at, phase in marks if phase == "iteration 1")
    ends = [(at, f"the start of {phase}") for at, phase in marks if phase == "the capture"]
    for at, when in ends + [(len(snapshot["device_traces"][device]), "the end")]:
        left = live_outside(snapshot, pools, device, built, at)
        print(f"live outside the pools at {when}, allocated after the model's build, by stream and site:")
        rows = collections.Counter()
        for i, e in left:
            rows[(e.get("stream", 0), last_mark(marks, i)[1], allocation_site(e))] += e["size"]
        for (stream, phase, site), nbytes in rows.most_common(args.top):
            print(f"  {nbytes / mib:8.2f} MiB  stream {stream:#x}, during {phase}: {site}")
    reserved = session.pool_stats()[0] if pools else 0
    print("peak reserved per phase (MiB): " + ", ".join(f"{phase} {peak / mib:.1f}" for phase, peak in peaks))
    print(
        f"pools reserved {reserved / mib:.1f} MiB; max reserved {max(p for _, p in peaks) / mib:.1f} MiB "
        "(from the model's build on)"
    )
    parallel_state.destroy(trainer.pg)


def steady(trainer, args) -> None:
    """Prints iteration 3's device peak: pools reserved + the peak of everything else
    (with ``--vpp-rank``, iteration 4's, after a traced iteration 3: see :class:`StepTrace`)."""
    import torch

    from megatron.core import parallel_state
    from megatron.training.data import build_data_iterators

    device = torch.cuda.current_device()
    it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
    trainer.model.train()
    session = trainer.graphs
    phases = []  # (what ran, max reserved bytes, max allocated bytes)
    if session is not None:
        capture = session.capture

        def timed_capture():  # iteration 1: the recording's peak, then the capture's
            torch.cuda.synchronize()
            phases.append(("recording", torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()))
            torch.cuda.reset_peak_memory_stats()
            capture()
            torch.cuda.synchronize()
            phases.append(("capture", torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()))

        session.capture = timed_capture
    for i in (1, 2):
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step(it)
        torch.cuda.synchronize()
        if not phases:
            phases.append(("iteration", torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()))
        parts = ", ".join(f"{what} {r / 2**20:.1f} / {a / 2**20:.1f}" for what, r, a in phases)
        print(f"iteration {i}: max reserved / allocated MiB: {parts}")
        phases.clear()
    if session is not None:
        del session.capture
    pools = [p.handle for p in session.all_pools()] if session is not None and session.captured else []
    reserved = session.pool_stats()[0] if pools else 0
    trace = StepTrace() if args.vpp_rank is not None else None
    if trace is not None:  # a step of its own, before the one measured: the trace syncs
        trace.pool_live = session.pool_stats()[1] if pools else 0
        trace.on = True
        trainer.train_step(it)
        trace.on = False
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    trainer.train_step(it)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = outside_peak(snapshot, pools, device)
    if args.dump:
        dump_steady(snapshot, device, args.dump)
    outside_before = before - sum(  # live pool blocks are counted in memory_allocated too
        int(s["allocated_size"]) for s in pool_segments(snapshot, pools, device)
    )
    mib = 2**20
    print(
        f"{args.config} {args.mode} {args.extra}: steady peak = pools reserved {reserved / mib:.1f} + outside live "
        f"before the step {outside_before / mib:.1f} + step peak {peak / mib:.1f} = "
        f"{(reserved + outside_before + peak) / mib:.1f} MiB; max reserved {torch.cuda.max_memory_reserved() / mib:.1f} MiB"
    )
    for site, nbytes, n in by_site(blocks)[: args.top]:
        print(f"  {nbytes / 2**20:9.1f} MiB  x{n:<4d} {site}")
    if trace is not None:
        print("per step of the order (the step before the measured one; outside our pools):")
        trace.print()
    parallel_state.destroy(trainer.pg)


if __name__ == "__main__":
    main()

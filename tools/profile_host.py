"""Where a training step's host time goes: ms per phase, aten ops, host syncs, Python hot spots.

Builds a trainer from a ``graph_bench`` config and mode (``--tiny`` shrinks its sizes so
kernels are cheap and a step's time is mostly host overhead; ``--set FLAG=VALUE``
overrides any flag of the config), runs ``--warmup`` steps, then:

1. times ``--steps`` steps with no instrumentation but phase timers: host ms per step (median) in
   zero_grad, forward (the model's forward), backward, grad_sync, optimizer, and the rest
   (loss, data, bookkeeping); plus the device-synchronised wall ms of a step. On CUDA the
   phase times are host times (no sync inside a step), so a phase that waits on the
   device shows it only where it syncs;
2. counts, over one more step, the aten ops each phase dispatches (a ``TorchDispatchMode``:
   the ops below autograd, what becomes kernels) and the host syncs: calls of
   ``Tensor.tolist / item / cpu / numpy / __bool__ / __int__ / __float__`` and aten ops
   whose output size depends on the data (``nonzero``, ``masked_select``, ...), each with
   the source line it came from; on CUDA also the warnings of
   ``torch.cuda.set_sync_debug_mode("warn")``;
3. runs cProfile over ``--steps`` more steps, forward, backward and optimizer in separate
   profiles, and prints the top functions by cumulative and by self time. Backward on CUDA
   runs in autograd's device thread: its profile is enabled there by a hook on the loss.

Usage:
    python tools/profile_host.py --config moe --tiny --device cpu
    python tools/profile_host.py --config moe --device cuda [--mode local:attn] [--json out.json]
"""

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.graph_bench import COMMON, CONFIGS, mode_flags  # noqa: E402

TINY = {
    "--hidden-size": "64",
    "--ffn-hidden-size": "128",
    "--num-attention-heads": "4",
    "--seq-length": "64",
    "--max-position-embeddings": "64",
    "--vocab-size": "1024",
}
_clock = time.perf_counter  # what the phase timers read (--clock)
PHASES = ["zero_grad", "forward", "backward", "grad_sync", "optimizer"]
SYNC_METHODS = ["tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"]
DATA_DEPENDENT_OPS = {
    "nonzero",
    "masked_select",
    "unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "repeat_interleave",  # without output_size
    "_local_scalar_dense",
    "bincount",
}


def override_flags(flags: str, overrides: dict[str, str]) -> str:
    """``flags`` with each ``--flag value`` of ``overrides`` replaced (or appended)."""
    words = flags.split()
    out, i = [], 0
    while i < len(words):
        w = words[i]
        if w in overrides:
            i += 2 if i + 1 < len(words) and not words[i + 1].startswith("--") else 1
            continue
        out.append(w)
        i += 1
    for flag, value in overrides.items():
        out += [flag] + ([value] if value != "" else [])
    return " ".join(out)


def build_argv(args) -> list[str]:
    overrides = dict(TINY) if args.tiny else {}
    for item in args.set:
        flag, _, value = item.partition("=")
        overrides["--" + flag.lstrip("-")] = value
    common = COMMON
    if args.device == "cpu":
        common = common.replace("--bf16", "") + " --use-cpu"
    iters = args.warmup + 3 * args.steps + 1
    flags = f"{CONFIGS[args.config]} {common} --train-iters {iters} {mode_flags(args.mode)} {args.extra}"
    return override_flags(flags, overrides).split()


class PhaseTimer:
    """Host seconds per phase, by wrapping the trainer's phase entry points (instance attributes)."""

    def __init__(self, trainer):
        import torch

        self.seconds = collections.Counter()
        self.autograd_nodes = 0  # nodes of the graphs backward ran on (counted when count_nodes is set)
        self.count_nodes = False
        self.current: list[str] = []
        self.hooks: dict[str, list] = {p: [] for p in PHASES}  # (enter, exit) callables per phase
        self._wrap(trainer.model, "zero_grad_buffer", "zero_grad")
        self._wrap(trainer.model, "forward", "forward")
        self._wrap(trainer.model, "finish_grad_sync", "grad_sync")
        self._wrap(trainer.optimizer, "step", "optimizer")
        self.original_backward = torch.Tensor.backward
        timer = self

        def backward(tensor, *a, **k):
            if timer.count_nodes:
                timer.autograd_nodes += count_autograd_nodes(tensor.grad_fn)
            with timer.phase("backward", tensor):
                return timer.original_backward(tensor, *a, **k)

        torch.Tensor.backward = backward

    def restore(self):
        import torch

        torch.Tensor.backward = self.original_backward

    @contextlib.contextmanager
    def phase(self, name, tensor=None):
        self.current.append(name)
        exits = [h(tensor) for h in self.hooks[name]]
        start = _clock()
        try:
            yield
        finally:
            self.seconds[name] += _clock() - start
            for e in reversed(exits):
                if e is not None:
                    e()
            self.current.pop()

    def _wrap(self, obj, attr, name):
        fn = getattr(obj, attr)
        timer = self

        def wrapped(*a, **k):
            with timer.phase(name):
                return fn(*a, **k)

        setattr(obj, attr, wrapped)

    def where(self) -> str:
        return self.current[-1] if self.current else "other"


def count_autograd_nodes(root) -> int:
    """Nodes reachable from ``root`` (a ``grad_fn``), AccumulateGrad leaves included."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


def _caller_line() -> str:
    """The innermost frame outside torch and this file: where a sync was asked for."""
    here = os.path.abspath(__file__)
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = os.path.abspath(frame.filename)
        if f == here or f"{os.sep}torch{os.sep}" in f:
            continue
        return f"{os.path.relpath(f)}:{frame.lineno} {frame.name}"
    return "?"


class SyncCounter:
    """Counts host syncs per phase: sync-implying Tensor methods and data-dependent aten ops."""

    def __init__(self, timer: PhaseTimer):
        self.timer = timer
        self.by_phase = collections.Counter()
        self.by_line = collections.Counter()
        self.originals = {}
        self.active = False
        self.cpu_counts = True  # count CPU tensors' reads too (a CPU run stands for a device run)

    def note(self, kind: str):
        if not self.active:
            return
        self.by_phase[self.timer.where()] += 1
        self.by_line[f"{kind}  {_caller_line()}"] += 1

    def install(self):
        import torch

        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self.originals[name] = original

            def wrapped(t, *a, _o=original, _n=name, **k):
                # A CPU tensor's item/tolist is no device sync; count device tensors only (any on CPU runs).
                if t.device.type != "cpu" or self.cpu_counts:
                    self.note(f"Tensor.{_n}")
                was, self.active = self.active, False  # the method's own ops are not a second sync
                try:
                    return _o(t, *a, **k)
                finally:
                    self.active = was

            setattr(torch.Tensor, name, wrapped)

    def uninstall(self):
        import torch

        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)


def _make_op_counter(timer: PhaseTimer, syncs: SyncCounter):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    lock = threading.Lock()

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.by_phase = collections.Counter()
            self.by_op = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            with lock:
                self.by_phase[timer.where()] += 1
                self.by_op[name] += 1
            if name in DATA_DEPENDENT_OPS and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")):
                syncs.note(f"aten.{name}")
            return func(*args, **(kwargs or {}))

    del torch
    return OpCounter()


def _stats_table(profile: cProfile.Profile, sort: str, n: int) -> str:
    s = io.StringIO()
    stats = pstats.Stats(profile, stream=s)
    stats.sort_stats(sort).print_stats(n)
    text = s.getvalue()
    # Keep the table, not pstats' preamble.
    start = text.find("   ncalls")
    return text[start:] if start >= 0 else text


def _top(profile: cProfile.Profile, sort: str, n: int, steps: int) -> list[tuple[str, float, float, int]]:
    """``(function, cumulative ms/step, self ms/step, calls/step)``, the top ``n`` by ``sort``."""
    stats = pstats.Stats(profile).stats
    rows = []
    for (file, line, name), (_, ncalls, self_t, cum_t, _) in stats.items():
        where = name if file == "~" else f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({name})"
        rows.append((where, cum_t * 1000 / steps, self_t * 1000 / steps, ncalls // steps))
    key = 1 if sort == "cumulative" else 2
    rows.sort(key=lambda r: -r[key])
    return rows[:n]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="moe")
    parser.add_argument("--mode", default="eager")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument(
        "--tiny", action="store_true", help="hidden 64, ffn 128, 4 heads, seq 64 (layers as the config)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE", help="override a config flag")
    parser.add_argument("--extra", default="", help="more flags, appended")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default="", help="write the numbers here")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 on the CPU)")
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default=None,
        help="cpu: this process's CPU time (steady on a busy machine; the default on the CPU); wall (on CUDA)",
    )
    args = parser.parse_args()

    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.clock is None:
        args.clock = "cpu" if args.device == "cpu" else "wall"
    global _clock
    _clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    from megatron.core import parallel_state
    from megatron.training.data import build_data_iterators
    from megatron.training.training import build_trainer

    argv = build_argv(args)
    trainer = build_trainer(argv)
    it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
    trainer.model.train()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        trainer.train_step(it)
    sync()

    # 1. Timed steps.
    timer = PhaseTimer(trainer)
    walls, clocks, per_step = [], [], []
    for _ in range(args.steps):
        timer.seconds.clear()
        start, start_clock = time.perf_counter(), _clock()
        trainer.train_step(it)
        sync()
        walls.append(time.perf_counter() - start)
        clocks.append(_clock() - start_clock)
        phases = {p: timer.seconds[p] * 1000 for p in PHASES}
        phases["other"] = max(0.0, clocks[-1] * 1000 - sum(phases.values()))
        per_step.append(phases)
    # Medians over the steps: steadier than means on a shared machine.
    phase_ms = {p: statistics.median(s[p] for s in per_step) for p in per_step[0]}
    step_ms = statistics.median(clocks) * 1000

    # 2. Ops and syncs over one step.
    syncs = SyncCounter(timer)
    syncs.cpu_counts = not cuda
    syncs.install()
    counter = _make_op_counter(timer, syncs)
    sync_warnings = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        syncs.active = timer.count_nodes = True
        try:
            with counter:
                trainer.train_step(it)
            sync()
        finally:
            syncs.active = timer.count_nodes = False
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            syncs.uninstall()
        sync_warnings = sum(1 for w in caught if "synchroniz" in str(w.message).lower())

    # 3. cProfile, one profile per phase.
    profiles = {p: cProfile.Profile() for p in ("forward", "backward", "optimizer")}
    engine_thread_on: set[int] = set()

    def forward_hook(_):
        profiles["forward"].enable()
        return profiles["forward"].disable

    def optimizer_hook(_):
        profiles["optimizer"].enable()
        return profiles["optimizer"].disable

    def backward_hook(tensor):
        if not cuda or tensor is None or tensor.grad_fn is None:
            profiles["backward"].enable()
            return profiles["backward"].disable

        # The backward runs in autograd's device thread: enable the profile there, from a
        # hook on the loss's node, and disable it there when the graph task finishes.
        def pre(*_):
            if threading.get_ident() not in engine_thread_on:
                profiles["backward"].enable()
                engine_thread_on.add(threading.get_ident())
                torch.autograd.Variable._execution_engine.queue_callback(_off)

        def _off():
            profiles["backward"].disable()
            engine_thread_on.discard(threading.get_ident())

        handle = tensor.grad_fn.register_prehook(pre)
        return handle.remove

    timer.hooks["forward"].append(forward_hook)
    timer.hooks["backward"].append(backward_hook)
    timer.hooks["optimizer"].append(optimizer_hook)
    for _ in range(args.steps):
        trainer.train_step(it)
    sync()
    timer.restore()

    result = {
        "config": args.config,
        "mode": args.mode,
        "device": args.device,
        "argv": " ".join(argv),
        "host_ms_per_step": phase_ms,
        "clock": args.clock,
        "step_ms": step_ms,
        "step_wall_ms": statistics.median(walls) * 1000,
        "step_wall_ms_min": min(walls) * 1000,
        "aten_ops_per_step": dict(counter.by_phase),
        "aten_ops_total": sum(counter.by_phase.values()),
        "autograd_nodes_per_step": timer.autograd_nodes,
        "top_aten_ops": counter.by_op.most_common(args.top),
        "host_syncs_per_step": dict(syncs.by_phase),
        "host_syncs_total": sum(syncs.by_phase.values()),
        "host_sync_sites": syncs.by_line.most_common(),
        "cuda_sync_warnings": sync_warnings if cuda else None,
        "cprofile": {
            p: {
                "cumulative": _top(prof, "cumulative", args.top, args.steps),
                "self": _top(prof, "tottime", args.top, args.steps),
            }
            for p, prof in profiles.items()
        },
    }
    parallel_state.destroy(trainer.pg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print_report(result)


def print_report(r: dict) -> None:
    print(f"{r['config']} {r['mode']} on {r['device']}: {r['argv']}")
    ms = r["host_ms_per_step"]
    print(
        f"step {r['step_ms']:.2f} ms {r['clock']} time, median (wall {r['step_wall_ms']:.2f}, min {r['step_wall_ms_min']:.2f}); "
        f"host {r['clock']} ms/step: " + ", ".join(f"{p} {v:.2f}" for p, v in ms.items())
    )
    ops = r["aten_ops_per_step"]
    print(
        f"aten ops/step: {r['aten_ops_total']} (" + ", ".join(f"{p} {n}" for p, n in ops.items()) + "); "
        f"autograd nodes/step: {r['autograd_nodes_per_step']}"
    )
    syncs = r["host_syncs_per_step"]
    line = f"host syncs/step: {r['host_syncs_total']} (" + ", ".join(f"{p} {n}" for p, n in syncs.items()) + ")"
    if r["cuda_sync_warnings"] is not None:
        line += f"; CUDA sync-debug warnings: {r['cuda_sync_warnings']}"
    print(line)
    for site, n in r["host_sync_sites"]:
        print(f"  {n:4d}  {site}")
    print("top aten ops/step: " + ", ".join(f"{name} {n}" for name, n in r["top_aten_ops"]))
    for phase, tables in r["cprofile"].items():
        for sort, rows in tables.items():
            print(f"\n{phase}: top by {sort} time (ms/step cumulative, self, calls/step)")
            for where, cum, self_ms, calls in rows:
                print(f"  {cum:8.3f} {self_ms:8.3f} {calls:6d}  {where}")


if __name__ == "__main__":
    main()

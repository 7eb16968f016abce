"""Where a training step's time goes on the GPU: busy vs idle, per phase, per kernel.

Builds a trainer like ``tools/graph_bench.py`` (same configs and modes), runs a few
warm iterations, then profiles ``--steps`` steps with torch.profiler and prints:

* wall ms per step, GPU-busy ms per step (union of kernel intervals), kernels per step;
* GPU idle time per phase of the step (zero_grad, forward, backward, grad sync,
  optimizer, graph bookkeeping), attributed to the phase that launched the kernel
  after the gap: a phase with much idle time is CPU-bound;
* the kernels with the most total time (grouped by name).

Usage:
    python tools/profile_step.py --config dense8 --mode eager [--steps 5] [--trace t.json]
"""

import argparse
import collections
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.graph_bench import COMMON, CONFIGS, mode_flags, wrap_with_make_graphed_callables  # noqa: E402

PHASES = ["zero_grad", "forward", "backward", "grad_sync", "optimizer", "graphs", "step"]


def _wrap(obj, attr: str, label: str) -> None:
    import torch

    fn = getattr(obj, attr)

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(f"phase::{label}"):
            return fn(*args, **kwargs)

    setattr(obj, attr, wrapped)


def _instrument(trainer) -> None:
    """Marks the phases of a step with profiler ranges (instance attributes only)."""
    import torch

    _wrap(trainer.model, "zero_grad_buffer", "zero_grad")
    _wrap(trainer.model, "forward", "forward")
    _wrap(trainer.model, "finish_grad_sync", "grad_sync")
    _wrap(trainer.optimizer, "step", "optimizer")
    _wrap(trainer.graphs, "end_of_iteration", "graphs")
    original_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        with torch.profiler.record_function("phase::backward"):
            return original_backward(self, *args, **kwargs)

    torch.Tensor.backward = backward


def analyse(trace_path: str, steps: int) -> dict:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime" and "args" in e}
    phases = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase::")]
    steps_ev = [e for e in phases if e["name"] == "phase::step"]
    kernels.sort(key=lambda e: e["ts"])

    def phase_at(ts: float) -> str:
        best, best_start = "other", -1.0
        for p in phases:
            if p["name"] == "phase::step":
                continue
            if p["ts"] <= ts <= p["ts"] + p["dur"] and p["ts"] > best_start:
                best, best_start = p["name"][len("phase::") :], p["ts"]
        return best

    busy, idle_by_phase = 0.0, collections.Counter()
    end = None
    by_name = collections.Counter()
    count = 0
    for k in kernels:
        start, stop = k["ts"], k["ts"] + k["dur"]
        in_step = any(s["ts"] <= start <= s["ts"] + s["dur"] for s in steps_ev)
        if not in_step:
            continue
        count += 1
        by_name[k["name"][:90]] += k["dur"]
        if end is not None and start > end:
            launch = runtime.get(k["args"].get("correlation"))
            idle_by_phase[phase_at(launch["ts"] if launch else start)] += start - end
        busy += max(0.0, stop - max(start, end or start))
        end = stop if end is None else max(end, stop)
    wall = sum(s["dur"] for s in steps_ev)
    return {
        "wall_ms_per_step": wall / 1000 / steps,
        "gpu_busy_ms_per_step": busy / 1000 / steps,
        "kernels_per_step": count / steps,
        "gpu_idle_ms_per_step_by_phase": {k: v / 1000 / steps for k, v in idle_by_phase.most_common()},
        "top_kernels_ms_per_step": [(n, v / 1000 / steps) for n, v in by_name.most_common(25)],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="dense8")
    parser.add_argument("--mode", default="eager")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--extra", default="")
    parser.add_argument("--trace", default="", help="keep the chrome trace here")
    parser.add_argument("--json", default="", help="write the analysis here")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron.core import parallel_state
    from megatron.training.data import build_data_iterators
    from megatron.training.training import build_trainer

    iters = args.warmup + args.steps
    argv = f"{CONFIGS[args.config]} {COMMON} --train-iters {iters} {mode_flags(args.mode)} {args.extra}".split()
    trainer = build_trainer(argv)
    if args.mode == "mgc":
        wrap_with_make_graphed_callables(trainer)
    it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
    trainer.model.train()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(args.warmup):
        trainer.train_step(it)
    sync()
    _instrument(trainer)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function("phase::step"):
                trainer.train_step(it)
                sync()
    trace = args.trace or tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(trace)
    result = dict(config=args.config, mode=args.mode, **analyse(trace, args.steps))
    if not args.trace:
        os.remove(trace)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"{args.config} {args.mode}: wall {result['wall_ms_per_step']:.2f} ms/step, GPU busy "
        f"{result['gpu_busy_ms_per_step']:.2f} ms/step, {result['kernels_per_step']:.0f} kernels/step"
    )
    print(
        "  GPU idle by phase (ms/step): "
        + ", ".join(f"{k} {v:.2f}" for k, v in result["gpu_idle_ms_per_step_by_phase"].items())
    )
    for name, ms in result["top_kernels_ms_per_step"]:
        print(f"  {ms:7.3f}  {name}")
    parallel_state.destroy(trainer.pg)


if __name__ == "__main__":
    main()

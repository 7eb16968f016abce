"""Benchmark: eager vs partial CUDA graphs vs torch.cuda.make_graphed_callables.

Each (config, mode) runs in its own child process so that every run starts from an
empty device; all runs of one invocation share the machine and the code, so ratios
against eager are measured in the same run. Per run:

* ms/iteration: median over iterations ``--skip``..end of the device-synchronised
  wall time of one training step (the same method as the upstream anchor);
* pipelined ms/iteration: the mean of ``PIPELINED`` more steps run back to back with
  one sync at the end. Our step has no host sync, so the host queues the next step
  while the device finishes this one; this is what the training log line reports;
* TFLOP/s per GPU from Megatron's FLOP count;
* peak device memory as the driver sees it: NVML "used", polled every 2 ms by a child process
  (``torch.cuda.device_memory_used``), minus the reading before CUDA initialised;
* graph pool reserved / live bytes from the allocator snapshot filtered by our pool id,
  and the bytes of static buffers we hold strongly;
* every loss, so a table row also says whether graphed losses equal eager's bit for bit.

* MFU: TFLOP/s per GPU against a bf16 matmul peak measured at the start of the same
  invocation (``bench_cuda_graphs.matmul_peak_tflops``), and the capture time.

The configs, their modes and the FLOP count live in ``bench_cuda_graphs.py``.

Usage:
    python tools/graph_bench.py --out DIR                 # dense8 and launch16, every mode, table last
    python tools/graph_bench.py --configs moe hybrid --out DIR --dry-run   # the plan and its duration
    python tools/graph_bench.py --config dense8 --mode local:attn --json r.json   # one run
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cuda_graphs as bcg  # noqa: E402

CONFIGS = bcg.CONFIGS
COMMON = (
    "--lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --seed 1234 --tokenizer-type NullTokenizer "
    "--vocab-size 32001 --mock-data --bf16 --attention-dropout 0.0 --hidden-dropout 0.0 --log-interval 1000000"
)
# eager:expandable = eager with the allocator setting our graphs switch on by default;
# eager:fold = eager with gradients folded into main_grad on arrival, as wherever eager turns may open;
# lean = a plain-PyTorch loop on the same shapes (tools/lean_gpt.py), the host-speed yardstick.
MODES = bcg.DENSE_MODES


PIPELINED = 20  # steps timed back to back after the synced ones


def pipelined_ms(step) -> float:
    """Mean ms/iteration of ``PIPELINED`` calls of ``step`` with one sync at the end."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(PIPELINED):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / PIPELINED


# The switches' names, written out so that this parent process imports no torch (a test checks them
# against the modules that read them).
EAGER_TURN_SWITCH = "MEGATRON_CG_EAGER_TURN"  # megatron/core/transformer/cuda_graphs/turn.py
TURN_SCAN_BUDGET = "MEGATRON_CG_TURN_SCAN_BUDGET"  # megatron/core/ssm/ssd.py; scan32:* sets it to captured
SSD_KERNELS_SWITCH = "MEGATRON_SSD_KERNELS"  # megatron/core/ssm/ssd_kernels.py; torchscan:* sets it to torch


def mode_flags(mode: str) -> str:
    mode = mode.removeprefix(bcg.TORCH_SCAN)
    if mode.startswith("eager") or mode in ("mgc", "lean"):
        return ""
    if mode == "full":
        return "--cuda-graph-impl full_iteration"
    scope = mode.split(":", 1)[1]
    scopes = "" if scope == "layer" else " ".join(scope.split("+"))
    return f"--cuda-graph-impl local --cuda-graph-scope {scopes}".rstrip()


# The poller's own loop, run by a child process (see PeakPoller). argv: CUDA device index,
# interval in seconds. stdin: "steady" starts the steady peak, "stop" prints both peaks.
_POLL_LOOP = """
import select, sys, torch
device, interval = int(sys.argv[1]), float(sys.argv[2])
peak = steady = 0
is_steady = False
print("ready", flush=True)
while True:
    used = torch.cuda.device_memory_used(device)
    peak = max(peak, used)
    if is_steady:
        steady = max(steady, used)
    if select.select([sys.stdin], [], [], interval)[0]:
        command = sys.stdin.readline().strip()
        if command == "steady":
            is_steady = True
        else:
            used = torch.cuda.device_memory_used(device)
            print(max(peak, used), max(steady, used), flush=True)
            break
"""


class PeakPoller:
    """Polls NVML device memory use (``torch.cuda.device_memory_used``) every 2 ms.

    The polling runs in a child process: NVML's figure is device-wide, and a thread
    in this process would take the GIL ~500 times a second from the host-bound step
    it is measuring. The child never initialises CUDA (NVML only), so it adds no
    device memory of its own.
    """

    def __init__(self, torch, interval=0.002):
        self.torch, self.interval = torch, interval
        self.peak = self.steady_peak = 0  # steady: from mark_steady() on (after capture)
        self.child = None

    def mark_steady(self):
        self.child.stdin.write("steady\n")
        self.child.stdin.flush()

    def __enter__(self):
        # The CUDA index: the child's torch maps it to NVML's (CUDA_VISIBLE_DEVICES) as ours does.
        device = self.torch.cuda.current_device()
        self.child = subprocess.Popen(
            [sys.executable, "-c", _POLL_LOOP, str(device), str(self.interval)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self.child.stdout.readline().strip() != "ready":
            raise RuntimeError("the memory poller process did not start")
        return self

    def __exit__(self, *exc):
        self.child.stdin.write("stop\n")
        self.child.stdin.flush()
        reply = self.child.stdout.readline().split()
        self.child.wait()
        if len(reply) != 2:
            raise RuntimeError(f"the memory poller process ended without its peaks (exit code {self.child.returncode})")
        self.peak, self.steady_peak = int(reply[0]), int(reply[1])


def wrap_with_make_graphed_callables(trainer):
    """The peer a user would pick: torch.cuda.make_graphed_callables over the layers."""
    import torch

    from megatron.core.transformer.cuda_graphs.regions import graphable_layers
    from megatron.core.transformer.moe.moe_layer import MoETransformerLayer

    cfg = trainer.cfg.model
    model = trainer.model.module
    layers = graphable_layers(model)
    if any(isinstance(layer, MoETransformerLayer) for layer in layers):
        raise SystemExit("mgc mode: MoE layers read token counts on the host and cannot be captured whole")
    t = trainer.cfg.training
    rotary = getattr(model, "rotary_pos_emb", None)
    rope = rotary(cfg.seq_length, trainer.device) if rotary is not None else None  # cached: one tensor

    def sample():
        hidden = torch.randn(
            cfg.seq_length,
            t.micro_batch_size,
            cfg.hidden_size,
            dtype=cfg.params_dtype,
            device=trainer.device,
            requires_grad=True,
        )
        return (hidden,) if rope is None else (hidden, rope)

    samples = tuple(sample() for _ in layers)
    # allow_unused_input: with gradient-accumulation fusion the weights get no autograd grad.
    torch.cuda.make_graphed_callables(tuple(layers), samples, num_warmup_iters=3, allow_unused_input=True)
    for layer in layers:
        graphed = layer.forward
        if rope is None:
            layer.forward = lambda hidden_states, rotary_pos_emb=None, _g=graphed: _g(hidden_states)
        else:
            layer.forward = lambda hidden_states, rotary_pos_emb=None, _g=graphed: _g(hidden_states, rotary_pos_emb)


def profile_steps(trainer, it, path: str, steps: int = 5) -> None:
    """Writes a torch.profiler table (CPU and CUDA time per op) of a few steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step(it)
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        f.write("\n")
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))


def segment_map(pool=None, ours: bool = True) -> list:
    """Allocator segments with their blocks ``(size, state)``: where memory goes.

    ``ours``: the segments of our graph pool; otherwise every other segment (the
    regular cache and anything else).
    """
    import torch

    from megatron.core.transformer.cuda_graphs.pool import _pool_id

    want = _pool_id(pool.handle) if pool is not None else None
    out = []
    for seg in torch.cuda.memory_snapshot():
        mine = want is not None and _pool_id(seg.get("segment_pool_id", (0, 0))) == want
        if mine == ours:
            out.append([seg["total_size"], [(b["size"], b["state"][0]) for b in seg["blocks"]]])
    return out


def run_lean(config: str, iters: int, skip: int) -> dict:
    """The lean plain-PyTorch peer (``lean_gpt.py``) on the same shapes: the yardstick
    for our eager step on this machine start."""
    import lean_gpt
    import torch

    from megatron.core.tokenizers import build_tokenizer, vocab_size_with_padding
    from megatron.training import logging_utils as logs
    from megatron.training.arguments import parse_args

    cfg = parse_args(f"{CONFIGS[config]} {COMMON} --train-iters {iters + PIPELINED}".split()).resolve()
    tokenizer = build_tokenizer(cfg.data)  # the same padded vocabulary as ours
    cfg.model.vocab_size = vocab_size_with_padding(tokenizer.vocab_size, cfg.data.make_vocab_size_divisible_by)
    device = torch.device("cuda")
    base = torch.cuda.device_memory_used()
    with PeakPoller(torch) as poller:
        torch.manual_seed(1234)
        model, optimizer = lean_gpt.build(cfg.model, device)
        mb, seq = cfg.training.micro_batch_size, cfg.model.seq_length
        times, losses = [], []
        for _ in range(iters):
            tokens = torch.randint(cfg.model.vocab_size, (mb, seq + 1), device=device)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = lean_gpt.train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000)
            losses.append(loss.item())
        pipe = pipelined_ms(lambda: lean_gpt.train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:]))
    ms = statistics.median(times[skip:])
    flops = logs.num_floating_point_operations(
        cfg.model, batch_size=cfg.training.global_batch_size, seq_length=seq, vocab_size=cfg.model.vocab_size
    )
    peak = poller.peak - base
    return {
        "config": config,
        "mode": "lean",
        "ms_per_iter": ms,
        "ms_min": min(times[skip:]),
        "ms_max": max(times[skip:]),
        "pipelined_ms_per_iter": pipe,
        "tflops_per_gpu": flops / (ms / 1000) / 1e12,
        "peak_device_bytes": peak,
        "steady_peak_device_bytes": peak,
        "losses": losses,
        "graphs": {},
    }


def run_one(config: str, mode: str, iters: int, skip: int, extra: str, profile_path: str = "") -> dict:
    import torch

    if mode == "lean":
        return run_lean(config, iters, skip)

    import pretrain_hybrid
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    base = torch.cuda.device_memory_used() if torch.cuda.is_available() else 0
    # Data for the synced, pipelined and profiled steps.
    argv = (
        f"{CONFIGS[config]} {COMMON} --train-iters {iters + PIPELINED + 10} {mode_flags(mode)} "
        f"{bcg.mode_extra(config, mode)} {extra}"
    ).split()
    with PeakPoller(torch) as poller:
        trainer = build_trainer(argv, **pretrain_hybrid.providers(argv))
        if mode == "eager:fold":
            trainer.model.fold_grads_on_arrival()
        if mode == "mgc":
            capture_start = time.perf_counter()
            wrap_with_make_graphed_callables(trainer)
            mgc_capture = time.perf_counter() - capture_start
        from megatron.training.data import build_data_iterators

        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
        trainer.model.train()
        times, losses = [], []
        for i in range(iters):
            if i == 2:  # iteration 1 records and captures; from iteration 3 on, steady state
                torch.cuda.synchronize()
                steady_alloc_base = torch.cuda.max_memory_allocated()
                steady_res_base = torch.cuda.max_memory_reserved()
                torch.cuda.reset_peak_memory_stats()
                poller.mark_steady()
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss, grad_norm = trainer.train_step(it)[:2]
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000)
            losses.append(loss.item())
        pipe = pipelined_ms(lambda: trainer.train_step(it))
        stats = trainer.graphs.stats() if trainer.graphs.captured else {}
        pool = trainer.graphs.pools.get(0)  # None for eager; one pool without pipelining
        full = trainer.full_graph
        if full is not None and full.num_graphs:  # --cuda-graph-impl full_iteration
            pool = full.pool
            stats = full.stats()
        if stats:
            stats["pool_map"] = segment_map(pool)
        regular_map = segment_map(pool, ours=False)
        free, total = torch.cuda.mem_get_info()
        outside = (total - free) - torch.cuda.memory_reserved()
    if profile_path:
        profile_steps(trainer, it, profile_path)
    flops = bcg.model_flops(trainer.cfg)
    ms = statistics.median(times[skip:])
    result = {
        "config": config,
        "mode": mode,
        "baseline_mode": bcg.baseline_mode(config, mode),
        "ms_per_iter": ms,
        "ms_min": min(times[skip:]),
        "ms_max": max(times[skip:]),
        "pipelined_ms_per_iter": pipe,
        "tflops_per_gpu": flops / (ms / 1000) / 1e12,
        "peak_device_bytes": poller.peak - base,
        "max_allocated_bytes": max(steady_alloc_base, torch.cuda.max_memory_allocated()),
        "max_reserved_bytes": max(steady_res_base, torch.cuda.max_memory_reserved()),
        "first_two_iters_max_reserved_bytes": steady_res_base,
        "steady_max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "steady_max_reserved_bytes": torch.cuda.max_memory_reserved(),
        "steady_peak_device_bytes": poller.steady_peak - base,
        "losses": losses,
        "graphs": stats,
        "regular_map": regular_map,
        "outside_allocator_bytes": outside,
    }
    if mode == "mgc":
        result["graphs"] = {"capture_seconds": mgc_capture}
    parallel_state.destroy(trainer.pg)
    return result


def merge_runs(runs):
    """One row from several runs of one (config, mode) (``--repeat``): median ms/it and
    pipelined ms/it, the largest peaks; ``ms_runs`` keeps every run's ms/it."""
    row = dict(runs[0])
    row["ms_per_iter"] = statistics.median(r["ms_per_iter"] for r in runs)
    row["pipelined_ms_per_iter"] = statistics.median(r["pipelined_ms_per_iter"] for r in runs)
    row["tflops_per_gpu"] = runs[0]["tflops_per_gpu"] * runs[0]["ms_per_iter"] / row["ms_per_iter"]
    for key in ("peak_device_bytes", "steady_peak_device_bytes"):
        row[key] = max(r[key] for r in runs)
    row["ms_runs"] = [r["ms_per_iter"] for r in runs]
    return row


def _baseline(r, by_mode):
    """The eager row a row is compared with (same config; same model flags)."""
    return by_mode.get((r["config"], r.get("baseline_mode", "eager")))


def _against(r, e, key, width, percent=False) -> str:
    """``r[key]`` against the eager row's, ``width`` wide: a ratio, or a change in percent; "-" without an eager row."""
    if e is None:
        return f"{'-':>{width}}"
    if percent:
        return f"{100 * (r[key] - e[key]) / e[key]:+{width - 1}.2f}%"
    return f"{r[key] / e[key]:{width}.3f}"


def table(results):
    rows = []
    by_mode = {(r["config"], r["mode"]): r for r in results}
    width = max([15] + [len(r["mode"]) for r in results])
    head = (
        f"{'config':9} {'mode':{width}} {'ms/it':>7} {'x eager':>7} {'pipe ms':>7} {'TFLOP/s':>7} {'peak GiB':>8} "
        f"{'mem vs eager':>12} {'steady vs':>10} {'pool MiB':>8} {'held MiB':>8} {'graphs':>6} {'MFU':>6} "
        f"{'capture s':>9} {'loss==eager':>11}"
    )
    rows.append(head)
    rows.append("-" * len(head))
    for r in results:
        e = _baseline(r, by_mode)
        g = r.get("graphs") or {}
        same = "-" if e is None or r is e or r["mode"] == "lean" else str(r["losses"] == e["losses"])
        mfu = r.get("mfu")
        capture = g.get("capture_seconds")
        rows.append(
            f"{r['config']:9} {r['mode']:{width}} {r['ms_per_iter']:7.2f} "
            f"{_against(r, e, 'ms_per_iter', 7)} "
            f"{r.get('pipelined_ms_per_iter', float('nan')):7.2f} {r['tflops_per_gpu']:7.1f} "
            f"{r['peak_device_bytes'] / 2**30:8.3f} "
            f"{_against(r, e, 'peak_device_bytes', 12, percent=True)} "
            f"{_against(r, e, 'steady_peak_device_bytes', 10, percent=True)} "
            f"{g.get('pool_reserved_bytes', 0) / 2**20:8.1f} {g.get('strong_bytes', 0) / 2**20:8.1f} "
            f"{g.get('graphs', 0):6d} {'-' if mfu is None else f'{100 * mfu:5.1f}%':>6} "
            f"{'-' if capture is None else f'{capture:.2f}':>9} {same:>11}"
        )
    for r in results:
        if len(r.get("ms_runs", ())) > 1:
            rows.append(
                f"{r['config']} {r['mode']}: ms/it of each run, in run order: "
                + " ".join(f"{ms:.2f}" for ms in r["ms_runs"])
            )
    peak = next((r.get("matmul_peak_tflops") for r in results if r.get("matmul_peak_tflops")), None)
    if peak:
        rows.append(
            f"MFU: TFLOP/s per GPU / {peak:.0f} TFLOP/s, the bf16 matmul peak measured at the start of this run."
        )
    rows.append(
        "loss==eager: bit for bit only where every kernel is deterministic; without "
        "--deterministic-mode dense8 eager differs from itself run to run (the GPU tests check "
        "parity in deterministic mode). lean: plain PyTorch on the same shapes (tools/lean_gpt.py). "
        "ms/it: one step with a device sync around it (the anchor's method); pipe ms: steps back to "
        "back, one sync at the end (what the training log reports). moe local:moe is compared with "
        "eager:drop-and-pad (the same model flags)."
    )
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS))
    parser.add_argument("--mode")
    parser.add_argument("--configs", nargs="*", default=["dense8", "launch16"], choices=sorted(CONFIGS))
    parser.add_argument("--modes", nargs="*", default=None, help="default: each config's own list")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--skip", type=int, default=10, help="iterations left out of the timing median")
    parser.add_argument("--extra", default="", help="more flags for every run (--extra=--deterministic-mode)")
    parser.add_argument("--json", help="one run: write its result here")
    parser.add_argument("--profile", default="", help="one run: also write a torch.profiler table here")
    parser.add_argument("--out", default="bench_out", help="all runs: folder for results.json and logs")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="all runs: run the mode list this many times, round robin (host speed drifts); "
        "a row then shows the median",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their estimated duration only")
    parser.add_argument("--no-matmul-peak", action="store_true", help="skip the bf16 matmul peak (no MFU column)")
    parser.add_argument("--matmul-peak", action="store_true", help=argparse.SUPPRESS)  # the peak's child process
    return parser


def main():
    args = build_parser().parse_args()
    if args.matmul_peak:
        with open(args.json, "w") as f:
            json.dump({"tflops": bcg.matmul_peak_tflops()}, f)
        return
    if args.config:
        result = run_one(args.config, args.mode, args.iters, args.skip, args.extra, args.profile)
        with open(args.json, "w") as f:
            json.dump(result, f)
        return
    runs_planned = bcg.plan(args.configs, args.modes, args.repeat)
    print(bcg.describe_plan(runs_planned), flush=True)
    if args.dry_run:
        for rep, config, mode in runs_planned:
            print(f"  {config} {mode}" + (f" (run {rep + 1})" if args.repeat > 1 else ""))
        return
    os.makedirs(args.out, exist_ok=True)
    peak = None if args.no_matmul_peak else run_matmul_peak(os.path.join(args.out, "matmul_peak"))
    runs = []
    for rep, config, mode in runs_planned:
        name = f"{config}_{mode.replace(':', '_').replace('+', '_')}" + (f"_run{rep + 1}" if args.repeat > 1 else "")
        r = run_child(config, mode, args, os.path.join(args.out, name))
        if r is not None:
            runs.append(r)
    bcg.add_mfu(runs, peak)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(runs, f, indent=1)
    grouped = {}
    for r in runs:
        grouped.setdefault((r["config"], r["mode"]), []).append(r)
    results = [merge_runs(group) if len(group) > 1 else group[0] for group in grouped.values()]
    bcg.add_mfu(results, peak)
    print(table(results))


def run_matmul_peak(stem: str):
    """The bf16 matmul peak in a child process of its own (a clean device), or None."""
    path, log = stem + ".json", stem + ".log"
    with open(log, "w") as f:
        rc = subprocess.call(
            [sys.executable, __file__, "--matmul-peak", "--json", path], stdout=f, stderr=subprocess.STDOUT
        )
    if rc != 0:
        print(f"matmul peak: failed (rc {rc}); see {log}; no MFU column", flush=True)
        return None
    with open(path) as f:
        tflops = json.load(f)["tflops"]
    print(f"bf16 matmul peak: {tflops:.0f} TFLOP/s", flush=True)
    return tflops


def child_command(config: str, mode: str, args, path: str) -> list[str]:
    """The command line of one (config, mode) child run that writes its result to ``path``."""
    return [
        sys.executable,
        __file__,
        "--config",
        config,
        "--mode",
        mode,
        "--iters",
        str(args.iters),
        "--skip",
        str(args.skip),
        "--json",
        path,
        f"--extra={args.extra}",  # a value starting with -- needs the = form
    ]


def run_child(config: str, mode: str, args, stem: str):
    """One (config, mode) in a child process; its result, or None (its log's tail printed)."""
    path, log = stem + ".json", stem + ".log"
    cmd = child_command(config, mode, args, path)
    env = dict(os.environ)
    if mode == "eager:expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if mode.startswith(bcg.TORCH_SCAN):
        env[SSD_KERNELS_SWITCH] = "torch"
    base = mode.removeprefix(bcg.TORCH_SCAN)
    turns = {"noturn:": "0", "turn:": "1", "turns:": "all"}  # our graphs with the eager turns set so
    for prefix, value in turns.items():
        if base.startswith(prefix):
            env[EAGER_TURN_SWITCH] = value
    if base.startswith("scan32:"):
        env[TURN_SCAN_BUDGET] = "captured"
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        print(f"{config} {mode}: failed (rc {rc}); see {log}", flush=True)
        with open(log) as f:
            print("".join(f.readlines()[-15:]), flush=True)
        return None
    with open(path) as f:
        r = json.load(f)
    print(
        f"{config} {mode}: {r['ms_per_iter']:.2f} ms/it, {r['tflops_per_gpu']:.1f} TFLOP/s, peak "
        f"{r['peak_device_bytes'] / 2**30:.3f} GiB, pool {(r.get('graphs') or {}).get('pool_reserved_bytes', 0) / 2**20:.0f} MiB",
        flush=True,
    )
    return r


if __name__ == "__main__":
    main()

"""GPU micro-benchmark of the MoE expert GEMMs: new row counts every call vs bucketed vs grouped.

Dropless routing hands the experts new row counts every step. This tool checks, in one short
run, what that costs on the host and on the device, at the sizes of the ``moe`` benchmark
config (8 experts, hidden 1024, expert FFN 4096 with SwiGLU, 4096 tokens x top-2, bf16):

* ``gemm``: single GEMMs of the expert shapes (fc1 forward, fc2 forward, fc1 wgrad into an fp32
  ``main_grad``), each call at a row count never used before (``new``) or at one fixed row
  count (``seen``): host us per call;
* ``layer``: one MoE layer's experts, forward and backward, per call:
  ``loop``: ``SequentialMLP``'s one-node loop (``_ExpertLoop``, weight gradients fused into
  ``main_grad``) at the routed row counts, every call's counts new;
  ``bucketed:N``: the same loop with each expert's rows padded to a multiple of N (128 is
  what it does on CUDA);
  ``grouped``: ``GroupedMLP`` (``--moe-grouped-gemm``), torch's grouped GEMM over all experts,
  the counts on the device.
  Host ms per call (the time to issue the work) and device ms per call. The device time
  is measured behind a spin kernel that keeps the GPU busy while the host issues the
  call, so it holds no waits for the host.

Every row count the ``new`` and ``loop`` rows use is one no earlier call of this process used;
the bucketed and grouped rows draw counts from the same distribution (random routing
probabilities per call), after warm-up calls.

``--device cpu`` runs every path once at tiny sizes in fp32 (a smoke test of the code; the
numbers mean nothing there, and the grouped path is CUDA only).

Usage:
    python tools/bench_moe_gemm.py [--iters 20] [--multiples 64 128 256] [--json out.json]
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CountSource:
    """Per-expert row counts summing to ``rows``: each call routes the rows with new random
    expert probabilities (``softmax(skew * normal)``), so the counts spread around the mean.

    With ``fresh`` every count returned is one this source never returned (nor was told
    about through ``seen``) before.
    """

    def __init__(self, experts: int, rows: int, seed: int = 0, fresh: bool = False, skew: float = 0.3):
        import torch

        self.experts, self.rows, self.fresh, self.skew = experts, rows, fresh, skew
        self.gen = torch.Generator().manual_seed(seed)
        self.seen: set[int] = set()

    def draw(self) -> list[int]:
        import torch

        for _ in range(10000):
            p = torch.softmax(self.skew * torch.randn(self.experts, generator=self.gen), dim=0)
            picks = torch.multinomial(p, self.rows, replacement=True, generator=self.gen)
            counts = torch.bincount(picks, minlength=self.experts).tolist()
            if not self.fresh or not (set(counts) & self.seen or len(set(counts)) < len(counts)):
                self.seen.update(counts)
                return counts
        raise RuntimeError("no unused row counts left; lower --iters")


def build_experts(args, grouped: bool):
    """``SequentialMLP`` (weights with an fp32 ``main_grad``) or ``GroupedMLP``, in ``args.dtype``."""
    import torch

    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
    from megatron.core.transformer.moe.moe_config import MoEConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = MoEConfig(num_moe_experts=args.experts, moe_router_topk=args.topk, moe_grouped_gemm=grouped)
    cfg = TransformerConfig(
        num_layers=8,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=16,
        seq_length=args.tokens,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=args.dtype,
        gated_linear_unit=True,
        add_bias_linear=False,
        moe=moe,
    )
    cfg.finalize()
    cfg.moe.validate(cfg)
    torch.manual_seed(0)
    if grouped:
        return GroupedMLP(cfg, args.experts, device=args.device)
    experts = SequentialMLP(cfg, args.experts, device=args.device)
    for p in experts.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=args.device)
    return experts


_CYCLES_PER_MS: list[float] = []
MAX_SPIN_MS = 2000.0
"""Longest spin kernel a timed call sits behind."""


def spin_cycles(ms: float) -> int:
    """GPU clock cycles for about ``ms`` milliseconds of ``torch.cuda._sleep``, measured once
    (the clock rate the device properties report is not in the same unit on every CUDA)."""
    import torch

    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS.append(10_000_000 / max(start.elapsed_time(end), 1e-3))
    return int(ms * _CYCLES_PER_MS[0])


def busy(device: str, ms: float) -> None:
    """Keeps the GPU busy for about ``ms`` so that work issued meanwhile queues up behind it."""
    import torch

    if device == "cuda" and ms > 0:
        torch.cuda._sleep(spin_cycles(ms))


def timed(fn, device: str, spin_ms: float):
    """Runs ``fn`` once behind a spin kernel: ``(host ms to issue it, device ms it ran)``.
    On the CPU (a smoke run) both are the wall time of the call."""
    import torch

    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1000
        return ms, ms
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    busy(device, spin_ms)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1000
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def bench_layer(args, name: str, counts_source: CountSource, multiple: int | None, grouped: bool) -> dict:
    """Forward + backward of one layer's experts per call; medians over ``args.iters`` calls."""
    import torch

    experts = build_experts(args, grouped)
    if not grouped:
        experts.row_multiple = multiple
    rows = args.tokens * args.topk
    kw = dict(device=args.device, dtype=args.dtype)
    tokens = torch.randn(rows, args.hidden, requires_grad=True, **kw)
    probs = torch.rand(rows, requires_grad=True, **kw)
    grad = torch.randn(rows, args.hidden, **kw)

    def call(counts):
        # The loop reads host counts (the dispatcher's sync came before); grouped takes them on the device.
        tpe = torch.tensor(counts, device=args.device) if grouped else counts
        return lambda: experts(tokens, tpe, probs).backward(grad)

    # Warm-up calls run without the spin kernel, so a call that waits for the device (a
    # host sync) cannot feed the spin length back into itself; the spin then covers three
    # times the slowest warm-up call.
    warm = [timed(call(counts_source.draw()), args.device, 0.0)[0] for _ in range(args.warmup)]
    spin = min(MAX_SPIN_MS, max(20.0, 3 * max(warm, default=0.0)))
    hosts, devices = [], []
    for _ in range(args.iters):
        host, device = timed(call(counts_source.draw()), args.device, spin)
        hosts.append(host)
        devices.append(device)
    waited = sum(h >= 0.9 * spin for h in hosts) if args.device == "cuda" else 0
    gemms = 2 * args.experts * 3 if not grouped else 6  # fc1, fc2 x (forward, dgrad, wgrad)
    host_ms = statistics.median(hosts)
    return {
        "name": name,
        "host_ms": host_ms,
        "host_us_per_gemm": host_ms * 1000 / gemms,
        "device_ms": statistics.median(devices),
        "gemm_calls": gemms,
        "timed_calls": args.iters,
        "calls_that_waited_for_the_device": waited,
    }


def bench_gemms(args) -> tuple[list[dict], set[int]]:
    """Host us per call of single expert GEMMs at new vs repeated row counts; also the row
    counts used (later calls count as new only at others)."""
    import torch

    from megatron.core.tensor_parallel.layers import accumulate_wgrad_t

    h, f2 = args.hidden, 2 * args.ffn
    rows = args.tokens * args.topk
    kw = dict(device=args.device, dtype=args.dtype)
    x, act, g = torch.randn(rows, h, **kw), torch.randn(rows, args.ffn, **kw), torch.randn(rows, f2, **kw)
    w1, w2 = torch.randn(f2, h, **kw), torch.randn(h, args.ffn, **kw)
    main_grad = torch.zeros(f2, h, device=args.device, dtype=torch.float32)
    # The calls the expert loop makes: forward x @ w^T, wgrad main_grad += g^T @ x (fp32 accumulation).
    kinds = {
        "fc1 forward": lambda m: torch.nn.functional.linear(x[:m], w1),
        "fc2 forward": lambda m: torch.nn.functional.linear(act[:m], w2),
        "fc1 wgrad": lambda m: accumulate_wgrad_t(main_grad, g[:m].t(), x[:m]),
    }
    base = rows // args.experts
    fresh = iter(range(base // 2, rows))  # counts used once each
    out, used = [], set()
    for kind, fn in kinds.items():
        for label, next_m in (("seen", lambda: base), ("new", lambda: next(fresh))):
            fn(base)  # kernels loaded, the seen shape cached
            synchronize(args.device)
            busy(args.device, 100.0)  # the GPU busy: host timing only
            hosts = []
            for _ in range(args.gemm_calls):
                m = next_m()
                used.add(m)
                t0 = time.perf_counter()
                fn(m)
                hosts.append((time.perf_counter() - t0) * 1e6)
            synchronize(args.device)
            out.append({"gemm": kind, "rows": label, "host_us": statistics.median(hosts)})
    return out, used


def print_report(r: dict) -> None:
    print(f"MoE expert GEMMs on {r['device']}: {r['shape']}")
    print("\nsingle GEMMs, host us per call (median)")
    print("| gemm | seen rows | new rows |\n| --- | --- | --- |")
    by = {(g["gemm"], g["rows"]): g["host_us"] for g in r["gemm"]}
    for kind in dict.fromkeys(g["gemm"] for g in r["gemm"]):
        print(f"| {kind} | {by[(kind, 'seen')]:.1f} | {by[(kind, 'new')]:.1f} |")
    print("\none layer's experts, forward + backward, per call (median)")
    print("| path | host ms | host us per GEMM | device ms | calls that waited for the device |")
    print("| --- | --- | --- | --- | --- |")
    for row in r["layer"]:
        print(
            f"| {row['name']} | {row['host_ms']:.2f} | {row['host_us_per_gemm']:.1f} | {row['device_ms']:.2f} "
            f"| {row['calls_that_waited_for_the_device']} of {row['timed_calls']} |"
        )
    if r.get("note"):
        print(r["note"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (seq x micro-batch)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096, help="expert FFN size (fc1 has twice it: SwiGLU)")
    parser.add_argument("--multiples", type=int, nargs="*", default=[64, 128, 256], help="bucket sizes to run")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per layer path")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls per layer path first")
    parser.add_argument("--gemm-calls", type=int, default=50, help="timed calls per single-GEMM row")
    parser.add_argument("--json", default="", help="write the numbers here")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of the code (fp32), no measurement"
    )
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_moe_gemm.py measures CUDA GEMMs: no CUDA device here (--device cpu: a smoke run).")
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    from megatron.core.transformer.moe.experts import grouped_mm_available, grouped_mm_shapes_conform

    rows = args.tokens * args.topk
    t0 = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {what}", file=sys.stderr, flush=True)

    gemm, used = bench_gemms(args)
    progress("single GEMMs done")
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": f"{args.experts} experts, {rows} rows, hidden {args.hidden}, FFN {args.ffn} (SwiGLU), {args.dtype}",
        "args": {k: str(v) if k == "dtype" else v for k, v in vars(args).items()},
        "gemm": gemm,
        "layer": [],
    }
    fresh = CountSource(args.experts, rows, seed=1, fresh=True)
    fresh.seen.update(used)
    result["layer"].append(bench_layer(args, "loop, new counts", fresh, 1, False))
    progress("loop, new counts done")
    for m in args.multiples:
        source = CountSource(args.experts, rows, seed=2)
        result["layer"].append(bench_layer(args, f"bucketed:{m}", source, m, False))
        progress(f"bucketed:{m} done")
    probe = torch.empty(1, device=args.device, dtype=args.dtype)
    if grouped_mm_available(probe) and grouped_mm_shapes_conform(args.hidden, args.ffn, args.dtype):
        result["layer"].append(bench_layer(args, "grouped", CountSource(args.experts, rows, seed=3), None, True))
    else:
        result["note"] = "no grouped row: torch's grouped GEMM takes CUDA bf16 with 16-byte strides"
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

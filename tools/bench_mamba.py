"""Times the Mamba-2 scan and mixer, forward and forward+backward, against the naive recurrence.

Rows, all measured in the same run on the same inputs:

* ``scan sequential``: ``ssd_sequential_scan``, the recurrence one time step at a time
  (the naive PyTorch reference);
* ``scan chunked Q``: ``ssd_chunked_scan`` on PyTorch (``MEGATRON_SSD_KERNELS=torch``) for each
  ``--chunks`` size;
* ``scan triton 128 F,B``: ``ssd_chunked_scan`` on this project's Triton kernels (``ssd_kernels``), when
  Triton is installed, with ``F`` and ``B`` rows of a chunk per program forward and backward (one
  row per ``--triton-rows`` pair);
* ``scan mamba_ssm``: the fused Triton scan, when mamba-ssm is installed;
* ``mixer torch`` / ``mixer triton`` / ``mixer mamba_ssm``: the whole MambaMixer (projections, conv,
  scan, norm) on the PyTorch path, with the scan on ``ssd_kernels``, and on mamba-ssm's kernels.

Columns: median ms of the forward and of forward+backward (CUDA events), peak memory
above the inputs, and the norm-wise relative error of the scan output against the
sequential recurrence in float32 (the mixer rows compare against the PyTorch mixer).
Prints a table and writes JSON (``--json``).

Usage:
    python tools/bench_mamba.py                    # the hybrid benchmark's sizes: b=2, s=2048, h=1024, bf16
    python tools/bench_mamba.py --device cpu --seq 64 --hidden 64 --head-dim 16 --state 16 --groups 2 --iters 2
"""

import argparse
import json
import os
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.core.ssm import ssd, ssd_kernels  # noqa: E402
from megatron.core.ssm.mamba_config import MambaConfig  # noqa: E402
from megatron.core.ssm.mamba_mixer import HAVE_MAMBA_SSM, MambaMixer, mamba_chunk_scan_combined  # noqa: E402
from megatron.core.ssm.ssd import ssd_chunked_scan, ssd_sequential_scan  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024, help="heads = 2 * hidden / head dim, as Megatron's default")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per row (median reported)")
    p.add_argument("--sequential-iters", type=int, default=3, help="repetitions of the slow sequential row")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--skip-sequential", action="store_true", help="leave out the naive recurrence")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument(
        "--slice-mib",
        type=float,
        default=None,
        help="GroupSlicedScan's eager budget per slice (ssd.EAGER_SLICE_BYTES, in MiB): fewer slices launch fewer kernels",
    )
    p.add_argument(
        "--triton-rows",
        nargs="+",
        default=[f"{ssd_kernels._BQ_FORWARD},{ssd_kernels._BQ_BACKWARD}"],
        metavar="FWD,BWD",
        help="rows of a chunk per program of the Triton scan's forward and backward kernels: one row each",
    )
    return p.parse_args(argv)


def tiles(spec: str):
    """``--triton-rows``' ``FWD,BWD`` as a patch of ``ssd_kernels``' tile rows."""
    forward, backward = (int(v) for v in spec.split(","))
    return mock.patch.multiple(ssd_kernels, _BQ_FORWARD=forward, _BQ_BACKWARD=backward)


def scan_on(switch: str):
    """The Mamba scan on ``ssd_kernels`` (``triton``) or on PyTorch (``torch``) inside the block."""
    return mock.patch.dict(os.environ, {ssd_kernels.ENV_SWITCH: switch})


class Timer:
    """Wall time of a callable on one device: CUDA events on CUDA, perf_counter elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1000.0


def scan_inputs(args, device, dtype, gen):
    heads = 2 * args.hidden // args.head_dim
    b, s, p, g, n = args.batch, args.seq, args.head_dim, args.groups, args.state

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cpu").to(device)

    return {
        "x": rnd(b, s, heads, p).to(dtype),
        "dt": F.softplus(rnd(b, s, heads) - 4.0),  # softplus(dt_bias) starts in [1e-3, 0.1]
        "A": -torch.empty(heads).uniform_(1.0, 16.0, generator=gen).to(device),
        "B": rnd(b, s, g, n).to(dtype),
        "C": rnd(b, s, g, n).to(dtype),
        "D": torch.ones(heads, device=device),
    }


def measure(name, fn, leaves, timer, iters, warmup, device, reference=None):
    """Times ``fn()`` forward and forward+backward; returns the row."""

    def forward():
        with torch.no_grad():
            return fn()

    def forward_backward():
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward(grad)

    out = fn()
    grad = torch.randn_like(out)
    for _ in range(warmup):
        forward()
        forward_backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    fwd = statistics.median(timer(forward) for _ in range(iters))
    both = statistics.median(timer(forward_backward) for _ in range(iters))
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
    err = None
    if reference is not None:
        with torch.no_grad():
            out = fn().double()
            err = ((out - reference).norm() / reference.norm()).item()
    return {"row": name, "fwd_ms": fwd, "fwd_bwd_ms": both, "peak_mib": peak, "rel_err": err}


def optional(name, fn, leaves, timer, args, device, reference):
    """A row of an optional package's kernels: its failure is reported in the row, not raised."""
    try:
        return measure(name, fn, leaves, timer, args.iters, args.warmup, device, reference)
    except Exception as error:  # noqa: BLE001 - an optional kernel's error is shown in the table
        print(f"{name}: failed: {type(error).__name__}: {error}")
        return {"row": name, "fwd_ms": None, "fwd_bwd_ms": None, "peak_mib": None, "rel_err": None, "error": str(error)}


def main(argv=None):
    args = parse_args(argv)
    if args.slice_mib is not None:
        ssd.EAGER_SLICE_BYTES = int(args.slice_mib * 2**20)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    timer = Timer(device)
    gen = torch.Generator().manual_seed(0)
    inp = scan_inputs(args, device, dtype, gen)
    leaves = [inp[k].requires_grad_() for k in ("x", "dt", "A", "B", "C", "D")]
    x, dt, A, B, C, D = leaves
    with torch.no_grad():  # the recurrence in fp32 on the same (rounded) inputs: the error reference
        ref = ssd_sequential_scan(x.float(), dt, A, B.float(), C.float(), D=D).double()
    rows = []
    if not args.skip_sequential:
        rows.append(
            measure(
                "scan sequential",
                lambda: ssd_sequential_scan(x, dt, A, B, C, D=D),
                leaves,
                timer,
                args.sequential_iters,
                1,
                device,
                ref,
            )
        )
    for q in args.chunks:
        with scan_on("torch"):
            rows.append(
                measure(
                    f"scan chunked {q}",
                    lambda q=q: ssd_chunked_scan(x, dt, A, B, C, q, D=D),
                    leaves,
                    timer,
                    args.iters,
                    args.warmup,
                    device,
                    ref,
                )
            )
    if ssd_kernels.HAVE_TRITON and device.type == "cuda":
        for spec in args.triton_rows:
            with scan_on("triton"), tiles(spec):
                rows.append(
                    optional(f"scan triton 128 {spec}", lambda: ssd_chunked_scan(x, dt, A, B, C, 128, D=D), leaves,
                             timer, args, device, ref)
                )  # fmt: skip
    if HAVE_MAMBA_SSM and device.type == "cuda":
        rows.append(
            optional(
                "scan mamba_ssm 128",
                lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 128, D=D),
                leaves,
                timer,
                args,
                device,
                ref,
            )
        )

    cfg = TransformerConfig(hidden_size=args.hidden, num_attention_heads=8, num_layers=8).finalize()
    cfg.params_dtype = dtype
    mc = MambaConfig(mamba_state_dim=args.state, mamba_head_dim=args.head_dim, mamba_num_groups=args.groups)
    torch.manual_seed(0)
    mixer = MambaMixer(cfg, mc, device=device, use_fused_kernels=False)
    hidden = torch.randn(args.seq, args.batch, args.hidden, generator=gen).to(device, dtype).requires_grad_()
    params = [hidden, *mixer.parameters()]
    with scan_on("torch"):
        with torch.no_grad():
            mixer_ref = mixer(hidden)[0].double()
        rows.append(
            measure("mixer torch", lambda: mixer(hidden)[0], params, timer, args.iters, args.warmup, device, mixer_ref)
        )
    if ssd_kernels.HAVE_TRITON and device.type == "cuda":
        with scan_on("triton"):
            rows.append(optional("mixer triton", lambda: mixer(hidden)[0], params, timer, args, device, mixer_ref))
    if HAVE_MAMBA_SSM and device.type == "cuda":
        mixer.use_fused_kernels = True
        rows.append(optional("mixer mamba_ssm", lambda: mixer(hidden)[0], params, timer, args, device, mixer_ref))

    heads = 2 * args.hidden // args.head_dim
    print(
        f"batch {args.batch}, seq {args.seq}, heads {heads} x {args.head_dim}, state {args.state}, "
        f"groups {args.groups}, {args.dtype}, {device} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), torch {torch.__version__}"
    )
    print(f"{'row':<26}{'fwd ms':>10}{'fwd+bwd ms':>12}{'peak MiB':>10}{'rel err':>10}")
    for r in rows:
        if r["fwd_ms"] is None:
            print(f"{r['row']:<26}{'failed':>10}")
            continue
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        print(f"{r['row']:<26}{r['fwd_ms']:>10.2f}{r['fwd_bwd_ms']:>12.2f}{peak:>10}{err:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()

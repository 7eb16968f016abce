"""What the Mamba scan's Triton kernels need on a Hopper GPU, found without one.

Runs the scan's forward and backward (``megatron/core/ssm/ssd_kernels.py``) on the meta device,
records each kernel launch as made (arguments, dtypes, tile sizes, warps), compiles each for
``sm_90`` ahead of time with Triton, and prints per kernel its shared memory, registers per thread
and stack bytes per thread (registers spilled to local memory), from ``cuobjdump -res-usage`` on
the cubin. A kernel that asks for more shared memory than an H100/H200 block may have fails here
instead of at its first launch on the GPU.

Needs Triton with its NVIDIA backend (the pip wheel carries ptxas and cuobjdump); no GPU, no driver.

    python tools/ssd_kernel_resources.py                       # the hybrid benchmark's shapes, bf16
    python tools/ssd_kernel_resources.py --dtype fp32 --head-dim 64 --state 128 --chunk 256
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from megatron.core.ssm import ssd_kernels  # noqa: E402

HOPPER_SHARED_BYTES = 232448
"""The most shared memory one block may have on sm_90 (227 KiB, opted in)."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64"}


def recorded_launches(dtype, batch=2, seq=2048, heads=32, head_dim=64, groups=8, state=128, chunk=128, D=True):
    """``[(kernel, args, constants)]`` of one forward and one backward of the scan at these shapes
    (default: the hybrid benchmark's mixer), on the meta device (nothing runs)."""
    launches = []

    def record(kernel, grid, *args, **constants):
        launches.append((kernel, args, constants))

    def empty(*shape, dtype=dtype):
        return torch.empty(*shape, device="meta", dtype=dtype)

    x, dt, A = empty(batch, seq, heads, head_dim), empty(batch, seq, heads), empty(heads, dtype=torch.float32)
    B, C = empty(batch, seq, groups, state), empty(batch, seq, groups, state)
    skip = empty(heads, dtype=torch.float32) if D else None
    with mock.patch.object(ssd_kernels, "_launch", record):
        ssd_kernels.scan(x, dt, A, B, C, chunk, D=skip)
        a = A.expand(batch, seq, heads)
        ssd_kernels.scan_grads(x, dt, a, B, C, skip, chunk, None, dy=empty(batch, seq, heads, head_dim))
    return launches


def _signature(kernel, args, constants):
    names = [name for name in kernel.arg_names if name not in constants]
    if len(names) != len(args):
        raise ValueError(f"{kernel.__name__}: {len(args)} arguments for {len(names)} parameters")
    signature = {name: "constexpr" for name in constants}
    for name, arg in zip(names, args):
        signature[name] = _POINTER[arg.dtype] if isinstance(arg, torch.Tensor) else "i32"
    return {name: signature[name] for name in kernel.arg_names}


def resources(kernel, args, constants, capability=90) -> dict:
    """Compiles one recorded launch for ``sm_<capability>``: ``{"shared", "registers", "stack"}``
    (bytes per block, per thread, bytes per thread)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = dict(constants)
    warps = constants.pop("num_warps", 4)
    source = ASTSource(fn=kernel, signature=_signature(kernel, args, constants), constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump(), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    found = {key: re.search(rf"{key}:(\d+)", usage) for key in ("REG", "STACK")}
    if not all(found.values()):
        raise RuntimeError(f"cuobjdump -res-usage said nothing of registers or stack:\n{usage}")
    return dict(shared=compiled.metadata.shared, registers=int(found["REG"][1]), stack=int(found["STACK"][1]))


def cuobjdump() -> str:
    """The cuobjdump that Triton's NVIDIA backend carries (or one on PATH)."""
    import triton

    carried = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(carried) if carried.exists() else "cuobjdump"


def table(launches, capability=90) -> list[dict]:
    rows = []
    for kernel, args, constants in launches:
        shown = {k: v for k, v in constants.items() if k != "num_warps"}
        row = dict(kernel=kernel.__name__, warps=constants.get("num_warps", 4), constants=shown)
        rows.append(row | resources(kernel, args, constants, capability))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--capability", type=int, default=90, help="compute capability to compile for (90: H100/H200)")
    args = p.parse_args(argv)
    launches = recorded_launches(
        DTYPES[args.dtype], heads=args.heads, head_dim=args.head_dim, groups=args.groups, state=args.state,
        chunk=args.chunk,
    )  # fmt: skip
    over = 0
    print(f"{'kernel':32s} {'warps':>5s} {'shared B':>9s} {'regs':>5s} {'stack B':>8s}  tiles")
    for row in table(launches, args.capability):
        over += row["shared"] > HOPPER_SHARED_BYTES
        print(
            f"{row['kernel']:32s} {row['warps']:5d} {row['shared']:9d} {row['registers']:5d} {row['stack']:8d}"
            f"  {row['constants']}"
        )
    print("stack B: registers spilled to local memory, per thread; 0 is best.")
    if over:
        print(f"{over} kernel(s) over the {HOPPER_SHARED_BYTES} bytes of shared memory a Hopper block may have")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

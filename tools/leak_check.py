"""Graphed training leaks nothing: pool and allocator bytes are the same at iteration A and B.

For each model family (dense GPT, MoE GPT, hybrid Mamba) and its graph scopes, trains
``--iters`` iterations with CUDA graphs and reads, after iterations ``--at`` and
``--iters`` (device synchronised): the graph pool's reserved and live bytes (allocator
snapshot filtered by our pool ids), ``torch.cuda.memory_allocated`` and
``memory_reserved``. A difference in the pool's bytes or in allocated bytes is a leak,
reported with the bytes, and the exit code is 1 then; the allocator's reserved bytes are
shown too (the eager cache may still settle). JSON out with ``--json``.

Usage (on a GPU):
    python tools/leak_check.py                          # every family, 1000 iterations each
    python tools/leak_check.py --family moe --iters 200 --at 10
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMON = (
    "--lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --seed 1234 --tokenizer-type NullTokenizer "
    "--vocab-size 32000 --mock-data --log-interval 1000000 --num-workers 0 --bf16 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --micro-batch-size 2 --global-batch-size 4"
)
FAMILIES = {
    # (model flags, scopes); two micro-batches per iteration, so gradient accumulation runs too.
    "dense": (
        "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512",
        ["", "attn", "mlp"],
    ),
    "moe": (
        "--num-layers 4 --hidden-size 512 --ffn-hidden-size 1024 --num-attention-heads 8 --seq-length 512 "
        "--max-position-embeddings 512 --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
        "--swiglu --disable-bias-linear",
        ["attn", "moe_router moe_preprocess", "moe"],
    ),
    "hybrid": (
        "--hybrid-layer-pattern M*-M*- --hidden-size 512 --num-attention-heads 8 --seq-length 512 "
        "--max-position-embeddings 512",
        ["mamba", "attn", "mlp"],
    ),
}
DROP_AND_PAD = "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity"
LEAK_KEYS = ("pool_reserved_bytes", "pool_live_bytes", "allocated_bytes")


def flags_for(family: str, scope: str) -> str:
    model, _ = FAMILIES[family]
    if family == "moe" and scope == "moe":
        model = f"{model} {DROP_AND_PAD}"  # the whole MoE block is graphable with drop-and-pad only
    return f"{model} {COMMON} --cuda-graph-impl local --cuda-graph-scope {scope}".rstrip()


def readings(trainer) -> dict:
    import torch

    torch.cuda.synchronize()
    reserved, live = trainer.graphs.pool_stats()
    return {
        "pool_reserved_bytes": int(reserved),
        "pool_live_bytes": int(live),
        "allocated_bytes": int(torch.cuda.memory_allocated()),
        "reserved_bytes": int(torch.cuda.memory_reserved()),
    }


def check(family: str, scope: str, iters: int, at: int) -> dict:
    """Trains one (family, scope); its readings at ``at`` and ``iters`` and their drift."""
    import torch

    import pretrain_hybrid
    from megatron.core import parallel_state
    from megatron.training.data import build_data_iterators
    from megatron.training.training import build_trainer

    argv = f"{flags_for(family, scope)} --train-iters {iters}".split()
    torch.cuda.empty_cache()
    trainer = build_trainer(argv, **pretrain_hybrid.providers(argv))
    start = time.perf_counter()
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        first = last = None
        for i in range(1, iters + 1):
            trainer.train_step(it)
            if i == at:
                first = readings(trainer)
        last = readings(trainer)
        if not trainer.graphs.captured:
            raise RuntimeError(f"{family} {scope!r}: nothing was captured")
        graphs = trainer.graphs.num_graphs()
        trainer.graphs.close()
    finally:
        parallel_state.destroy(trainer.pg)
    drift = {k: last[k] - first[k] for k in first}
    return {
        "family": family,
        "scope": scope or "layer",
        "iters": iters,
        "at": at,
        "graphs": graphs,
        "first": first,
        "last": last,
        "drift": drift,
        "seconds": time.perf_counter() - start,
    }


def table(rows) -> str:
    head = (
        f"{'family':7} {'scope':26} {'graphs':>6} {'pool res MiB':>12} {'pool live':>9} {'alloc MiB':>9} "
        f"{'drift pool res/live, alloc, reserved (bytes)':>46} {'s':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        d, f = r["drift"], r["last"]
        lines.append(
            f"{r['family']:7} {r['scope']:26} {r['graphs']:6d} {f['pool_reserved_bytes'] / 2**20:12.1f} "
            f"{f['pool_live_bytes'] / 2**20:9.1f} {f['allocated_bytes'] / 2**20:9.1f} "
            f"{d['pool_reserved_bytes']:>12d} {d['pool_live_bytes']:>10d} {d['allocated_bytes']:>10d} "
            f"{d['reserved_bytes']:>11d} {r['seconds']:6.1f}"
        )
    lines.append(
        f"readings after iteration {rows[0]['at']} and {rows[0]['iters']}; drift = last - first" if rows else ""
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", nargs="*", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    parser.add_argument("--scopes", nargs="*", help="scopes to run (default: each family's list); '' = whole layers")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--at", type=int, default=10, help="the first reading, after this iteration")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not 2 <= args.at < args.iters:
        parser.error("need 2 <= --at < --iters (iteration 1 records and captures)")
    runs = [(f, s) for f in args.family for s in (FAMILIES[f][1] if args.scopes is None else args.scopes)]
    print(f"{len(runs)} runs of {args.iters} iterations", flush=True)
    rows = []
    for family, scope in runs:
        row = check(family, scope, args.iters, args.at)
        rows.append(row)
        print(f"{family} {scope or 'layer'}: drift {row['drift']} ({row['seconds']:.0f} s)", flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    leaks = [r for r in rows if any(r["drift"][k] for k in LEAK_KEYS)]
    for r in leaks:
        print(f"LEAK: {r['family']} {r['scope']}: {r['drift']}", file=sys.stderr)
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())

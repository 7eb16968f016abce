"""The two- and four-GPU validation runs: every layout of the issue's table in one call, table last.

``--gpus 2`` (the default) runs the two-GPU table, ``--gpus 4`` the four-GPU one
(``two_gpu_plan.all_runs``); both go through the code below. Each run is ``torchrun
--standalone --nproc-per-node N pretrain_gpt.py ...``, launched as ``python -m
torch.distributed.run`` so it uses this interpreter; a two-"node" run is two launchers
(``--nnodes 2 --node-rank i --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``), each
given its own GPUs with CUDA_VISIBLE_DEVICES, watched and killed together. Its stdout
and stderr go to ``<out>/<name>.log``, its metrics file to ``<out>/<name>.jsonl``. From
them (``two_gpu_logs.py``) each row gets: the lm loss of every iteration (exact, from
the metrics file), its agreement with the eager run of the same layout (bit for bit
expected in ``--deterministic-mode``) and, for the two-GPU table's dense model, with the
one-GPU eager run (within the stated tolerance), the peak device memory of each rank
(the last memory line's max reserved; the last rank's metrics file when that rank
prints no memory line; else the driver's peak of the rank's GPU, polled through NVML)
and its change against eager, ms/iteration (median after the warm-up) and its ratio to
eager, and each rank's graph count against its bound (``two_gpu_plan.graph_bound``;
ranks the trainer reports no count for, data-parallel ranks > 0 other than the last,
show none). Runs have a hard timeout and a hang check (``two_gpu_proc.py``); a run that
does not exit after its last iteration is reported as hung. The time budget covers the
whole call: a run whose estimate (scaled by how the finished runs compared with theirs)
no longer fits is skipped and reported. Results are written to ``<out>/two_gpu.json``
(``four_gpu.json``) after every run.

``--cpu-smoke`` runs the same table with tiny fp32 models on two (four) gloo CPU
processes (graph flags accepted, runs eager); memory and graph columns are then empty.

Usage:
    tools/two_gpu_check.sh                                  # the GPU table, output in $OUT
    python tools/two_gpu_run.py --out DIR --only tp2sp_eager tp2sp_layer --iters 10
    python tools/two_gpu_run.py --cpu-smoke --out DIR --iters 3
    tools/four_gpu_check.sh                                 # the four-GPU table (--gpus 4)
    python tools/two_gpu_run.py --gpus 4 --cpu-smoke --out DIR --only tp2pp2vpp2_2node_eager
    python tools/two_gpu_run.py --dry-run                   # the plan and its estimated time
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time

_TOOLS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TOOLS)
sys.path.insert(0, _TOOLS)
sys.path.insert(0, _ROOT)
import two_gpu_logs as logs  # noqa: E402
import two_gpu_plan as plan  # noqa: E402
import two_gpu_proc as proc  # noqa: E402

WARMUP = 5
"""Iterations left out of the ms/iteration median (the first records and captures); a third
of the run when that is fewer."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(spec: plan.RunSpec, sizes: plan.Sizes, iters: int, out: str, ckpt_dir: str, env: dict[str, str]):
    """The launcher commands of ``spec`` and the environment of each: [(command, env)].

    One ``--standalone`` launcher, or (``spec.nodes`` > 1) one launcher per "node" of
    ``nproc // nodes`` processes joined by a c10d rendezvous on 127.0.0.1, node ``i``
    seeing the ``i``-th group of GPUs (none on the CPU). Node 0 hosts the rendezvous
    store and is started first.
    """
    argv = plan.argv(spec, sizes, iters, metrics_file=os.path.join(out, f"{spec.name}.jsonl"), ckpt_dir=ckpt_dir)
    run = [sys.executable, "-m", "torch.distributed.run"]
    if spec.nodes == 1:
        return [([*run, "--standalone", "--nproc-per-node", str(spec.nproc), "pretrain_gpt.py", *argv], env)]
    per_node = spec.nproc // spec.nodes
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = f"{spec.name}-{os.getpid()}-{time.time_ns()}"
    out_cmds = []
    for node in range(spec.nodes):
        launcher = [*run, "--nnodes", str(spec.nodes), "--nproc-per-node", str(per_node), "--node-rank", str(node)]
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
        launcher += ["--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1"]
        node_env = dict(env)
        if env.get("CUDA_VISIBLE_DEVICES") != "":  # on the CPU no node sees a GPU
            node_env["CUDA_VISIBLE_DEVICES"] = proc.node_devices(node, per_node, env.get("CUDA_VISIBLE_DEVICES"))
        out_cmds.append(([*launcher, "pretrain_gpt.py", *argv], node_env))
    return out_cmds


def _env(cpu: bool, gpus: int = 2) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # Whole lines per write: with unbuffered output two ranks' lines could interleave.
    env.pop("PYTHONUNBUFFERED", None)
    for key, value in plan.TABLE_ENV[gpus].items():
        env.setdefault(key, value)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def execute(spec, sizes, iters, out, ckpt_dir, *, timeout_s: float, cpu: bool, gpus: int = 2) -> dict:
    """Runs ``spec``; returns its row: outcome and everything read from its log and metrics file."""
    log_path = os.path.join(out, f"{spec.name}.log")
    for stale in (log_path, os.path.join(out, f"{spec.name}.jsonl")):
        if os.path.exists(stale):
            os.remove(stale)
    env = _env(cpu, gpus)
    if spec.nproc == 1 and not cpu:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    jobs = commands(spec, sizes, iters, out, ckpt_dir, env)
    shown = "\n".join(" ".join(cmd) for cmd, _ in jobs)
    with open(log_path, "w") as f:
        f.write("".join(f"$ {' '.join(cmd)}\n" for cmd, _ in jobs))
    grace = sizes.hang_grace_s + (30.0 if spec.kind == "save" else 0.0)  # the save follows the last line
    with proc.MemoryPoller(None if cpu else proc.nvml_sampler()) as poller:
        outcome = proc.run_commands(
            [cmd for cmd, _ in jobs],
            log_path,
            timeout_s=timeout_s,
            hang_grace_s=grace,
            stall_s=sizes.stall_s,
            envs=[e for _, e in jobs],
            cwd=_ROOT,
        )
    row = dict(analyse_log(spec, log_path), **_outcome_fields(outcome), command=shown)
    if poller.peaks:
        gpu_of = proc.rank_gpus(spec.nproc, env.get("CUDA_VISIBLE_DEVICES"), outcome.pids)
        row["nvml_peak_mb"] = {str(r): poller.peaks[g] for r, g in enumerate(gpu_of) if g in poller.peaks}
    return row


def warmup(iters: int) -> int:
    """Iterations of a run of ``iters`` left out of its ms/iteration median."""
    return min(WARMUP, max(1, iters // 3))


def _outcome_fields(outcome: proc.Outcome) -> dict:
    return {
        "status": outcome.status,
        "rc": outcome.rc,
        "wall_s": round(outcome.wall_s, 1),
        "last_iteration": outcome.last_iteration,
        "final_line_after_s": None if outcome.final_after_s is None else round(outcome.final_after_s, 1),
    }


def analyse_log(spec: plan.RunSpec, log_path: str) -> dict:
    """What the log and metrics file of one run say: losses, ms/iteration, memory and graphs per rank."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    records = logs.read_metrics(log_path[: -len(".log")] + ".jsonl")
    rows = logs.parse_iteration_lines(text)
    losses, source = logs.losses(text, records)
    memory = logs.per_rank_memory(text, records, spec.nproc)
    error = next((ln.strip() for ln in reversed(text.splitlines()) if "Error" in ln or "error:" in ln), None)
    return {
        "name": spec.name,
        "what": spec.describe(),
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "loss_source": source,
        "ms_per_iter": logs.median_ms(rows, warmup(max((r["train_iters"] for r in rows), default=0))),
        "ranks": {str(r): m for r, m in sorted(memory.items())},
        "pool_lines": logs.parse_pool_lines(text),
        "error": error,
    }


def _loss_dict(row: dict) -> dict[int, float]:
    return {int(k): v for k, v in row.get("losses", {}).items()}


def compare(spec: plan.RunSpec, row: dict, rows: dict[str, dict], sizes: plan.Sizes, iters: int) -> None:
    """Adds the checks of ``row`` against its references (in place): losses, memory, speed, graphs."""
    checks, problems = {}, []
    got = _loss_dict(row)
    save_at = plan.save_iteration(iters)
    expected = {"save": save_at, "load": iters - save_at}.get(spec.kind, iters)
    if row["status"] == "failed":
        problems.append(f"failed (rc {row['rc']}): {(row.get('error') or 'see the log')[:120]}")
    elif row["status"] != "ok":
        problems.append(f"{row['status']} at iteration {row.get('last_iteration', 0)}")
    elif len(got) != expected:
        problems.append(f"logged {len(got)} of {expected} iterations")
    ref = rows.get(spec.eager_ref) if spec.eager_ref else None
    if ref is not None and got and not _loss_dict(ref):
        problems.append(f"no losses of {spec.eager_ref} to compare with")
    elif ref is not None and got:
        want = _loss_dict(ref)
        if spec.kind == "save":
            c = logs.compare_losses(got, want, range(1, save_at + 1))
            checks["vs_eager"] = c
            if c is None or not c["bitwise"]:
                problems.append(f"not bitwise as {spec.eager_ref}")
        elif spec.kind == "load":
            if min(got) != save_at + 1:
                problems.append(f"did not resume at iteration {save_at + 1} (first {min(got)})")
            c = logs.compare_losses(got, want, range(save_at + 1, iters + 1))
            checks["vs_eager"] = c
            if c is None or c["max_rel"] > sizes.layout_rtol:
                problems.append(f"loss off {spec.eager_ref} beyond {sizes.layout_rtol:g}")
        else:
            c = logs.compare_losses(got, want)
            checks["vs_eager"] = c
            if c is None or not c["bitwise"]:
                problems.append(f"not bitwise as {spec.eager_ref}")
    one = rows.get(spec.one_gpu_ref) if spec.one_gpu_ref else None
    if one is not None and got:
        c = logs.compare_losses(got, _loss_dict(one))
        checks["vs_one_gpu"] = c
        if c is None or c["max_rel"] > sizes.layout_rtol:
            problems.append(f"loss off 1 GPU beyond {sizes.layout_rtol:g}")
    if ref is not None and spec.kind == "train":
        if row.get("ms_per_iter") and ref.get("ms_per_iter"):
            checks["ms_vs_eager"] = row["ms_per_iter"] / ref["ms_per_iter"]
        overhead, from_driver = {}, []
        for rank, m in row["ranks"].items():
            base = ref["ranks"].get(rank)
            if base and base["max_reserved_mb"]:
                overhead[rank] = m["max_reserved_mb"] / base["max_reserved_mb"] - 1.0
        # Ranks without the allocator's numbers (no memory line): the driver's polled peaks.
        for rank, peak in row.get("nvml_peak_mb", {}).items():
            base = ref.get("nvml_peak_mb", {}).get(rank)
            if rank not in overhead and base:
                overhead[rank] = peak / base - 1.0
                from_driver.append(rank)
        checks["memory_vs_eager"] = overhead
        if from_driver:
            checks["memory_vs_eager_from_nvml"] = from_driver
    if spec.graphed:
        graphs = {}
        reporting = plan.reporting_ranks(spec)
        for rank in range(spec.nproc):
            count = row["ranks"].get(str(rank), {}).get("graphs")
            bound = plan.graph_bound(spec, sizes, rank)
            graphs[str(rank)] = {"graphs": count, "bound": bound, "reported": rank in reporting}
            if count is not None and count > bound:
                problems.append(f"rank {rank}: {count} graphs > bound {bound}")
            if count is not None and count == 0:
                problems.append(f"rank {rank}: no graphs captured")
            if count is None and sizes.name == "gpu" and row["status"] == "ok" and rank in reporting:
                problems.append(f"rank {rank}: no graph count reported")
        checks["graphs"] = graphs
    row["checks"] = checks
    row["problems"] = problems
    row["verdict"] = "ok" if not problems else "; ".join(problems)


def _fmt_loss_check(c: dict | None) -> str:
    if c is None:
        return "-"
    return "bitwise" if c["bitwise"] else f"rel {c['max_rel']:.1e}"


def _per_rank(row: dict, key: str, fmt) -> str:
    values = [row.get("ranks", {}).get(str(r), {}).get(key) for r in range(row.get("nproc", 2))]
    return "/".join("-" if v is None else fmt(v) for v in values)


def _peaks(row: dict) -> str:
    """Each rank's peak in GiB: the allocator's max reserved, else the driver's polled peak (marked *)."""
    cells = []
    for r in map(str, range(row.get("nproc", 2))):
        mine = row.get("ranks", {}).get(r, {}).get("max_reserved_mb")
        driver = row.get("nvml_peak_mb", {}).get(r)
        cells.append(f"{mine / 1024:.2f}" if mine is not None else "-" if driver is None else f"{driver / 1024:.2f}*")
    return "/".join(cells)


def table(rows: list[dict]) -> str:
    """The results as a Markdown table, one row per run, then what the columns mean."""
    ranks = "/".join(f"r{r}" for r in range(max((row.get("nproc", 2) for row in rows), default=2)))
    head = (
        f"| run | what | status | its | loss vs eager | loss vs 1 GPU | ms/it | x eager | peak GiB {ranks} "
        f"| mem vs eager {ranks} | graphs {ranks} (bound) | pool MiB {ranks} | wall s | verdict |"
    )
    lines = [head, "|" + " --- |" * 14]
    for row in rows:
        c = row.get("checks", {})
        ms = row.get("ms_per_iter")
        ratio = c.get("ms_vs_eager")
        overhead = c.get("memory_vs_eager") or {}
        graphs = c.get("graphs")
        if graphs:
            counts = "/".join("-" if g["graphs"] is None else str(g["graphs"]) for g in graphs.values())
            bounds = "/".join(str(g["bound"]) for g in graphs.values())
            graph_cell = f"{counts} ({bounds})"
        else:
            graph_cell = "-"
        driver = set(c.get("memory_vs_eager_from_nvml", ()))
        mem_cell = "/".join(
            f"{overhead[r]:+.1%}{'*' if r in driver else ''}" if r in overhead else "-"
            for r in map(str, range(row["nproc"]))
        )
        cells = [
            row["name"],
            row["what"],
            row["status"],
            str(row.get("last_iteration", "-")),
            _fmt_loss_check(c.get("vs_eager")),
            _fmt_loss_check(c.get("vs_one_gpu")),
            "-" if ms is None else f"{ms:.1f}",
            "-" if ratio is None else f"{ratio:.3f}",
            _peaks(row),
            mem_cell if overhead else "-",
            graph_cell,
            _per_rank(row, "pool_reserved_mb", lambda v: f"{v:.0f}") if graphs else "-",
            "-" if row.get("wall_s") is None else f"{row['wall_s']:.0f}",
            row.get("verdict", "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "loss vs eager: against the eager run of the same layout (graphed runs: bitwise expected in "
        "--deterministic-mode; checkpoint runs: against tp2sp_eager's iterations); loss vs 1 GPU: max relative "
        f"difference to gpu1_eager; ms/it: median after the first {WARMUP} iterations (a third of shorter "
        "runs); peak: the allocator's max reserved per rank (graph pools included); graphs: per rank, bound = "
        "2 (fwd, bwd) x graphed regions x micro-batches in flight; pool: the graph pools' reserved memory."
    )
    notes = []
    if any(row.get("nodes", 1) > 1 for row in rows):
        notes.append(
            'two-"node" runs: loss vs eager against the one-launcher eager run of the layout (bitwise expected)'
        )
    if any(not g["reported"] for row in rows for g in (row.get("checks", {}).get("graphs") or {}).values()):
        notes.append("graphs -: the trainer reports no count for data-parallel ranks > 0 other than the last")
    if notes:
        lines.append("; ".join(notes) + ".")
    if any("*" in _peaks(row) or row.get("checks", {}).get("memory_vs_eager_from_nvml") for row in rows):
        lines.append(
            "*: the driver's peak of the rank's GPU (NVML, polled every 50 ms; context and NCCL buffers "
            "included) where the trainer prints no memory line for that rank (data-parallel rank > 0)."
        )
    return "\n".join(lines)


def pace(rows: dict[str, dict], estimates: dict[str, float]) -> float:
    """Median of actual / estimated wall time over the runs that finished (1 before any), in [0.5, 3]."""
    ratios = [r["wall_s"] / estimates[n] for n, r in rows.items() if r.get("status") == "ok"]
    return min(3.0, max(0.5, statistics.median(ratios))) if ratios else 1.0


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _skipped(spec: plan.RunSpec, reason: str, status: str = "skipped") -> dict:
    return {
        "name": spec.name,
        "what": spec.describe(),
        "status": status,
        "verdict": reason,
        "nproc": spec.nproc,
        "nodes": spec.nodes,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "two_gpu_out"), help="output folder (default $OUT)")
    parser.add_argument("--gpus", type=int, choices=(2, 4), default=2, help="which table: 2 (default) or 4 GPUs")
    parser.add_argument("--only", nargs="+", help="run only these (names as in --dry-run); comma lists work too")
    parser.add_argument("--iters", type=int, default=None, help="iterations per run (default 30; 4 with --cpu-smoke)")
    parser.add_argument("--budget-s", type=float, default=560.0, help="seconds for the whole call (default 560)")
    parser.add_argument("--timeout-s", type=float, default=None, help="hard limit per run (default 3 x estimate)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on --gpus gloo CPU processes")
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint folder (default: a temporary one, removed)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time only")
    args = parser.parse_args(argv)
    sizes = plan.SMOKE if args.cpu_smoke else plan.GPU
    iters = args.iters or (4 if args.cpu_smoke else 30)
    if iters < 3:
        raise SystemExit("--iters: at least 3 (a third is trained before the checkpoint is saved)")
    only = [n for item in args.only for n in item.split(",") if n] if args.only else None
    try:
        runs = plan.select(plan.all_runs(args.gpus), only)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    estimates = {r.name: plan.estimate_s(r, sizes, iters) for r in runs}
    title = {2: "two", 4: "four"}[args.gpus]
    print(f"{title}-GPU validation ({sizes.name} sizes, {iters} iterations per run):")
    for r in runs:
        print(f"  {r.name:22s} {r.describe():60s} ~{estimates[r.name]:.0f} s")
    print(f"  about {sum(estimates.values()):.0f} s in all; budget {args.budget_s:.0f} s", flush=True)
    if args.dry_run:
        return 0
    os.makedirs(args.out, exist_ok=True)
    ckpt_dir = args.ckpt_dir or tempfile.mkdtemp(prefix="two_gpu_ckpt_")
    start = time.monotonic()
    rows: dict[str, dict] = {}
    interrupted = False
    results_path = os.path.join(args.out, plan.RESULTS_FILE[args.gpus])
    # SIGTERM (the shell's backstop timeout) ends the current run as an interrupt does:
    # its processes are killed, and the table of what finished is still printed.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for spec in runs:
            if interrupted:
                rows[spec.name] = _skipped(spec, "not run: interrupted")
                continue
            left = args.budget_s - (time.monotonic() - start)
            if spec.kind == "load" and rows.get(plan.SAVE_RUN, {}).get("status") != "ok":
                row = _skipped(spec, f"needs a saved checkpoint ({plan.SAVE_RUN} did not run or failed)")
            elif left < (need := estimates[spec.name] * pace(rows, estimates)):
                row = _skipped(spec, f"time budget ({left:.0f} s left, ~{need:.0f} s needed)")
            else:
                timeout = min(args.timeout_s or max(60.0, 3 * need), left)
                print(f"== {spec.name}: {spec.describe()} (timeout {timeout:.0f} s)", flush=True)
                try:
                    row = execute(
                        spec, sizes, iters, args.out, ckpt_dir, timeout_s=timeout, cpu=args.cpu_smoke, gpus=args.gpus
                    )
                except KeyboardInterrupt:
                    interrupted = True
                    row = _skipped(spec, "interrupted while running (its processes killed)", status="interrupted")
                else:
                    row["nproc"], row["nodes"] = spec.nproc, spec.nodes
                    compare(spec, row, rows, sizes, iters)
                    print(f"   {row['status']} after {row['wall_s']:.0f} s: {row['verdict']}", flush=True)
            rows[spec.name] = row
            _write(results_path, sizes, iters, rows)
        # Again with every run done: a reference may have run after the run it is for.
        for spec in runs:
            if "checks" in rows[spec.name]:
                compare(spec, rows[spec.name], rows, sizes, iters)
        _write(results_path, sizes, iters, rows)
    finally:
        if args.ckpt_dir is None:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    print()
    print(table(list(rows.values())))
    print(f"(logs and {os.path.basename(results_path)} in {args.out}; {time.monotonic() - start:.0f} s in all)")
    ran = [r for r in rows.values() if r["status"] != "skipped"]
    return 0 if ran and all(r["verdict"] == "ok" for r in ran) else 1


def _write(path: str, sizes: plan.Sizes, iters: int, rows: dict[str, dict]) -> None:
    result = {"sizes": sizes.name, "iters": iters, "layout_rtol": sizes.layout_rtol, "runs": list(rows.values())}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())

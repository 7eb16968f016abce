"""Reading a training run's output: iteration lines, memory lines, graph-pool lines, metrics file.

Pure functions over text, used by ``two_gpu_run.py``. The lines are the trainer's own
(``megatron/training/logging_utils.py`` and the graph session's summary line):

* the iteration line, printed by the last rank::

     [2026-12-04 12:20:26.915732] iteration        1/       4 | consumed samples: 16 | elapsed time
     per iteration (ms): 1133.6 | ... | lm loss: 6.257561E+00 | loss scale: 1.0 | ...

* the memory line, printed by every rank of data-parallel rank 0 (on CUDA only)::

     [Rank 1] (after 30 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00 |
     reserved: 3.00 | max reserved: 4.00 | graph pool reserved: 5.00 | ... | graphs: 18

* the graph pools' line after capture: ``> graph pool | [pipeline rank: 1 of 2 |] graphs: 18 | ...``;
* the metrics file (``--metrics-file``, JSONL, written by the last rank): exact losses
  (the log line keeps 7 digits) and, with ``--log-memory-to-tensorboard``, the last rank's
  memory numbers, which stand in for a memory line that rank does not print.
"""

from __future__ import annotations

import json
import math
import re
import statistics

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|(.*)$")
_MEMORY = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| (.*)$")
_POOL = re.compile(r"> graph pool \| (?:pipeline rank: (\d+) of \d+ \| )?graphs: (\d+) \| reserved: ([\d.]+) MB")
_MB = 2**20


def _fields(text: str) -> dict[str, str]:
    """``key: value | key: value |`` -> {key: value} (values as text)."""
    out = {}
    for part in text.split("|"):
        key, sep, value = part.strip().rpartition(": ")
        if sep:
            out[key.strip()] = value.strip()
    return out


def parse_iteration_lines(text: str) -> list[dict]:
    """Every iteration line of ``text``: iteration, train_iters, ms, lm_loss (None if absent)."""
    rows = []
    for line in text.splitlines():
        m = _ITERATION.search(line)
        if m is None or "elapsed time per iteration (ms)" not in line:
            continue
        fields = _fields(m.group(3))
        loss = fields.get("lm loss")
        rows.append(
            {
                "iteration": int(m.group(1)),
                "train_iters": int(m.group(2)),
                "ms": float(fields["elapsed time per iteration (ms)"]),
                "lm_loss": float(loss) if loss is not None else None,
            }
        )
    return rows


def parse_memory_lines(text: str) -> dict[int, dict]:
    """Rank -> the numbers of its latest memory line (MB; ``graphs`` a count, absent when eager)."""
    per_rank: dict[int, dict] = {}
    for line in text.splitlines():
        m = _MEMORY.search(line)
        if m is None:
            continue
        rank, after = int(m.group(1)), int(m.group(2))
        if rank in per_rank and per_rank[rank]["after_iterations"] > after:
            continue
        fields = _fields(m.group(3))
        entry = {
            "after_iterations": after,
            "max_allocated_mb": float(fields["max allocated"]),
            "max_reserved_mb": float(fields["max reserved"]),
            "source": "memory line",
        }
        if "graphs" in fields:
            entry["graphs"] = int(fields["graphs"])
        if "graph pool reserved" in fields:
            entry["pool_reserved_mb"] = float(fields["graph pool reserved"])
        per_rank[rank] = entry
    return per_rank


def parse_pool_lines(text: str) -> list[dict]:
    """The graph pools' lines after capture: graphs, reserved MB and the pipeline rank when named."""
    out = []
    for line in text.splitlines():
        m = _POOL.search(line)
        if m is not None:
            stage = None if m.group(1) is None else int(m.group(1))
            out.append({"pipeline_rank": stage, "graphs": int(m.group(2)), "reserved_mb": float(m.group(3))})
    return out


def read_metrics(path: str) -> list[dict]:
    """Records of a metrics JSONL file; [] when missing. A torn last line is skipped."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return []
    return records


def memory_from_metrics(records: list[dict]) -> dict | None:
    """The last record's memory numbers in MB (None when absent or zero: no CUDA allocator)."""
    for record in reversed(records):
        peak = record.get("mem-max-reserved-bytes")
        if peak is None:
            continue
        if not peak:
            return None
        entry = {
            "after_iterations": record["iteration"],
            "max_allocated_mb": record["mem-max-allocated-bytes"] / _MB,
            "max_reserved_mb": peak / _MB,
            "source": "metrics file",
        }
        if "graph-count" in record:
            entry["graphs"] = int(record["graph-count"])
        if "graph-pool-reserved-bytes" in record:
            entry["pool_reserved_mb"] = record["graph-pool-reserved-bytes"] / _MB
        return entry
    return None


def per_rank_memory(text: str, records: list[dict], world_size: int) -> dict[int, dict]:
    """Rank -> memory numbers: from its memory line, else (the last rank) from the metrics file."""
    out = parse_memory_lines(text)
    last = world_size - 1
    if last not in out:
        entry = memory_from_metrics(records)
        if entry is not None:
            out[last] = entry
    return out


def losses(text: str, records: list[dict]) -> tuple[dict[int, float], str]:
    """Iteration -> lm loss, exact from the metrics file when it has them, else from the log lines.

    Returns the losses and where they came from (``"metrics file"`` or ``"log (7 digits)"``).
    """
    exact = {r["iteration"]: float(r["lm loss"]) for r in records if r.get("lm loss") is not None}
    if exact:
        return exact, "metrics file"
    rows = parse_iteration_lines(text)
    return {r["iteration"]: r["lm_loss"] for r in rows if r["lm_loss"] is not None}, "log (7 digits)"


def median_ms(rows: list[dict], warmup: int) -> float | None:
    """Median ms/iteration of the iteration lines after the first ``warmup`` iterations of the run."""
    if not rows:
        return None
    first = min(r["iteration"] for r in rows)
    kept = [r["ms"] for r in rows if r["iteration"] >= first + warmup]
    return statistics.median(kept) if kept else None


def compare_losses(got: dict[int, float], want: dict[int, float], iterations=None) -> dict | None:
    """Loss agreement over the iterations both have (or ``iterations``).

    Returns {"iterations": n, "bitwise": bool, "max_rel": float, "first": int, "last": int},
    or None when no iteration is common. A NaN on either side counts as infinitely far.
    """
    common = sorted(set(got) & set(want) if iterations is None else set(iterations) & set(got) & set(want))
    if not common:
        return None
    max_rel = 0.0
    for i in common:
        a, b = got[i], want[i]
        if math.isnan(a) or math.isnan(b):
            rel = math.inf
        else:
            rel = abs(a - b) / max(abs(b), 1e-30)
        max_rel = max(max_rel, rel)
    return {
        "iterations": len(common),
        "bitwise": all(got[i] == want[i] for i in common),
        "max_rel": max_rel,
        "first": common[0],
        "last": common[-1],
    }

"""Memory-regression checks of a graphed memory report (``report.py``), with limits from the
analytic budgets; a violation names the region and the excess.

The checks are two, because they catch different regressions:

* cumulative pool growth, in capture order, against the sum of the activation budgets
  of the regions captured so far (plus their static inputs and outputs and one
  backward's temporaries): catches regions whose saved tensors or temporaries grow;
* bytes still held strongly after capture, per region, against what the region must
  keep (wgrad buffers of shared parameters; outputs of regions without a backward):
  catches a release plan that keeps static buffers (the pre-weak-reference design).
"""

from __future__ import annotations

from megatron.core.transformer.cuda_graphs.report import MIB, MemoryReport, RegionMemory

__all__ = ["BudgetExceeded", "check_budgets", "TEMPORARIES_FACTOR", "SEGMENT_SLACK"]

TEMPORARIES_FACTOR = 2
"""A backward's temporaries, as a multiple of the largest region's activations: the
gradients of its saved tensors (at most as many bytes as they) plus kernel workspaces
(flash attention's fp32 dQ accumulator, split over the SMs in deterministic mode). A
region with a known working memory of its own (``RegionMemory.transient_bytes``) gets
its activations plus that, where larger."""

SEGMENT_SLACK = 22 * MIB
"""Allocator granularity on top of the budget: the pool reserves whole segments (a
20 MiB large-pool segment or expandable-segment growth step, a 2 MiB small-pool one)."""


class BudgetExceeded(AssertionError):
    """A graph memory figure above its analytic budget (the message names the region)."""


def check_budgets(report: MemoryReport, *, tolerance: float = 0.10, slack_bytes: int = SEGMENT_SLACK) -> None:
    """Raises :class:`BudgetExceeded` naming every region over its analytic budget.

    Args:
        report: A ``graphed`` report.
        tolerance: Relative allowance on the pool-growth budget (allocator rounding).
        slack_bytes: Absolute allowance on it (segment granularity).
    """
    if report.mode != "graphed":
        raise ValueError("check_budgets needs a graphed report (a captured session), not an eager-only one")
    problems = []
    by_run: dict[int, dict[int, list[RegionMemory]]] = {}  # slot -> chunk -> rows
    for row in report.regions:
        if row.pool_reserved_growth_bytes is not None:
            by_run.setdefault(row.slot, {}).setdefault(row.chunk, []).append(row)
    for slot, runs in sorted(by_run.items()):
        temporaries = max(
            max(TEMPORARIES_FACTOR * r.activation_bytes, r.activation_bytes + r.transient_bytes)
            for rows in runs.values()
            for r in rows
        )
        budgets = {}
        for chunk, rows in sorted(runs.items()):
            budget = grown = 0
            for row in rows:  # forward order; each row's growth covers its forward and backward captures
                budget += row.activation_bytes + row.static_input_bytes + row.static_output_bytes + row.turn_bytes
                grown += row.pool_reserved_growth_bytes
                limit = (1 + tolerance) * budget + temporaries + slack_bytes
                if grown > limit:
                    problems.append(
                        f"{row.name} (slot {slot}): the pool grew to {grown / MIB:.1f} MiB by its captures, over the "
                        f"analytic budget of the regions so far ({limit / MIB:.1f} MiB = {1 + tolerance:.2f} x "
                        f"{budget / MIB:.1f} MiB activations, static buffers and eager turn + {temporaries / MIB:.1f} MiB "
                        f"backward temporaries + {slack_bytes / MIB:.1f} MiB segments) by "
                        f"{(grown - limit) / MIB:.1f} MiB"
                    )
                    break  # later regions inherit the excess; name the first
            budgets[chunk] = budget
        if len(runs) > 1:  # the chunks' runs take turns in the slot: its pool holds the largest
            grown = sum(r.pool_reserved_growth_bytes for rows in runs.values() for r in rows)
            limit = (1 + tolerance) * max(budgets.values()) + temporaries + slack_bytes
            if grown > limit:
                problems.append(
                    f"slot {slot} (model chunks {', '.join(map(str, sorted(runs)))}): the pool grew to "
                    f"{grown / MIB:.1f} MiB over its runs, over the largest run's budget ({limit / MIB:.1f} MiB) "
                    f"by {(grown - limit) / MIB:.1f} MiB: a later run did not reuse an earlier one's memory"
                )
    for row in report.regions:
        if row.strong_bytes is None:
            continue
        if row.strong_bytes > row.must_keep_bytes:
            problems.append(
                f"{row.name} (slot {row.slot}): {row.strong_bytes / MIB:.2f} MiB of static buffers held strongly "
                f"after capture, {row.must_keep_bytes / MIB:.2f} MiB allowed (shared wgrads, outputs without a "
                f"backward, buffers communication keeps): {(row.strong_bytes - row.must_keep_bytes) / MIB:.2f} MiB too much"
            )
    if problems:
        raise BudgetExceeded("graph memory over budget:\n  " + "\n  ".join(problems))

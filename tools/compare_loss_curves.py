"""Compares two loss curves and says where they first differ.

    python tools/compare_loss_curves.py golden_values.json runs/a/metrics.jsonl
    python tools/compare_loss_curves.py runs/a/metrics.jsonl runs/b/metrics.jsonl --rtol 1e-3

Each input is either a metrics file written by ``--metrics-file`` (JSONL, one object
per logged iteration) or a golden file in Megatron's functional-test schema::

    {"lm loss": {"start_step": 1, "end_step": 50, "step_interval": 1, "values": {"1": 10.93393, ...}}}

The first input is the reference. Exact mode (the default, Megatron's deterministic
check) rounds both curves to ``--decimals`` (5) and requires equality at every step;
``--rtol``/``--atol`` switch to ``|actual - expected| <= atol + rtol * |expected|``.
Steps are those of the reference: a reference step missing from the second curve is a
mismatch, while steps only the second curve has are not compared (upstream goldens are
often sampled, e.g. at steps 1, 5, 10, ...); the report names how many were skipped.
Exit status: 0 when the curves match, 1 when they do not, 2 for unreadable input.

The functions (``load_curve``, ``compare_curves``, ``golden_from_curves``) are imported
by the functional tests and ``tools/regenerate_goldens.py``.
"""

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence

DEFAULT_METRIC = "lm loss"
DEFAULT_DECIMALS = 5
Curve = dict[int, float]


def read_metrics_jsonl(path: str) -> list[dict]:
    """The records of a ``--metrics-file`` (JSONL); blank lines are skipped.

    Raises:
        ValueError: A line is not a JSON object with an ``iteration``.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n} is not JSON ({e.msg}).") from None
            if not isinstance(record, dict) or "iteration" not in record:
                raise ValueError(f"{path}: line {n} has no 'iteration'; is this a --metrics-file?")
            records.append(record)
    return records


def _is_golden(data: object) -> bool:
    return (
        isinstance(data, dict)
        and "iteration" not in data
        and any(isinstance(v, dict) and "values" in v for v in data.values())
    )


def load_curve(path: str, metric: str = DEFAULT_METRIC) -> Curve:
    """``{iteration: value}`` of ``metric`` from a metrics JSONL or a golden JSON file.

    For a metrics file a later record of the same iteration wins (a resumed run that
    appended to the file repeats the iterations after its checkpoint).

    Raises:
        ValueError: Unreadable file, or ``metric`` is not in it.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # several lines: a metrics file
    if _is_golden(data):
        if metric not in data:
            raise ValueError(f"{path}: golden file has no {metric!r} (it has {sorted(data)}).")
        return {int(step): float(value) for step, value in data[metric]["values"].items()}
    curve = {}
    for record in read_metrics_jsonl(path):
        if metric in record and record[metric] is not None:
            curve[int(record["iteration"])] = float(record[metric])
    if not curve:
        raise ValueError(f"{path}: no {metric!r} values (is --log-interval larger than the run?).")
    return curve


def golden_from_curves(curves: Mapping[str, Curve], decimals: int = DEFAULT_DECIMALS) -> dict:
    """Megatron's golden schema for ``{metric: curve}``, values rounded to ``decimals``.

    Raises:
        ValueError: A value is NaN or infinite (a golden must be a healthy run).
    """
    golden = {}
    for metric, curve in curves.items():
        steps = sorted(curve)
        if not steps:
            raise ValueError(f"no values for {metric!r}.")
        bad = [s for s in steps if not math.isfinite(curve[s])]
        if bad:
            raise ValueError(f"{metric!r} is {curve[bad[0]]} at step {bad[0]}; refusing to write it as a golden value.")
        gaps = {b - a for a, b in zip(steps, steps[1:])}
        golden[metric] = {
            "start_step": steps[0],
            "end_step": steps[-1],
            "step_interval": gaps.pop() if len(gaps) == 1 else 1,
            "values": {str(s): round(curve[s], decimals) for s in steps},
        }
    return golden


@dataclasses.dataclass
class Comparison:
    """Outcome of ``compare_curves``.

    Attributes:
        ok: Whether the curves match.
        first_mismatch: First step that differs (or is missing from one curve), else None.
        report: Human-readable lines.
    """

    ok: bool
    first_mismatch: int | None
    report: list[str]

    def text(self) -> str:
        return "\n".join(self.report)


def compare_curves(
    expected: Curve,
    actual: Curve,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    decimals: int = DEFAULT_DECIMALS,
    names: Sequence[str] = ("expected", "actual"),
    metric: str = DEFAULT_METRIC,
    max_rows: int = 10,
) -> Comparison:
    """Compares two curves step by step.

    Args:
        expected: Reference ``{step: value}``.
        actual: ``{step: value}`` to check.
        rtol, atol: Tolerances; both 0 means exact after rounding to ``decimals``.
        decimals: Rounding of the exact mode (golden files hold 5 decimals).
        names: Labels of the two curves in the report.
        metric: Metric name, for the report.
        max_rows: Differing steps listed in the report.
    """
    exact = rtol == 0.0 and atol == 0.0
    mode = f"exact to {decimals} decimals" if exact else f"rtol={rtol:g}, atol={atol:g}"
    steps = sorted(expected)  # the reference's steps; the others are reported, not compared
    only_actual = sorted(set(actual) - set(expected))
    bad = []  # (step, expected, actual, why)
    max_abs = max_rel = 0.0
    for step in steps:
        e, a = expected.get(step), actual.get(step)
        if e is None or a is None:
            bad.append((step, e, a, f"missing in {names[0] if e is None else names[1]}"))
            continue
        if math.isnan(e) or math.isnan(a):
            if not (math.isnan(e) and math.isnan(a)):
                bad.append((step, e, a, "NaN"))
            continue
        diff = abs(a - e)
        if math.isfinite(diff):
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / abs(e) if e else (0.0 if diff == 0 else math.inf))
        same = round(e, decimals) == round(a, decimals) if exact else diff <= atol + rtol * abs(e)
        if not same:
            bad.append((step, e, a, f"diff {a - e:+.3e}"))
    both = len(set(expected) & set(actual))
    report = [
        f"{metric}: {names[0]} ({len(expected)} steps) vs {names[1]} ({len(actual)} steps), {mode}",
        f"  compared {both} steps; max |diff| {max_abs:.3e}, max relative diff {max_rel:.3e}",
    ]
    if only_actual:
        report.append(
            f"  {len(only_actual)} steps only in {names[1]} not compared ({only_actual[0]}..{only_actual[-1]})"
        )
    if not bad:
        report.append("  MATCH")
        return Comparison(True, None, report)
    first = bad[0][0]
    report.append(f"  MISMATCH at {len(bad)} of {len(steps)} steps; first differing step: {first}")
    report.append(f"  {'step':>8}  {'expected':>16}  {'actual':>16}  note")

    def fmt(v):
        return f"{v:16.{decimals + 3}f}" if v is not None else f"{'-':>16}"

    for step, e, a, why in bad[:max_rows]:
        report.append(f"  {step:>8}  {fmt(e)}  {fmt(a)}  {why}")
    if len(bad) > max_rows:
        report.append(f"  ... {len(bad) - max_rows} more")
    return Comparison(False, first, report)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare two loss curves (metrics JSONL or golden JSON).")
    parser.add_argument("expected", help="Reference: golden_values.json or a --metrics-file.")
    parser.add_argument("actual", help="Curve to check: a --metrics-file or golden_values.json.")
    parser.add_argument(
        "--metric", action="append", help=f"Metric to compare (repeatable; default {DEFAULT_METRIC!r})."
    )
    parser.add_argument("--rtol", type=float, default=0.0, help="Relative tolerance (default 0: exact mode).")
    parser.add_argument("--atol", type=float, default=0.0, help="Absolute tolerance (default 0: exact mode).")
    parser.add_argument("--decimals", type=int, default=DEFAULT_DECIMALS, help="Rounding of the exact mode.")
    args = parser.parse_args(argv)
    if args.rtol < 0 or args.atol < 0:
        parser.error("--rtol and --atol must be >= 0.")
    ok = True
    for metric in args.metric or [DEFAULT_METRIC]:
        try:
            expected = load_curve(args.expected, metric)
            actual = load_curve(args.actual, metric)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        result = compare_curves(
            expected, actual, rtol=args.rtol, atol=args.atol, decimals=args.decimals,
            names=(args.expected, args.actual), metric=metric,
        )  # fmt: skip
        print(result.text())
        ok = ok and result.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

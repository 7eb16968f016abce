"""Runs functional-test cases and writes their ``golden_values.json`` (or checks them).

    python tools/regenerate_goldens.py --case gpt_dense_gpu          # on a GPU machine
    python tools/regenerate_goldens.py --all-cpu                     # every CPU case
    python tools/regenerate_goldens.py --case gpt_dense_gpu_cuda_graph --check

Cases live in ``tests/functional_tests/<case>/`` (see ``harness.py`` there). A case
with ``GOLDEN_FROM`` owns no golden file: asking to regenerate it is an error, and
``--check`` compares it against the case it names. Golden files hold every iteration
of each compared metric, rounded to 5 decimals, in Megatron's schema. Review the diff
of a regenerated golden like code: a changed curve means changed numerics.
"""

import argparse
import importlib.util
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _harness():
    path = os.path.join(REPO, "tests", "functional_tests", "harness.py")
    spec = importlib.util.spec_from_file_location("functional_harness", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    harness = _harness()
    parser = argparse.ArgumentParser(description="Write or check golden loss curves of functional-test cases.")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--case", action="append", help="Case folder name (repeatable).")
    which.add_argument("--all-cpu", action="store_true", help="Every CPU case that owns a golden file.")
    which.add_argument("--all-gpu", action="store_true", help="Every GPU case that owns a golden file.")
    parser.add_argument("--check", action="store_true", help="Compare with the golden instead of writing it.")
    parser.add_argument("--workdir", help="Keep run folders here (default: a temporary folder).")
    args = parser.parse_args(argv)

    if args.case:
        names = args.case
    else:
        device = "cpu" if args.all_cpu else "gpu"
        names = [n for n in harness.list_cases() if harness.load_case(n).device == device]
        if not args.check:
            names = [n for n in names if not harness.load_case(n).golden_from]
    try:
        cases = [harness.load_case(n) for n in names]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.check:
        borrowed = [c for c in cases if c.golden_from]
        if borrowed:
            c = borrowed[0]
            print(f"error: {c.name} is checked against {c.golden_from}'s golden file; regenerate "
                  f"{c.golden_from} instead (or pass --check).", file=sys.stderr)  # fmt: skip
            return 2
    if any(c.device == "gpu" for c in cases):
        import torch

        if not torch.cuda.is_available():
            print("error: GPU cases need CUDA; run this on a GPU machine.", file=sys.stderr)
            return 2

    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or tmp
        for case in cases:
            workdir = os.path.join(root, case.name)
            start = time.time()
            print(
                f"[{case.name}] training ({case.device}, {case.nproc} process(es), {case.test_type}) in {workdir}",
                flush=True,
            )
            try:
                curves = harness.run_case(case, workdir)
            except (RuntimeError, ValueError) as e:
                print(f"[{case.name}] FAILED: {e}", file=sys.stderr)
                failed += 1
                continue
            loss = curves.get("lm loss", {})
            summary = f"{len(loss)} steps, lm loss {loss[min(loss)]:.5f} -> {loss[max(loss)]:.5f}" if loss else ""
            print(f"[{case.name}] done in {time.time() - start:.1f} s: {summary}")
            if args.check:
                if not os.path.isfile(case.golden_path):
                    print(f"[{case.name}] no golden file {case.golden_path}", file=sys.stderr)
                    failed += 1
                    continue
                for result in harness.compare_with_golden(case, curves):
                    print(result.text())
                    failed += 0 if result.ok else 1
            else:
                path = harness.write_golden(case, curves)
                print(f"[{case.name}] wrote {os.path.relpath(path, REPO)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

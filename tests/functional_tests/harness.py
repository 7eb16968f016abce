"""Functional-test cases: load one, train it, compare its loss curve with the golden.

A case is a folder ``tests/functional_tests/<name>/`` holding ``model_config.yaml``
and (unless it borrows another case's) ``golden_values.json`` in Megatron's schema.
``model_config.yaml`` keys:

- ``MODEL_ARGS`` (required): Megatron flag -> value, as in Megatron's cases. ``true``
  writes a switch, ``false`` or ``null`` leaves the flag out, a list gives several
  values. ``${DATA_PATH}`` is replaced by the prepared dataset prefix (see ``DATA``).
  Must set ``--log-interval: 1`` so every iteration reaches the metrics file.
- ``TEST_TYPE``: ``regular`` (train once) or ``ckpt-resume`` (train to
  ``--train-iters // 2`` with ``--save``, then resume with ``--load`` to the end; the
  whole curve must match the golden).
- ``DEVICE``: ``cpu`` (default; CUDA hidden, one OpenMP thread, so the numbers do not
  depend on the core count) or ``gpu``.
- ``NPROC``: processes; above 1 the run goes through ``python -m torch.distributed.run``.
- ``METRICS``: metrics to compare (default ``["lm loss"]``).
- ``RTOL`` / ``ATOL``: tolerances; both 0 (default) is Megatron's exact check to 5 decimals.
  CPU cases set ``RTOL: 1.0e-4``: with one thread a CPU run is repeatable bit for bit on
  one machine, but vectorised exp/rsqrt round differently on other CPUs (AVX2, AVX-512,
  NEON), which moves the 5th decimal after a few dozen steps (bf16 CPU matmuls differ
  from step 1, so CPU cases train in fp32). GPU cases stay exact: graphed runs must
  equal the eager golden.
- ``GOLDEN_FROM``: compare against that case's golden file (e.g. graphed vs eager).
- ``DATA``: ``{kind: jsonl, documents: N}`` writes a deterministic JSONL corpus and
  tokenises it with ``tools/preprocess_data.py`` (the case's tokenizer flags).

Runs are subprocesses of ``pretrain_gpt.py``, the users' entry point, so a case
tests exactly what a command line does. ``tools/regenerate_goldens.py`` uses the same
functions to write golden files.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import yaml

FUNCTIONAL_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(FUNCTIONAL_DIR))
CONFIG_FILE = "model_config.yaml"
GOLDEN_FILE = "golden_values.json"
_KEYS = {"MODEL_ARGS", "TEST_TYPE", "DEVICE", "NPROC", "METRICS", "RTOL", "ATOL", "GOLDEN_FROM", "DATA", "ENV_VARS"}
_TEST_TYPES = ("regular", "ckpt-resume")


def _load_tool(name: str):
    """Imports ``tools/<name>.py`` (tools are scripts, not a package)."""
    path = os.path.join(REPO, "tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


compare_tool = _load_tool("compare_loss_curves")


@dataclasses.dataclass
class Case:
    """One functional-test case, as read from its ``model_config.yaml``."""

    name: str
    folder: str
    model_args: dict[str, Any]
    test_type: str = "regular"
    device: str = "cpu"
    nproc: int = 1
    metrics: list[str] = dataclasses.field(default_factory=lambda: ["lm loss"])
    rtol: float = 0.0
    atol: float = 0.0
    golden_from: str | None = None
    data: dict[str, Any] | None = None
    env_vars: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def golden_path(self) -> str:
        """The golden file this case is checked against (its own or GOLDEN_FROM's)."""
        folder = os.path.join(FUNCTIONAL_DIR, self.golden_from) if self.golden_from else self.folder
        return os.path.join(folder, GOLDEN_FILE)

    @property
    def train_iters(self) -> int:
        return int(self.model_args["--train-iters"])


def list_cases() -> list[str]:
    """Names of every case folder, sorted."""
    return sorted(d for d in os.listdir(FUNCTIONAL_DIR) if os.path.isfile(os.path.join(FUNCTIONAL_DIR, d, CONFIG_FILE)))


def load_case(name: str) -> Case:
    """Reads and checks ``<name>/model_config.yaml``.

    Raises:
        ValueError: Unknown keys or values, or a case that would not log every iteration.
    """
    folder = os.path.join(FUNCTIONAL_DIR, name)
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"no functional case {name!r}: {path} does not exist (cases: {', '.join(list_cases())}).")
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    unknown = set(raw) - _KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(_KEYS)}.")
    case = Case(
        name=name,
        folder=folder,
        model_args=dict(raw.get("MODEL_ARGS") or {}),
        test_type=raw.get("TEST_TYPE", "regular"),
        device=raw.get("DEVICE", "cpu"),
        nproc=int(raw.get("NPROC", 1)),
        metrics=list(raw.get("METRICS", ["lm loss"])),
        rtol=float(raw.get("RTOL", 0.0)),
        atol=float(raw.get("ATOL", 0.0)),
        golden_from=raw.get("GOLDEN_FROM"),
        data=raw.get("DATA"),
        env_vars={str(k): str(v) for k, v in (raw.get("ENV_VARS") or {}).items()},
    )
    if case.test_type not in _TEST_TYPES:
        raise ValueError(f"{path}: TEST_TYPE must be one of {_TEST_TYPES}, got {case.test_type!r}.")
    if case.device not in ("cpu", "gpu"):
        raise ValueError(f"{path}: DEVICE must be cpu or gpu, got {case.device!r}.")
    if str(case.model_args.get("--log-interval")) != "1":
        raise ValueError(f"{path}: MODEL_ARGS must set '--log-interval: 1' so every iteration is compared.")
    if "--train-iters" not in case.model_args:
        raise ValueError(f"{path}: MODEL_ARGS must set --train-iters.")
    for flag in ("--metrics-file", "--save", "--load"):
        if flag in case.model_args:
            raise ValueError(f"{path}: {flag} is set by the runner; remove it from MODEL_ARGS.")
    if case.golden_from and not os.path.isfile(os.path.join(FUNCTIONAL_DIR, case.golden_from, CONFIG_FILE)):
        raise ValueError(f"{path}: GOLDEN_FROM names {case.golden_from!r}, which is not a case.")
    if case.data is not None and case.data.get("kind") != "jsonl":
        raise ValueError(f"{path}: DATA.kind must be 'jsonl', got {case.data.get('kind')!r}.")
    return case


def model_args_to_argv(model_args: Mapping[str, Any], substitutions: Mapping[str, str] | None = None) -> list[str]:
    """``{"--num-layers": 2, "--bf16": true}`` -> ``["--num-layers", "2", "--bf16"]``."""

    def text(value: Any) -> str:
        out = str(value)
        for key, sub in (substitutions or {}).items():
            out = out.replace("${" + key + "}", sub)
        return out

    argv: list[str] = []
    for flag, value in model_args.items():
        if value is None or value is False:
            continue
        argv.append(str(flag))
        if value is True:
            continue
        if isinstance(value, (list, tuple)):
            argv.extend(text(v) for v in value)
        else:
            argv.append(text(value))
    return argv


# ---------------------------------------------------------------------- data

_WORDS = (
    "the a one every small large red blue green old new quick slow cat dog bird fish tree river stone house "
    "runs sees eats finds likes makes takes gives sings reads near under over with from into and but then"
).split()


def synthetic_corpus(documents: int, seed: int = 1234) -> list[str]:
    """Deterministic pseudo-sentences (a fixed LCG, so every Python gives the same text)."""
    state = seed
    texts = []

    def draw(n: int) -> int:
        nonlocal state
        state = (1103515245 * state + 12345) % 2**31
        return state % n

    for _ in range(documents):
        sentences = []
        for _ in range(2 + draw(6)):
            words = [_WORDS[draw(len(_WORDS))] for _ in range(4 + draw(8))]
            sentences.append(" ".join(words).capitalize() + ".")
        texts.append(" ".join(sentences))
    return texts


def prepare_jsonl_dataset(case: Case, workdir: str) -> str:
    """Writes the case's corpus, runs ``tools/preprocess_data.py``; returns the --data-path prefix."""
    corpus = os.path.join(workdir, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for text in synthetic_corpus(int(case.data.get("documents", 200)), int(case.data.get("seed", 1234))):
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer_flags = ("--tokenizer-type", "--vocab-file", "--merge-file", "--tokenizer-model", "--vocab-size")
    argv = ["--input", corpus, "--output-prefix", os.path.join(workdir, "corpus"), "--append-eod", "--workers", "1"]
    argv += model_args_to_argv({k: v for k, v in case.model_args.items() if k in tokenizer_flags})
    _load_tool("preprocess_data").main(argv)
    return os.path.join(workdir, "corpus_text_document")


# ---------------------------------------------------------------------- running


def _command(case: Case, argv: list[str]) -> list[str]:
    entry = os.path.join(REPO, "pretrain_gpt.py")
    if case.nproc > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={case.nproc}",
            entry,
            *argv,
        ]
    return [sys.executable, entry, *argv]


def _env(case: Case) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if case.device == "cpu":
        # No GPU, and one thread: CPU kernels then reduce in the same order on any machine.
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.update(case.env_vars)
    return env


def _run(case: Case, argv: list[str], workdir: str, timeout: float) -> None:
    log = os.path.join(workdir, "train.log")
    with open(log, "a", encoding="utf-8") as out:
        proc = subprocess.run(
            _command(case, argv), cwd=workdir, env=_env(case), stdout=out, stderr=subprocess.STDOUT, timeout=timeout
        )
    if proc.returncode != 0:
        with open(log, encoding="utf-8") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"case {case.name}: training exited with code {proc.returncode}; log tail:\n{tail}")


def run_case(case: Case, workdir: str, timeout: float = 600) -> dict[str, dict[int, float]]:
    """Trains the case in ``workdir``; returns ``{metric: {iteration: value}}``."""
    os.makedirs(workdir, exist_ok=True)
    substitutions = {}
    if case.data is not None:
        substitutions["DATA_PATH"] = prepare_jsonl_dataset(case, workdir)
    metrics_file = os.path.join(workdir, "metrics.jsonl")
    argv = model_args_to_argv(case.model_args, substitutions) + ["--metrics-file", metrics_file]
    if case.test_type == "regular":
        _run(case, argv, workdir, timeout)
    else:  # ckpt-resume: stop halfway with a checkpoint, then resume from it
        ckpt = os.path.join(workdir, "checkpoints")
        half = max(1, case.train_iters // 2)
        _run(case, argv + ["--save", ckpt, "--exit-interval", str(half)], workdir, timeout)
        _run(case, argv + ["--save", ckpt, "--load", ckpt], workdir, timeout)
    return {m: compare_tool.load_curve(metrics_file, m) for m in case.metrics}


def read_golden(case: Case) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` from the case's golden file."""
    return {m: compare_tool.load_curve(case.golden_path, m) for m in case.metrics}


def compare_with_golden(case: Case, curves: Mapping[str, dict[int, float]]) -> list[Any]:
    """One ``Comparison`` per metric of the case (golden first)."""
    golden = read_golden(case)
    return [
        compare_tool.compare_curves(
            golden[m],
            curves[m],
            rtol=case.rtol,
            atol=case.atol,
            names=(os.path.relpath(case.golden_path, REPO), f"{case.name} run"),
            metric=m,
        )  # fmt: skip
        for m in case.metrics
    ]


def write_golden(case: Case, curves: Mapping[str, dict[int, float]]) -> str:
    """Writes ``golden_values.json`` into the case folder; returns its path."""
    if case.golden_from:
        raise ValueError(f"case {case.name} is checked against {case.golden_from}'s goldens; regenerate that case.")
    golden = compare_tool.golden_from_curves(curves)
    path = os.path.join(case.folder, GOLDEN_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    return path

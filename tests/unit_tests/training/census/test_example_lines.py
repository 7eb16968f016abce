"""Upstream's example training command lines (``example_lines.yaml``) parse, validate and train here.

The lines come from upstream's ``examples/`` scripts, its docs and the MoE README (see the yaml's
header for how they were written down). Each parses and validates at the smallest world of its
layout, or is refused with the census's kinds of error ("not supported yet" for open features, "not
supported" for what this project does not do), or with the message its entry names. A few train
three iterations on the CPU, their layout flags dropped and sizes scaled by ``tools/make_census.py``'s
own rules, so the census and these lines shrink the same way.
"""

import importlib.util
import math
import pathlib
import re

import pytest
import yaml

from tests.unit_tests.training.census.test_census import _error_kinds, _validate, _world, argv_of

HERE = pathlib.Path(__file__).parent
LINES: dict = yaml.safe_load((HERE / "example_lines.yaml").read_text())
_spec = importlib.util.spec_from_file_location("make_census", HERE.parents[3] / "tools" / "make_census.py")
make_census = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_census)

_DASH_VALUE = re.compile(r"^-[\d.]")  # a negative number is a value, not a flag


def model_args(entry: dict) -> dict:
    """The entry's words -> ``{flag: value}`` in the census's form (True for a switch, "[a b]" for
    several words), without the flags ``drop_from_base`` removes from a docs base line."""
    words = " ".join(entry["argv"]) if isinstance(entry["argv"], list) else entry["argv"]
    args: dict = {}
    flag = None
    for word in words.split():
        if word.startswith("--") and not _DASH_VALUE.match(word):
            flag = word
            args[flag] = []
        else:
            args[flag].append(word)
    base_only = set(entry.get("drop_from_base", ()))
    out = {}
    for flag, values in args.items():
        if flag in base_only:
            continue
        out[flag] = True if not values else values[0] if len(values) == 1 else "[" + " ".join(values) + "]"
    return out


def _check(argv, world, expect, match=None):
    if expect == "train":
        _validate(argv, world)
        return
    with pytest.raises(ValueError) as e:
        _validate(argv, world)
    kinds = _error_kinds(str(e.value))
    if expect == "refused":
        assert re.search(match, str(e.value)), str(e.value)
    elif expect == "not_yet":
        assert kinds == {"not_yet"}, str(e.value)
    else:  # unsupported: as in the census, an out-of-scope flag may come with "not yet" ones
        assert expect == "unsupported" and kinds and kinds <= {"unsupported", "not_yet"}, str(e.value)
        assert "unsupported" in kinds, str(e.value)


def test_lines_cover_the_examples():
    sources = {name.split(" (")[0] for name in LINES}
    for script in (
        "examples/gpt3/train_gpt3_175b_distributed.sh",
        "examples/llama/train_llama3_8b_h100_fp8.sh",
        "examples/mixtral/train_mixtral_8x7b_distributed.sh",
        "examples/gptoss/02_train.sh",
        "examples/mamba/train.sh",
    ):
        assert script in sources
    assert sum(e["expect"] == "train" for e in LINES.values()) >= 15
    assert sum(bool(e.get("train")) for e in LINES.values()) >= 5


@pytest.mark.parametrize("name", list(LINES))
def test_example_line_parses_and_validates(name, tmp_path):
    entry = LINES[name]
    args = model_args(entry)
    _check(argv_of(args, tmp_path), _world(args), entry["expect"], entry.get("match"))
    variant = entry.get("variant")
    if variant:
        kept = {f: v for f, v in args.items() if f not in variant.get("drop", ())}
        if variant.get("add"):
            kept.update(model_args({"argv": variant["add"]}))
        _check(argv_of(kept, tmp_path), _world(kept), variant["expect"], variant.get("match"))


# Not on a CPU: an nsys capture range (--profile) needs CUDA.
_CUDA_ONLY = ("--profile", "--profile-step-start", "--profile-step-end")


def cpu_args(entry: dict) -> dict:
    """The line on one CPU process: the variant's, the layout and the CUDA-only flags dropped, sizes and
    the run's length as the census scales them; the learning-rate schedule keeps the line's length (so
    warm-up still ends before decay); it stops after three iterations."""
    drop = set(entry.get("variant", {}).get("drop", ())) | set(make_census.PARALLEL_LAYOUT_FLAGS) | set(_CUDA_ONLY)
    args = {f: v for f, v in model_args(entry).items() if f not in drop}
    args.pop("--context-parallel-size", None)
    if "--step-batch-size-schedule" in args:  # one string, as the census's configs write it
        args["--step-batch-size-schedule"] = args["--step-batch-size-schedule"].strip("[]")
    out = make_census.scale(args)
    if "--step-batch-size-schedule" in out:
        out.pop("--global-batch-size", None)  # the schedule gives every batch size
        if "--train-iters" in args:
            out.pop("--train-samples", None)  # the line counts iterations
    for length, decay in (("--train-iters", "--lr-decay-iters"), ("--train-samples", "--lr-decay-samples")):
        if length in args and decay not in args:
            out[decay] = args[length]
    out["--exit-interval"] = 3
    return out


@pytest.mark.parametrize("name", [n for n, e in LINES.items() if e.get("train")])
def test_example_line_trains_on_the_cpu(name, tmp_path, capsys):
    from megatron.training.training import pretrain

    entry = LINES[name]
    kwargs = {}
    if entry.get("entry") == "pretrain_hybrid":  # as upstream's script launches it
        import pretrain_hybrid

        kwargs = dict(model_provider=pretrain_hybrid.model_provider, forward_step=pretrain_hybrid.forward_step)
    trainer = pretrain(argv_of(cpu_args(entry), tmp_path), **kwargs)
    losses = [r["lm loss"] for r in trainer.history]
    assert trainer.iteration == 3
    assert len(losses) >= 1 and all(math.isfinite(v) for v in losses)
    assert " iteration        1/" in capsys.readouterr().out

"""The config's life: parse -> resolve (every derived value) -> validate (reads only) -> freeze.

``census/derived_values.json`` holds, for every census config that validates and a
few hand-picked command lines, the fields that set-up derives (the values the trainer
computed before resolve() existed, written by the validate() of that version):
resolve() must derive exactly those.
"""

import copy
import dataclasses
import json
import pathlib
import warnings

import pytest

from megatron.core.config_utils import is_frozen, thawed_copy
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_config import config_to_dict
from tests.unit_tests.training.census import test_census as census

GOLDEN = json.loads((pathlib.Path(census.__file__).parent / "derived_values.json").read_text())
TMP = pathlib.Path("/tmp/census_tmp")  # paths only appear in the flags; nothing is written


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if prefix == "model." and k == "moe":
            continue  # model.moe is RunConfig.moe
        if isinstance(v, dict):
            out.update(_flat(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def _cases():
    for name, entry in GOLDEN.items():
        if name.startswith("extra/"):
            yield name, entry["argv"].split(), entry["world"], entry["derived"]
            continue
        base, _, tag = name.partition("#")
        args = census.CENSUS[base]["MODEL_ARGS"]
        drop = census.CENSUS[base]["single_device"] if tag else ()
        world = 1 if tag else census._world(args)
        yield name, census.argv_of(args, TMP, drop=drop), world, entry


CASES = list(_cases())


@pytest.mark.parametrize("name,argv,world,derived", CASES, ids=[c[0] for c in CASES])
def test_resolve_derives_what_setup_derived_and_validate_reads_only(name, argv, world, derived):
    parsed = parse_args(argv)
    as_parsed = copy.deepcopy(parsed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = parsed.resolve(world_size=world)
        assert parsed == as_parsed  # resolve works on a copy
        before = copy.deepcopy(cfg)
        cfg.validate()
    assert cfg == before  # deep compare: validate changed nothing
    assert config_to_dict(cfg) == config_to_dict(before)
    start, end = _flat(config_to_dict(parsed)), _flat(config_to_dict(cfg))
    assert {k: end[k] for k in end if start.get(k, object()) != end[k]} == derived


@pytest.mark.parametrize(
    "argv",
    [
        ["--global-batch-size", "0"],
        ["--micro-batch-size", "2", "--global-batch-size", "7"],
        ["--tensor-model-parallel-size", "2"],
        ["--train-samples", "0"],
        ["--bf16", "--fp16"],
        ["--split", "0,100,0"],
    ],
)
def test_validate_reads_only_when_it_raises(argv):
    cfg = parse_args(["--mock-data", "--vocab-size", "64", *argv]).resolve()
    before = copy.deepcopy(cfg)
    with pytest.raises(ValueError):
        cfg.validate()
    assert cfg == before


def test_validate_needs_a_resolved_config():
    with pytest.raises(AssertionError, match="resolve"):
        parse_args(["--mock-data", "--vocab-size", "64"]).validate()


def test_trainer_freezes_the_config_after_the_tokenizer(tiny_argv):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    trainer = build_trainer(tiny_argv("--train-iters 1"))
    try:
        cfg = trainer.cfg
        assert is_frozen(cfg) and cfg.model.vocab_size == 128
        cfg.model.finalize()  # model builders finalize again: a resolved config needs no write
        with pytest.raises(dataclasses.FrozenInstanceError, match=r"OptimizerConfig\.lr"):
            cfg.optimizer.lr = 1.0
        with pytest.raises(dataclasses.FrozenInstanceError, match=r"TransformerConfig\.vocab_size"):
            cfg.model.vocab_size = 256
        with pytest.raises(dataclasses.FrozenInstanceError, match=r"MoEConfig\.num_moe_experts"):
            cfg.model.moe.num_moe_experts = 2
        with pytest.raises(dataclasses.FrozenInstanceError, match=r"RunConfig\.training"):
            cfg.training = None
        with pytest.raises(dataclasses.FrozenInstanceError, match=r"ParallelConfig\.world_size"):
            del cfg.parallel.world_size
        copy_ = thawed_copy(cfg)
        copy_.optimizer.lr = 1.0
        assert copy_.optimizer.lr == 1.0 and cfg.optimizer.lr != 1.0 and not is_frozen(copy_)
        assert is_frozen(copy.deepcopy(cfg))  # a plain copy stays read-only
    finally:
        trainer.close()
        parallel_state.destroy(trainer.pg)

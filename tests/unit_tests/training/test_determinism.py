"""--deterministic-mode's environment (megatron/training/determinism.py), as Megatron checks it."""

import os

import pytest

from megatron.core import parallel_state
from megatron.training.determinism import apply_determinism_env
from megatron.training.training import build_trainer
from tests.conftest import TINY_GPT_FLAGS


def test_defaults_fill_what_the_launcher_left_unset():
    env = {}
    apply_determinism_env(env)
    assert env == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    env = {"NCCL_ALGO": "Ring,^NVLS", "CUBLAS_WORKSPACE_CONFIG": ":16:8", "MAMBA_DETERMINISTIC": "1"}
    apply_determinism_env(env)  # deterministic choices of the launcher are kept
    assert env["NCCL_ALGO"] == "Ring,^NVLS" and env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("NCCL_ALGO", "Tree", r"NCCL_ALGO='Tree' does not fix the summation order.*Unset it"),
        ("NCCL_ALGO", ",", r"NCCL_ALGO=','"),
        ("CUBLAS_WORKSPACE_CONFIG", ":0:0", r"CUBLAS_WORKSPACE_CONFIG=':0:0' is not a deterministic setting"),
        ("CAUSAL_CONV1D_DETERMINISTIC", "0", r"CAUSAL_CONV1D_DETERMINISTIC='0' turns off"),
    ],
)
def test_a_non_deterministic_launcher_setting_is_refused(name, value, match):
    env = {name: value}
    with pytest.raises(ValueError, match=match):
        apply_determinism_env(env)
    assert env == {name: value}  # nothing filled in after a refusal


def test_the_trainer_sets_the_environment_before_its_process_groups(monkeypatch):
    for name in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    trainer = build_trainer(f"{TINY_GPT_FLAGS} --deterministic-mode".split())
    try:
        assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        trainer.graphs.close()
        parallel_state.destroy(trainer.pg)
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(ValueError, match="NCCL_ALGO='Tree'"):
        build_trainer(f"{TINY_GPT_FLAGS} --deterministic-mode".split())

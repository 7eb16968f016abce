"""tools/leak_check.py: argument checks and the table on the CPU; the short leak check on a GPU."""

import pytest
import torch


@pytest.fixture
def leak(load_tool):
    return load_tool("leak_check")


def test_flags_per_family_and_scope(leak):
    assert leak.flags_for("dense", "").endswith("--cuda-graph-impl local --cuda-graph-scope")
    assert "--moe-pad-expert-input-to-capacity" in leak.flags_for("moe", "moe")
    assert "--moe-pad-expert-input-to-capacity" not in leak.flags_for("moe", "moe_router moe_preprocess")
    assert "--hybrid-layer-pattern" in leak.flags_for("hybrid", "mamba")


def test_iteration_bounds_are_checked(leak):
    with pytest.raises(SystemExit):
        leak.main(["--iters", "10", "--at", "10"])
    with pytest.raises(SystemExit):
        leak.main(["--iters", "10", "--at", "1"])


def test_table_shows_drift(leak):
    first = {"pool_reserved_bytes": 2**20, "pool_live_bytes": 0, "allocated_bytes": 5 * 2**20, "reserved_bytes": 0}
    last = dict(first, allocated_bytes=first["allocated_bytes"] + 512)
    row = {
        "family": "dense",
        "scope": "attn",
        "graphs": 8,
        "first": first,
        "last": last,
        "drift": {k: last[k] - first[k] for k in first},
        "seconds": 1.0,
        "at": 10,
        "iters": 1000,
    }
    text = leak.table([row])
    assert "dense   attn" in text and " 512 " in text and "after iteration 10 and 1000" in text


FAMILY_SCOPES = [("dense", ""), ("dense", "attn"), ("dense", "mlp")]
FAMILY_SCOPES += [("moe", "attn"), ("moe", "moe_router moe_preprocess"), ("moe", "moe")]
FAMILY_SCOPES += [("hybrid", "mamba"), ("hybrid", "attn"), ("hybrid", "mlp")]


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "scope"), FAMILY_SCOPES)
def test_no_drift_between_iteration_10_and_60(leak, family, scope):
    row = leak.check(family, scope, iters=60, at=10)
    assert row["graphs"] > 0
    for key in leak.LEAK_KEYS:
        assert row["drift"][key] == 0, f"{family} {scope or 'layer'}: {key} grew by {row['drift'][key]} bytes: {row}"
    torch.cuda.empty_cache()

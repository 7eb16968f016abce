"""tools/profile_host.py: flag overrides, and one short CPU run of the tiny MoE config."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))
import profile_host  # noqa: E402


def test_override_flags_replaces_values_switches_and_appends():
    flags = "--num-layers 8 --swiglu --hidden-size 1024 --bf16"
    out = profile_host.override_flags(flags, {"--hidden-size": "64", "--swiglu": "", "--seq-length": "32"})
    assert out.split() == ["--num-layers", "8", "--bf16", "--hidden-size", "64", "--swiglu", "--seq-length", "32"]


def test_tiny_moe_run_counts_one_host_sync_per_moe_layer(tmp_path):
    path = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "tools" / "profile_host.py"), "--config", "moe", "--tiny", "--device", "cpu"]
    cmd += ["--set", "num-layers=2", "--steps", "1", "--warmup", "1", "--top", "5", "--json", str(path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(path.read_text())
    assert "--hidden-size 64" in r["argv"] and "--num-layers 2" in r["argv"] and "--use-cpu" in r["argv"]
    assert "--bf16" not in r["argv"]
    ms = r["host_ms_per_step"]
    assert ms["forward"] > 0 and ms["backward"] > 0 and ms["optimizer"] > 0
    assert r["aten_ops_per_step"]["forward"] > 0 and r["aten_ops_per_step"]["backward"] > 0
    assert r["autograd_nodes_per_step"] > 0
    # The dropless dispatcher reads the split sizes once per MoE layer forward, never in backward.
    assert r["host_syncs_per_step"].get("forward") == 2 and "backward" not in r["host_syncs_per_step"]
    assert any("token_dispatcher.py" in site for site, _ in r["host_sync_sites"])
    assert r["cprofile"]["forward"]["cumulative"] and r["cprofile"]["backward"]["self"]
    assert "aten ops/step" in done.stdout

"""tools/bench_cuda_graphs.py: configs, plan, FLOPs, MFU; graph_bench's table and dry run (CPU)."""

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import bench_cuda_graphs as bcg  # noqa: E402
import graph_bench  # noqa: E402

from megatron.training.arguments import parse_args  # noqa: E402


def test_every_config_parses_with_every_mode_flag():
    for config, flags in bcg.CONFIGS.items():
        for mode in bcg.MODES[config]:
            argv = f"{flags} {graph_bench.COMMON} {graph_bench.mode_flags(mode)} {bcg.mode_extra(config, mode)}"
            cfg = parse_args(argv.split())
            impl = (
                "local"
                if mode.removeprefix(bcg.TORCH_SCAN).startswith(("local:", "noturn:", "turn:", "turns:", "scan32:"))
                else "full_iteration"
                if mode == "full"
                else "none"
            )
            assert cfg.cuda_graph.cuda_graph_impl == impl, (config, mode)
    medium = parse_args(f"{bcg.CONFIGS['medium']} {graph_bench.COMMON}".split())
    m = medium.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.seq_length) == (24, 2048, 8192, 4096)
    assert m.position_embedding_type == "rope" and m.gated_linear_unit and m.normalization == "RMSNorm"
    assert bcg.CONFIGS["launch"] == bcg.CONFIGS["launch16"]
    assert parse_args(f"{bcg.CONFIGS['moe']} {graph_bench.COMMON} {bcg.DROP_AND_PAD}".split()).moe.drop_and_pad


def test_turn_modes_run_their_child_with_the_eager_turns_set(monkeypatch, tmp_path):
    from megatron.core.ssm import ssd, ssd_kernels
    from megatron.core.transformer.cuda_graphs import turn

    # graph_bench spells the switches out (its parent imports no torch): the names the modules read.
    switches = (graph_bench.EAGER_TURN_SWITCH, graph_bench.TURN_SCAN_BUDGET, graph_bench.SSD_KERNELS_SWITCH)
    assert switches == (turn.ENV_SWITCH, ssd.TURN_BUDGET_ENV, ssd_kernels.ENV_SWITCH)
    seen = {}

    def call(cmd, stdout, stderr, env):
        seen[cmd[cmd.index("--mode") + 1]] = tuple(env.get(name) for name in switches)
        return 1  # a failed child: run_child prints its log's tail and returns None

    monkeypatch.setattr(graph_bench.subprocess, "call", call)
    for name in switches:
        monkeypatch.delenv(name, raising=False)
    args = types.SimpleNamespace(iters=5, skip=1, extra="")
    modes = (
        "local:attn",
        "noturn:attn",
        "turn:attn",
        "turns:attn",
        "scan32:attn",
        "torchscan:local:attn",
        "torchscan:scan32:attn",
    )
    for mode in modes:
        graph_bench.run_child("dense8", mode, args, str(tmp_path / mode.replace(":", "_")))
    assert seen == {
        "local:attn": (None, None, None),
        "noturn:attn": ("0", None, None),
        "turn:attn": ("1", None, None),
        "turns:attn": ("all", None, None),
        "scan32:attn": (None, "captured", None),
        "torchscan:local:attn": (None, None, "torch"),
        "torchscan:scan32:attn": (None, "captured", "torch"),
    }
    assert len({graph_bench.mode_flags(m) for m in modes}) == 1
    assert graph_bench.mode_flags("torchscan:eager") == ""
    assert bcg.baseline_mode("hybrid", "torchscan:local:mlp") == "torchscan:eager"


def test_plan_round_robin_filters_and_estimate():
    runs = bcg.plan(["moe", "dense8"], ["eager", "local:attn", "local:mlp"], repeat=2)
    assert runs[:5] == [
        (0, "moe", "eager"),
        (0, "moe", "local:attn"),
        (0, "dense8", "eager"),
        (0, "dense8", "local:attn"),
        (0, "dense8", "local:mlp"),
    ]
    assert len(runs) == 10 and runs[5] == (1, "moe", "eager")
    text = bcg.describe_plan(runs)
    assert text.startswith("10 runs (moe 4, dense8 6); about ")
    minutes = (4 * bcg.SECONDS_PER_RUN["moe"] + 6 * bcg.SECONDS_PER_RUN["dense8"]) / 60
    assert f"about {minutes:.1f} min" in text
    assert bcg.modes_for("moe") == bcg.MODES["moe"] and "mgc" not in bcg.MODES["moe"]
    assert bcg.baseline_mode("moe", "local:moe") == "eager:drop-and-pad"
    assert bcg.baseline_mode("dense8", "local:attn") == "eager"


def _cfg(flags):
    cfg = parse_args(f"{flags} {graph_bench.COMMON}".split()).resolve(world_size=1)
    cfg.validate()
    cfg.model.vocab_size = 32128
    return cfg


def test_moe_flops_count_top_k_experts_and_the_router():
    dense = _cfg(bcg.CONFIGS["dense8"] + " --swiglu --disable-bias-linear")
    moe = _cfg(bcg.CONFIGS["moe"])
    h, f, tokens, layers = 1024, 4096, 2 * 2048, 8
    mlp = 2 * h * 2 * f + 2 * f * h  # SwiGLU fc1 (gate and up) + fc2, per token
    extra = 3.0 * tokens * layers * (2 * mlp - mlp + 2 * h * 8)  # top-2 experts instead of one MLP, + router
    assert bcg.model_flops(moe) == pytest.approx(bcg.model_flops(dense) + extra)


def test_hybrid_flops_use_the_hybrid_count():
    from megatron.core.models.hybrid.hybrid_model import num_floating_point_operations

    cfg = _cfg(bcg.CONFIGS["hybrid"])
    want = num_floating_point_operations(cfg.model, cfg.mamba, 2, 2048, 32128)
    assert bcg.model_flops(cfg) == want


def _row(config, mode, ms, peak, baseline="eager", graphs=None):
    return {
        "config": config,
        "mode": mode,
        "baseline_mode": baseline,
        "ms_per_iter": ms,
        "pipelined_ms_per_iter": ms,
        "tflops_per_gpu": 200.0 * 10 / ms,
        "peak_device_bytes": peak,
        "steady_peak_device_bytes": peak,
        "losses": [1.0],
        "graphs": graphs or {},
    }


def test_table_mfu_capture_and_drop_and_pad_baseline():
    rows = [
        _row("moe", "eager", 10.0, 2**30),
        _row("moe", "eager:drop-and-pad", 20.0, 2 * 2**30),
        _row("moe", "local:moe", 10.0, 2 * 2**30, "eager:drop-and-pad", {"capture_seconds": 1.5, "graphs": 18}),
    ]
    bcg.add_mfu(rows, 800.0)
    assert rows[0]["mfu"] == 0.25
    lines = graph_bench.table(rows).splitlines()
    graphed = next(line for line in lines if " local:moe " in line)
    cols = graphed.split()
    assert cols[3] == "0.500"  # against eager:drop-and-pad (20 ms), not eager
    assert "+0.00%" in graphed and "25.0%" in graphed and "1.50" in graphed
    assert any(line.startswith("MFU: TFLOP/s per GPU / 800 TFLOP/s") for line in lines)
    bcg.add_mfu(rows, None)
    assert rows[0]["mfu"] is None and "MFU: " not in graph_bench.table(rows)


def test_dry_run_prints_the_plan(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["graph_bench.py", "--configs", "moe", "--dry-run", "--out", str(tmp_path)])
    monkeypatch.setattr(graph_bench, "run_child", lambda *a: pytest.fail("a dry run runs nothing"))
    graph_bench.main()
    out = capsys.readouterr().out
    assert out.startswith(f"{len(bcg.MODES['moe'])} runs (moe {len(bcg.MODES['moe'])})")
    assert "  moe local:moe" in out and not list(tmp_path.iterdir())

"""tools/two_gpu_run.py --gpus 4 on the CPU: the four-GPU table's plan, its two-"node" launch
(commands, GPUs per launcher, rank-to-GPU map), several launchers of one job killed together,
the driver's memory peaks for ranks without a memory line, and the table run with --cpu-smoke
on four gloo processes (the two-"node" c10d launch included)."""

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import two_gpu_plan  # noqa: E402
import two_gpu_proc  # noqa: E402
import two_gpu_run  # noqa: E402

from tests.unit_tests.tools.test_two_gpu_run import _gone  # noqa: E402

RUNS4 = {r.name: r for r in two_gpu_plan.all_runs(4)}
GPU = two_gpu_plan.GPU


def test_the_four_gpu_table_and_its_order():
    assert list(RUNS4) == [
        "tp2pp2vpp2_eager",
        "tp2pp2vpp2_layer",
        "tp2pp2vpp2_attn_mlp",
        "ep4_eager",
        "ep4_attn_router_pre",
        "tp2pp2vpp2_2node_eager",
        "tp2pp2vpp2_2node_attn_mlp",
    ]
    assert all(r.nproc == 4 for r in RUNS4.values())
    assert [r.nodes for r in RUNS4.values()] == [1, 1, 1, 1, 1, 2, 2]
    # The two-"node" runs are held to the one-launcher eager run of the same layout.
    assert {RUNS4[n].eager_ref for n in ("tp2pp2vpp2_2node_eager", "tp2pp2vpp2_2node_attn_mlp")} == {"tp2pp2vpp2_eager"}
    assert RUNS4["tp2pp2vpp2_2node_eager"].layout == RUNS4["tp2pp2vpp2_eager"].layout
    assert RUNS4["tp2pp2vpp2_2node_eager"].describe() == "TP=2 PP=2 VPP=2 DistOpt (2 nodes x 2) eager"
    # The two-GPU table is unchanged, and asking for another size names the choices.
    assert [r.name for r in two_gpu_plan.all_runs()] == [r.name for r in two_gpu_plan.all_runs(2)]
    assert all(r.nodes == 1 and r.microbatches is None for r in two_gpu_plan.all_runs(2))
    with pytest.raises(ValueError, match="--gpus: 3 has no table; choose 2 or 4"):
        two_gpu_plan.all_runs(3)


def test_four_gpu_graph_bounds():
    # TP=2 x PP=2: ranks 0, 1 are stage 0 (2 chunks x 2 layers, 5 micro-batches in flight),
    # ranks 2, 3 the last stage (4 layers + the head, 3 in flight): as PP=2 x VPP=2 on two GPUs.
    for name in ("tp2pp2vpp2_layer", "tp2pp2vpp2_attn_mlp", "tp2pp2vpp2_2node_attn_mlp"):
        assert [two_gpu_plan.graph_bound(RUNS4[name], GPU, r) for r in range(4)] == [40, 40, 30, 30], name
    # EP=4, no pipeline: 4 layers x 4 regions (head eager), one micro-batch in flight.
    assert [two_gpu_plan.graph_bound(RUNS4["ep4_attn_router_pre"], GPU, r) for r in range(4)] == [32] * 4
    assert two_gpu_plan.graph_bound(RUNS4["tp2pp2vpp2_2node_eager"], GPU, 0) is None


@pytest.mark.parametrize("sizes", [two_gpu_plan.GPU, two_gpu_plan.SMOKE], ids=["h200_sizes", "smoke_sizes"])
def test_every_four_gpu_run_is_a_valid_command_line_and_the_plan_matches_the_trainers_config(sizes):
    """At world size 4 the flags pass the trainer's validation, and what the graph bound
    assumes (layout, micro-batches per rank, regions per layer, head) is the trainer's."""
    from megatron.core.transformer.cuda_graphs import regions
    from megatron.core.transformer.moe.moe_layer import MoETransformerLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training.arguments import parse_args

    for spec in RUNS4.values():
        argv = two_gpu_plan.argv(spec, sizes, 30, metrics_file="m.jsonl", ckpt_dir="ckpt")
        cfg = parse_args(argv).resolve(world_size=4)
        cfg.validate()
        par = cfg.parallel
        assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size) == (spec.tp, spec.pp), spec.name
        assert par.data_parallel_size == spec.dp, spec.name
        assert cfg.num_microbatches == two_gpu_plan.microbatches(spec, sizes), spec.name
        if spec.model == "dense":
            assert cfg.num_microbatches == 8 and cfg.ddp.use_distributed_optimizer, spec.name
            assert par.virtual_pipeline_model_parallel_size == 2, spec.name
        else:
            assert par.expert_model_parallel_size == 4 and cfg.num_microbatches == 2, spec.name
        if spec.graphed:
            layer = TransformerLayer if spec.model == "dense" else MoETransformerLayer
            chosen = regions.resolve(cfg.cuda_graph.cuda_graph_scope, [layer], cfg.model)[layer]
            assert two_gpu_plan.SCOPE_REGIONS[(spec.model, spec.scope)] == (
                len(chosen),
                regions.head_follows(chosen, layer),
            ), spec.name


def test_reporting_ranks():
    """Data-parallel rank 0 prints the memory line; the last rank writes the metrics file."""
    assert two_gpu_plan.reporting_ranks(RUNS4["tp2pp2vpp2_layer"]) == {0, 1, 2, 3}  # DP=1
    assert two_gpu_plan.reporting_ranks(RUNS4["ep4_attn_router_pre"]) == {0, 3}  # DP=4
    assert all(two_gpu_plan.reporting_ranks(r) == set(range(r.nproc)) for r in two_gpu_plan.all_runs(2))


def test_two_node_commands_each_launcher_sees_its_own_gpus():
    spec = RUNS4["tp2pp2vpp2_2node_eager"]
    env = {"PATH": "/bin"}
    jobs = two_gpu_run.commands(spec, GPU, 30, "out", "ckpt", env)
    assert len(jobs) == 2
    endpoints, ids = set(), set()
    for node, (cmd, node_env) in enumerate(jobs):
        flags = cmd[cmd.index("torch.distributed.run") + 1 : cmd.index("pretrain_gpt.py")]
        assert flags[:6] == ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node)]
        assert flags[flags.index("--rdzv-backend") + 1] == "c10d"
        endpoints.add(flags[flags.index("--rdzv-endpoint") + 1])
        ids.add(flags[flags.index("--rdzv-id") + 1])
        assert flags[flags.index("--rdzv-conf") + 1] == f"is_host={int(node == 0)}"
        assert node_env["CUDA_VISIBLE_DEVICES"] == ["0,1", "2,3"][node]
        assert node_env["PATH"] == "/bin"
    assert len(endpoints) == 1 and endpoints.pop().startswith("127.0.0.1:") and len(ids) == 1
    assert "CUDA_VISIBLE_DEVICES" not in env
    # Within GPUs this process was given; on the CPU no launcher sees a GPU.
    jobs = two_gpu_run.commands(spec, GPU, 30, "out", "ckpt", {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [e["CUDA_VISIBLE_DEVICES"] for _, e in jobs] == ["4,5", "6,7"]
    jobs = two_gpu_run.commands(spec, GPU, 30, "out", "ckpt", {"CUDA_VISIBLE_DEVICES": ""})
    assert [e["CUDA_VISIBLE_DEVICES"] for _, e in jobs] == ["", ""]
    # One launcher: --standalone, the environment as given.
    (cmd, one_env), *rest = two_gpu_run.commands(RUNS4["ep4_eager"], GPU, 30, "out", "ckpt", env)
    assert not rest and one_env is env
    assert cmd[cmd.index("torch.distributed.run") + 1 : cmd.index("pretrain_gpt.py")] == [
        "--standalone",
        "--nproc-per-node",
        "4",
    ]
    assert cmd[cmd.index("--global-batch-size") + 1] == "16"  # micro batch 2 x DP 4 x 2 micro-batches


def test_table_env_only_for_four_gpus(monkeypatch):
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    assert two_gpu_run._env(False, 4)["NCCL_ALGO"] == "Ring"
    assert "NCCL_ALGO" not in two_gpu_run._env(False, 2)
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # a value already set is kept
    assert two_gpu_run._env(False, 4)["NCCL_ALGO"] == "Tree"


def test_rank_to_gpu_map():
    assert two_gpu_proc.rank_gpus(4, None) == [0, 1, 2, 3]
    assert two_gpu_proc.rank_gpus(2, "3,1") == [3, 1]
    # c10d numbers the launchers by process id: the lower one holds ranks 0 and 1.
    assert two_gpu_proc.rank_gpus(4, None, [50, 100]) == [0, 1, 2, 3]
    assert two_gpu_proc.rank_gpus(4, None, [100, 50]) == [2, 3, 0, 1]
    assert two_gpu_proc.rank_gpus(4, "4,5,6,7", [100, 50]) == [6, 7, 4, 5]
    assert two_gpu_proc.node_devices(1, 2, None) == "2,3"


def test_memory_poller_keeps_each_gpus_peak():
    samples = iter([{0: 100.0, 1: 50.0}, {0: 300.0, 1: 40.0}, {0: 200.0, 1: 60.0}])
    last = {0: 10.0, 1: 10.0}
    poller = two_gpu_proc.MemoryPoller(lambda: next(samples, last), interval_s=0.001)
    with poller:
        deadline = time.monotonic() + 10
        while poller.peaks != {0: 300.0, 1: 60.0} and time.monotonic() < deadline:
            time.sleep(0.01)
    assert poller.peaks == {0: 300.0, 1: 60.0}
    with two_gpu_proc.MemoryPoller(None) as idle:  # no NVML: nothing polled
        pass
    assert idle.peaks == {}


# A launcher: starts a worker in a session of its own (as torchrun does), prints a line,
# then exits with the given code after a second, or sleeps.
LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open(sys.argv[1], "w").write(str(child.pid))
    print(sys.argv[2], flush=True)
    if sys.argv[3] != "sleep":
        time.sleep(1.0)
        sys.exit(int(sys.argv[3]))
    time.sleep(600)
    """
)
LAST_LINE = " [2026-12-04 12:25:37.092884] iteration        3/       3 | consumed samples: 8 | lm loss: 5.5E+00 |"


def _launchers(tmp_path, tag, *how):
    pid_files = [tmp_path / f"{tag}_{i}.pid" for i in range(len(how))]
    line = ["quiet", LAST_LINE]
    cmds = [[sys.executable, "-c", LAUNCHER, str(f), line[i == 0], h] for i, (f, h) in enumerate(zip(pid_files, how))]
    return cmds, pid_files


def test_two_launchers_of_one_job_are_watched_and_killed_together(tmp_path):
    # One launcher fails while the other waits (as a node whose peer died would): failed at once.
    cmds, pids = _launchers(tmp_path, "fail", "sleep", "3")
    outcome = two_gpu_proc.run_commands(cmds, str(tmp_path / "fail.log"), timeout_s=60, hang_grace_s=30)
    assert (outcome.status, outcome.rc) == ("failed", 3) and outcome.wall_s < 30
    assert len(outcome.pids) == 2
    assert all(_gone(int(p.read_text())) for p in pids), "a worker of either launcher survived"
    # Both print and one does not exit after the last iteration: hung, both trees killed.
    cmds, pids = _launchers(tmp_path, "hung", "0", "sleep")
    outcome = two_gpu_proc.run_commands(cmds, str(tmp_path / "hung.log"), timeout_s=60, hang_grace_s=2.0)
    assert (outcome.status, outcome.rc, outcome.last_iteration) == ("hung", None, 3)
    assert all(_gone(int(p.read_text())) for p in pids)
    # Both exit 0: ok once the last one has; their workers are still cleaned up.
    cmds, pids = _launchers(tmp_path, "ok", "0", "0")
    outcome = two_gpu_proc.run_commands(cmds, str(tmp_path / "ok.log"), timeout_s=60, hang_grace_s=30)
    assert (outcome.status, outcome.rc) == ("ok", 0)
    assert all(_gone(int(p.read_text())) for p in pids)
    # One log for both (unbuffered, a print may reach it in two writes: count, not lines).
    assert (tmp_path / "ok.log").read_text().count("quiet") == 1


def _row(name, losses, ranks, nvml=None, ms=50.0):
    return {
        "name": name,
        "what": name,
        "status": "ok",
        "nproc": 4,
        "last_iteration": max(losses),
        "losses": {str(k): v for k, v in losses.items()},
        "ms_per_iter": ms,
        "ranks": ranks,
        "nvml_peak_mb": nvml or {},
        "wall_s": 30.0,
    }


def test_ep4_checks_use_the_ranks_the_trainer_reports_and_the_drivers_peaks_for_the_others():
    losses = {1: 10.0, 2: 9.0, 3: 8.0}
    nvml = lambda base: {str(r): base + 100.0 * r for r in range(4)}  # noqa: E731
    eager = _row("ep4_eager", losses, {"0": {"max_reserved_mb": 2048.0}, "3": {"max_reserved_mb": 4096.0}}, nvml(3000))
    rows = {"ep4_eager": eager}
    graphed = lambda r0: {"max_reserved_mb": r0, "graphs": 32, "pool_reserved_mb": 100.0}  # noqa: E731
    good = _row("ep4_attn_router_pre", losses, {"0": graphed(2150.4), "3": graphed(4096.0)}, nvml(3300), ms=40.0)
    two_gpu_run.compare(RUNS4["ep4_attn_router_pre"], good, rows, GPU, 3)
    assert good["verdict"] == "ok", good["problems"]
    mem = good["checks"]["memory_vs_eager"]
    assert mem["0"] == pytest.approx(0.05) and mem["3"] == 0.0  # the allocator's, where printed
    assert mem["1"] == pytest.approx(300 / 3100) and mem["2"] == pytest.approx(300 / 3200)  # the driver's
    assert good["checks"]["memory_vs_eager_from_nvml"] == ["1", "2"]
    assert [g["graphs"] for g in good["checks"]["graphs"].values()] == [32, None, None, 32]
    # A reporting rank without a count, or over its bound, is a problem.
    bad = _row("ep4_attn_router_pre", losses, {"0": {"max_reserved_mb": 2048.0}, "3": dict(graphed(1.0), graphs=33)})
    two_gpu_run.compare(RUNS4["ep4_attn_router_pre"], bad, rows, GPU, 3)
    assert bad["problems"] == ["rank 0: no graph count reported", "rank 3: 33 graphs > bound 32"]
    table = two_gpu_run.table([eager, good])
    assert "| peak GiB r0/r1/r2/r3 | mem vs eager r0/r1/r2/r3 | graphs r0/r1/r2/r3 (bound) |" in table
    assert "| 2.10/3.32*/3.42*/4.00 | +5.0%/+9.7%*/+9.4%*/+0.0% | 32/-/-/32 (32/32/32/32) |" in table
    assert table.splitlines()[-1].startswith("*: the driver's peak of the rank's GPU")
    assert (
        table.splitlines()[-2]
        == "graphs -: the trainer reports no count for data-parallel ranks > 0 other than the last."
    )
    # The two-GPU table's header is as it was.
    assert "| peak GiB r0/r1 | mem vs eager r0/r1 |" in two_gpu_run.table([dict(eager, nproc=2, nvml_peak_mb={})])


def test_four_gpu_runs_that_do_not_fit_the_budget_are_skipped(tmp_path, capsys):
    out = tmp_path / "out"
    rc = two_gpu_run.main(["--gpus", "4", "--cpu-smoke", "--out", str(out), "--budget-s", "1"])
    runs = json.loads((out / "four_gpu.json").read_text())["runs"]
    assert rc == 1 and [r["name"] for r in runs] == list(RUNS4)
    assert all(r["status"] == "skipped" and r["verdict"].startswith("time budget") for r in runs)
    assert not (out / "two_gpu.json").exists()
    printed = capsys.readouterr().out
    assert printed.startswith("four-GPU validation (smoke sizes, 4 iterations per run):")


@pytest.mark.slow
def test_four_gpu_cpu_smoke_subset(tmp_path, capsys):
    """TP=2 x PP=2 x VPP=2 (distributed optimizer) eager and `attn mlp`, the same eager job as
    two c10d launchers of two gloo processes each, and MoE EP=4 eager: 3 iterations each,
    every check passes and the two-"node" losses equal the one-launcher run's bit for bit."""
    out = tmp_path / "out"
    names = ["tp2pp2vpp2_eager", "tp2pp2vpp2_attn_mlp", "ep4_eager", "tp2pp2vpp2_2node_eager"]  # table order
    rc = two_gpu_run.main(["--gpus", "4", "--cpu-smoke", "--out", str(out), "--iters", "3", "--only", *names])
    printed = capsys.readouterr().out
    runs = {r["name"]: r for r in json.loads((out / "four_gpu.json").read_text())["runs"]}
    assert rc == 0, printed
    assert list(runs) == names
    assert all(r["verdict"] == "ok" for r in runs.values()), printed
    assert all(len(r["losses"]) == 3 and r["loss_source"] == "metrics file" for r in runs.values())
    for name in ("tp2pp2vpp2_attn_mlp", "tp2pp2vpp2_2node_eager"):
        assert runs[name]["checks"]["vs_eager"]["bitwise"], name
    log = (out / "tp2pp2vpp2_2node_eager.log").read_text()
    assert log.count("--rdzv-backend c10d") == 2 and "--node-rank 1" in log
    assert "| tp2pp2vpp2_2node_eager | TP=2 PP=2 VPP=2 DistOpt (2 nodes x 2) eager | ok | 3 | bitwise |" in printed
    assert printed.splitlines()[-2].startswith('two-"node" runs: loss vs eager against the one-launcher eager run')


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_four_gpu_subset_reports_every_rank(tmp_path, capsys):
    """On four GPUs, 6 iterations: TP=2 x PP=2 x VPP=2 eager and `attn mlp`, MoE EP=4 eager and
    `attn moe_router moe_preprocess`, and the eager job as two launchers of two GPUs. Graphed
    and two-"node" losses equal eager's bit for bit; every rank has a peak (the driver's for
    EP=4's ranks 1 and 2) and every reporting rank a graph count within its bound."""
    out = tmp_path / "out"
    names = ["tp2pp2vpp2_eager", "tp2pp2vpp2_attn_mlp", "ep4_eager", "ep4_attn_router_pre", "tp2pp2vpp2_2node_eager"]
    rc = two_gpu_run.main(["--gpus", "4", "--out", str(out), "--iters", "6", "--only", *names])
    printed = capsys.readouterr().out
    runs = {r["name"]: r for r in json.loads((out / "four_gpu.json").read_text())["runs"]}
    assert rc == 0, printed
    for name in names:
        peaks = {r for r, m in runs[name]["ranks"].items() if m["max_reserved_mb"] > 0}
        assert peaks | set(runs[name].get("nvml_peak_mb", {})) == {"0", "1", "2", "3"}, (name, printed)
    assert set(runs["tp2pp2vpp2_attn_mlp"]["ranks"]) == {"0", "1", "2", "3"}  # DP=1: every rank prints
    for name in ("tp2pp2vpp2_attn_mlp", "ep4_attn_router_pre", "tp2pp2vpp2_2node_eager"):
        assert runs[name]["checks"]["vs_eager"]["bitwise"], name
    for name in ("tp2pp2vpp2_attn_mlp", "ep4_attn_router_pre"):
        counted = [g for g in runs[name]["checks"]["graphs"].values() if g["graphs"] is not None]
        assert counted and all(0 < g["graphs"] <= g["bound"] for g in counted), name

"""CUDA graph memory per layer and region for a training command line.

Takes the flags of ``pretrain_gpt.py`` (or of ``pretrain_hybrid.py``: a command line with
``--hybrid-layer-pattern`` builds the hybrid model). On a GPU it trains ``--iters``
iterations (iteration 1 records and captures), then prints, per region, the analytic
activation budget (what eager keeps for backward), static input/output bytes, the
pool's growth at the region's captures, bytes held strongly and released through weak
references; per layer, eager against graphed memory; and the pool's reserved and live
bytes from an allocator snapshot filtered by the pool id. Without CUDA it reports the
analytic side only (eager-only, with the CUDA kernels' accounting) and says so.

Usage:
    python tools/cuda_graph_memory_report.py [--json R.json] [--png R.png] [--check] -- \\
        --num-layers 8 --hidden-size 1024 ... --cuda-graph-impl local --cuda-graph-scope attn
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.core.transformer.cuda_graphs import budgets  # noqa: E402
from megatron.core.transformer.cuda_graphs import report as report_lib  # noqa: E402
from megatron.core.transformer.cuda_graphs.activations import Kernels  # noqa: E402

CPU_NOTE = (
    "No CUDA device: eager-only report. Budgets are analytic, with the CUDA kernels' accounting "
    "(fp32 LayerNorm statistics, fused RMSNorm and cross entropy, flash attention); nothing was captured."
)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the report here as JSON")
    parser.add_argument("--png", help="write a bar chart of eager vs graphed memory per layer here")
    parser.add_argument("--iters", type=int, default=3, help="training iterations on a GPU (>= 2: record, replay)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a region is over its analytic budget")
    parser.add_argument("--tolerance", type=float, default=0.10, help="relative allowance on pool growth (--check)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="the training flags, after --")
    args = parser.parse_args(argv)
    train = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if not train:
        parser.error("give the training flags after --")
    if args.iters < 2:
        parser.error("--iters must be >= 2 (iteration 1 records and captures)")
    return args, train


def _providers(train_args):
    """(model_provider, forward_step) of pretrain_hybrid.py or pretrain_gpt.py."""
    if "--hybrid-layer-pattern" in " ".join(train_args):
        import pretrain_hybrid as script
    else:
        import pretrain_gpt as script
    return script.model_provider, script.forward_step


def analytic_config(train_args):
    """The validated ``RunConfig`` of a command line, without building anything."""
    from megatron.core import parallel_state
    from megatron.training.arguments import parse_args
    from megatron.training.data import setup_tokenizer

    cfg = parse_args(list(train_args)).resolve(parallel_state.world_size_from_env())
    pg = parallel_state.initialize(cfg.parallel, use_cuda=False)
    try:
        cfg.validate()
        setup_tokenizer(cfg, pg)
    finally:
        parallel_state.destroy(pg)
    return cfg


def cpu_report(train_args) -> report_lib.MemoryReport:
    cfg = analytic_config(train_args)
    kernels = Kernels(fused_cross_entropy=cfg.model.cross_entropy_loss_fusion)
    if cfg.mamba.hybrid_layer_pattern is not None:
        from megatron.core.ssm.mamba_mixer import HAVE_MAMBA_SSM

        kernels = Kernels(fused_cross_entropy=cfg.model.cross_entropy_loss_fusion, fused_mamba=HAVE_MAMBA_SSM)
    return report_lib.eager_report(cfg, kernels, train_args, CPU_NOTE)


def gpu_report(train_args, iters: int) -> report_lib.MemoryReport:
    from megatron.core import parallel_state
    from megatron.core.ssm.mamba_mixer import HAVE_MAMBA_SSM
    from megatron.training.data import build_data_iterators
    from megatron.training.training import build_trainer

    model_provider, forward_step = _providers(train_args)
    argv = list(train_args)
    if "--train-iters" not in argv:
        argv += ["--train-iters", str(iters + 1)]
    trainer = build_trainer(argv, model_provider, forward_step)
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
        trainer.model.train()
        for _ in range(iters):
            trainer.train_step(it)
        torch.cuda.synchronize()
        cfg = trainer.cfg
        hybrid = cfg.mamba.hybrid_layer_pattern is not None
        kernels = Kernels.probe(
            trainer.device,
            cross_entropy_fusion=cfg.model.cross_entropy_loss_fusion,
            fused_mamba=hybrid and HAVE_MAMBA_SSM,
        )
        peak = torch.cuda.max_memory_allocated()
        if not trainer.graphs.captured:
            report = report_lib.eager_report(cfg, kernels, train_args, "No graphs captured (--cuda-graph-impl none?).")
        else:
            report = report_lib.graphed_report(trainer.graphs, cfg, kernels, train_args)
        report.totals["max_allocated_bytes"] = int(peak)
        return report
    finally:
        parallel_state.destroy(trainer.pg)


def main(argv=None) -> int:
    args, train = parse(argv)
    report = gpu_report(train, args.iters) if torch.cuda.is_available() else cpu_report(train)
    print(report_lib.format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json() + "\n")
    if args.png:
        report_lib.plot_layers(report, args.png)
    if args.check:
        if report.mode != "graphed":
            print("--check: nothing was captured, so there is no graph memory to check.", file=sys.stderr)
            return 1
        try:
            budgets.check_budgets(report, tolerance=args.tolerance)
        except budgets.BudgetExceeded as err:
            print(err, file=sys.stderr)
            return 1
        print("every region within its analytic budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())

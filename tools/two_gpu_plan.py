"""What the two- and four-GPU validation runs run: models, layouts, graph scopes, order, time, bounds.

``two_gpu_run.py`` launches the runs and prints the table; this file says what they are.
Two tables (``all_runs(gpus)``): the two-GPU one (TP=2 with sequence parallelism, PP=2,
PP=2 x VPP=2, the one-GPU reference of the dense model, EP=2, checkpoints) and the
four-GPU one (TP=2 x PP=2 x VPP=2 with the distributed optimizer, EP=4, and the
TP=2 x PP=2 x VPP=2 job launched as two torchrun "nodes" of two GPUs on the one host).
Runs are listed most important first, so a time budget that runs out drops the least
important ones. Each run names the eager run of its own layout (its
losses must equal it bit for bit in ``--deterministic-mode``; a two-"node" run names the
one-launcher eager run) and, for the dense model of the two-GPU table, the one-GPU eager
run of the same global batch (equal within a stated tolerance: another layout sums in
another order).

Two size sets: ``GPU`` (the issue's 8-layer GPT, hidden 1024, seq 2048, bf16, and a
4-layer MoE GPT scaled from the MoE benchmark config so the whole table fits ten minutes)
and ``SMOKE`` (tiny fp32 models for two or four gloo CPU processes, where the graph flags
are accepted and the runs are eager).
"""

from __future__ import annotations

import dataclasses

COMMON = (
    "--lr 1e-4 --lr-decay-style constant --seed 1234 --tokenizer-type NullTokenizer --mock-data "
    "--num-workers 0 --log-interval 1 --attention-dropout 0.0 --hidden-dropout 0.0 --deterministic-mode"
)
DROP_AND_PAD = "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity"
MOE_FLAGS = "--moe-router-topk 2 --moe-token-dispatcher-type alltoall --swiglu --disable-bias-linear"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """One size set of the table's two models.

    Attributes:
        name: ``"gpu"`` or ``"smoke"``.
        dense: Model flags of the dense GPT (8 micro-batches per global batch at DP=1).
        moe: Model flags of the MoE GPT (without the parallel layout).
        precision: ``--bf16`` or empty (fp32).
        layout_rtol: Largest relative loss difference accepted between two layouts of one
            model (another layout reduces in another order).
        startup_s: Rough seconds a run takes besides its iterations (launch, build, exit).
        dense_iter_s, moe_iter_s: Rough seconds per iteration.
        hang_grace_s: Seconds a run may take to exit after its last iteration's line (a
            save run: 30 s more, for the save).
        stall_s: Seconds a run may go without a new iteration line before its last one.
    """

    name: str
    dense: str
    moe: str
    precision: str
    layout_rtol: float
    startup_s: float
    dense_iter_s: float
    moe_iter_s: float
    hang_grace_s: float
    stall_s: float

    def layers(self, model: str) -> int:
        flags = (self.dense if model == "dense" else self.moe).split()
        return int(flags[flags.index("--num-layers") + 1])

    def microbatches_per_rank(self, model: str, dp: int) -> int:
        flags = (self.dense if model == "dense" else self.moe).split()
        micro = int(flags[flags.index("--micro-batch-size") + 1])
        glob = int(flags[flags.index("--global-batch-size") + 1])
        return glob // (micro * dp)


GPU = Sizes(
    name="gpu",
    dense="--num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 16 --vocab-size 32000",
    # The MoE benchmark config (tools/bench_cuda_graphs.py) with 4 layers instead of 8 and
    # two micro-batches per rank (EP=2 takes its ranks from DP=2).
    moe="--num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 8 --vocab-size 32000 "
    f"--num-experts 8 {MOE_FLAGS}",
    precision="--bf16",
    # bf16 keeps 8 significant bits (a rounding step of 2**-8 = 3.9e-3 relative per op);
    # the loss is a mean over 65536 tokens, so layouts differ far less, but the difference
    # grows over 30 steps of training. 1e-2 relative is the bound accepted here.
    layout_rtol=1e-2,
    startup_s=25.0,
    dense_iter_s=0.12,
    moe_iter_s=0.2,
    hang_grace_s=20.0,
    stall_s=60.0,
)

SMOKE = Sizes(
    name="smoke",
    dense="--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 --vocab-size 256",
    moe="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 "
    f"--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 --vocab-size 256 --num-experts 4 {MOE_FLAGS}",
    precision="",
    layout_rtol=1e-5,  # fp32 on the CPU: the project's parity bound across layouts
    startup_s=15.0,
    dense_iter_s=0.5,
    moe_iter_s=0.5,
    hang_grace_s=30.0,
    stall_s=60.0,
)

# (model, --cuda-graph-scope) -> (graphed regions per layer, whether the loss head is graphed).
# Whole layers and ``attn mlp`` are one layer graph, and the head follows it; the MoE
# ``attn moe_router moe_preprocess`` graphs attention, router, permutation and the
# postprocess (four regions; experts eager, so the head stays eager); ``moe`` graphs the
# block (drop-and-pad) and the head follows it.
SCOPE_REGIONS = {
    ("dense", ""): (1, True),
    ("dense", "attn mlp"): (1, True),
    ("moe", "attn moe_router moe_preprocess"): (4, False),
    ("moe", "moe"): (1, True),
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of the table.

    Attributes:
        name: Short name; its log is ``<out>/<name>.log``.
        model: ``"dense"`` or ``"moe"``.
        nproc: Processes (GPUs).
        layout: Parallel layout flags.
        scope: None for eager, else the ``--cuda-graph-scope`` value ("" = whole layers).
        impl: ``--cuda-graph-impl`` of a graphed run: ``local`` (partial graphs, ``scope``)
            or ``full_iteration`` (one graph per iteration, ``scope`` "").
        extra: More flags (drop-and-pad).
        eager_ref: The eager run of the same layout (graphed runs), or None.
        one_gpu_ref: The one-GPU eager run of the same model and global batch, or None.
        kind: ``"train"``, ``"save"`` (trains ``save_at`` iterations and saves) or
            ``"load"`` (loads the save run's checkpoint and trains on to the end).
        tp, pp, vpp, dp: The layout's sizes.
        label: The layout in words, for the table.
        microbatches: Micro-batches per rank (the global batch becomes micro batch x DP x
            this), or None for the size set's global batch.
        nodes: torchrun launchers of ``nproc // nodes`` processes each, joined by a c10d
            rendezvous on this host (1: one ``--standalone`` launcher).
    """

    name: str
    model: str
    nproc: int
    layout: str
    scope: str | None = None
    impl: str = "local"
    extra: str = ""
    eager_ref: str | None = None
    one_gpu_ref: str | None = None
    kind: str = "train"
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    label: str = "1 GPU"
    microbatches: int | None = None
    nodes: int = 1

    @property
    def graphed(self) -> bool:
        return self.scope is not None

    def describe(self) -> str:
        if self.scope is None:
            mode = "eager"
        elif self.impl == "full_iteration":
            mode = "full iteration"
        elif self.scope == "":
            mode = "whole layer"
        else:
            mode = f"`{self.scope}`"
        kind = {"save": " save", "load": " load"}.get(self.kind, "")
        nodes = f" ({self.nodes} nodes x {self.nproc // self.nodes})" if self.nodes > 1 else ""
        return f"{self.label}{nodes}{kind} {'drop-and-pad ' if self.extra else ''}{mode}"


TP2_SP = "--tensor-model-parallel-size 2 --sequence-parallel"
PP2 = "--pipeline-model-parallel-size 2"
PP2_VPP2 = "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"
EP2 = "--expert-model-parallel-size 2"
SAVE_RUN = "ckpt_save_tp2"


def _dense_group(prefix: str, layout: str, **sizes) -> list[RunSpec]:
    eager = RunSpec(f"{prefix}_eager", "dense", 2, layout, one_gpu_ref="gpu1_eager", **sizes)
    return [
        eager,
        dataclasses.replace(eager, name=f"{prefix}_layer", scope="", eager_ref=eager.name),
        dataclasses.replace(eager, name=f"{prefix}_attn_mlp", scope="attn mlp", eager_ref=eager.name),
    ]


def all_runs(gpus: int = 2) -> list[RunSpec]:
    """Every run of the ``gpus``-GPU table (2 or 4), most important first."""
    if gpus == 4:
        return four_gpu_runs()
    if gpus != 2:
        raise ValueError(f"--gpus: {gpus} has no table; choose 2 or 4")
    runs = _dense_group("tp2sp", TP2_SP, tp=2, label="TP=2 SP")
    runs += _dense_group("pp2", PP2, pp=2, label="PP=2")
    runs += _dense_group("pp2vpp2", PP2_VPP2, pp=2, vpp=2, label="PP=2 VPP=2")
    runs.append(RunSpec("gpu1_eager", "dense", 1, ""))
    ep = dict(model="moe", nproc=2, layout=EP2, dp=2, label="MoE EP=2")
    runs += [
        RunSpec("ep2_eager", **ep),
        RunSpec("ep2_attn_router_pre", scope="attn moe_router moe_preprocess", eager_ref="ep2_eager", **ep),
        RunSpec("ep2_dp_eager", extra=DROP_AND_PAD, **ep),
        RunSpec("ep2_dp_moe", scope="moe", extra=DROP_AND_PAD, eager_ref="ep2_dp_eager", **ep),
    ]
    # The save run trains the first third at TP=2 + SP and saves (torch_dist); it must
    # equal tp2sp_eager bit for bit there. The loads train on from it at other layouts
    # and are held to tp2sp_eager's later iterations within the layout tolerance.
    runs += [
        RunSpec(SAVE_RUN, "dense", 2, TP2_SP, kind="save", eager_ref="tp2sp_eager", tp=2, label="TP=2 SP"),
        RunSpec("ckpt_load_tp1", "dense", 2, "", kind="load", eager_ref="tp2sp_eager", dp=2, label="TP=1 DP=2"),
        RunSpec("ckpt_load_pp2", "dense", 2, PP2, kind="load", eager_ref="tp2sp_eager", pp=2, label="PP=2"),
        # The whole iteration as one graph, the TP collectives captured in it.
        RunSpec(
            "tp2sp_full", "dense", 2, TP2_SP, scope="", impl="full_iteration", eager_ref="tp2sp_eager",
            one_gpu_ref="gpu1_eager", tp=2, label="TP=2 SP",
        ),
    ]  # fmt: skip
    return runs


TP2_PP2_VPP2 = (
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
    "--use-distributed-optimizer"
)
EP4 = "--expert-model-parallel-size 4"


def four_gpu_runs() -> list[RunSpec]:
    """The four-GPU table, most important first.

    The dense GPT at TP=2 x PP=2 x VPP=2 (DP=1, 8 micro-batches) with the distributed
    optimizer, eager, whole layer and ``attn mlp``; the MoE GPT at EP=4 (DP=4, two
    micro-batches per rank as at EP=2), eager and ``attn moe_router moe_preprocess``; then
    the dense eager and ``attn mlp`` jobs as two torchrun "nodes" of two GPUs, whose
    losses must equal the one-launcher eager run's bit for bit (same layout and kernels).
    """
    dense = dict(tp=2, pp=2, vpp=2, label="TP=2 PP=2 VPP=2 DistOpt")
    eager = RunSpec("tp2pp2vpp2_eager", "dense", 4, TP2_PP2_VPP2, **dense)
    runs = [
        eager,
        dataclasses.replace(eager, name="tp2pp2vpp2_layer", scope="", eager_ref=eager.name),
        dataclasses.replace(eager, name="tp2pp2vpp2_attn_mlp", scope="attn mlp", eager_ref=eager.name),
    ]
    ep = dict(model="moe", nproc=4, layout=EP4, dp=4, microbatches=2, label="MoE EP=4")
    runs += [
        RunSpec("ep4_eager", **ep),
        RunSpec("ep4_attn_router_pre", scope="attn moe_router moe_preprocess", eager_ref="ep4_eager", **ep),
    ]
    two_nodes = dataclasses.replace(eager, name="tp2pp2vpp2_2node_eager", nodes=2, eager_ref=eager.name)
    runs += [two_nodes, dataclasses.replace(two_nodes, name="tp2pp2vpp2_2node_attn_mlp", scope="attn mlp")]
    return runs


RESULTS_FILE = {2: "two_gpu.json", 4: "four_gpu.json"}
"""Where each table's results go, in the output folder."""

TABLE_ENV = {2: {}, 4: {"NCCL_ALGO": "Ring"}}
"""Environment defaults of each table's runs (a value already set is kept). NCCL_ALGO=Ring:
Megatron's --deterministic-mode default (megatron/training/determinism.py), so that the
one-launcher and two-"node" runs reduce in the same order."""


def microbatches(spec: RunSpec, sizes: Sizes) -> int:
    """Micro-batches per rank of ``spec`` at ``sizes``."""
    return spec.microbatches or sizes.microbatches_per_rank(spec.model, spec.dp)


def reporting_ranks(spec: RunSpec) -> set[int]:
    """Ranks whose memory and graph count the trainer reports: data-parallel rank 0 (the
    memory line, as Megatron's report_memory) and the last rank (its metrics file).

    Megatron's rank order puts tensor parallelism innermost: dp rank = (rank // TP) % DP.
    """
    return {r for r in range(spec.nproc) if (r // spec.tp) % spec.dp == 0} | {spec.nproc - 1}


def save_iteration(iters: int) -> int:
    """The iteration the save run saves at (a third of the run)."""
    return max(1, iters // 3)


def argv(spec: RunSpec, sizes: Sizes, iters: int, *, metrics_file: str, ckpt_dir: str) -> list[str]:
    """``pretrain_gpt.py``'s arguments for ``spec``."""
    model = sizes.dense if spec.model == "dense" else sizes.moe
    train_iters = save_iteration(iters) if spec.kind == "save" else iters
    if spec.microbatches is not None:
        words = model.split()
        at = words.index("--global-batch-size") + 1
        words[at] = str(int(words[words.index("--micro-batch-size") + 1]) * spec.dp * spec.microbatches)
        model = " ".join(words)
    flags = f"{model} {sizes.precision} {COMMON} {spec.layout} {spec.extra} --train-iters {train_iters}"
    flags += f" --lr-decay-iters {iters}"  # the save run's checkpoint then has the loads' schedule
    # The memory line at the end holds the peaks of the whole run; the metrics file (the
    # last rank's) also gets the memory numbers, for a rank that prints no memory line.
    flags += f" --log-memory-interval {train_iters} --log-memory-to-tensorboard"
    if spec.graphed:
        flags += f" --cuda-graph-impl {spec.impl}"
    out = flags.split()
    if spec.scope:
        out += ["--cuda-graph-scope", *spec.scope.split()]
    out += ["--metrics-file", metrics_file]
    if spec.kind == "save":
        out += ["--save", ckpt_dir, "--save-interval", str(train_iters), "--ckpt-format", "torch_dist"]
    elif spec.kind == "load":
        out += ["--load", ckpt_dir, "--ckpt-format", "torch_dist"]
    return out


def estimate_s(spec: RunSpec, sizes: Sizes, iters: int) -> float:
    """Rough wall seconds of one run (start-up, capture, iterations, save or load, exit)."""
    per_iter = sizes.dense_iter_s if spec.model == "dense" else sizes.moe_iter_s
    seconds = sizes.startup_s + iters * per_iter
    if spec.graphed:
        seconds += 3.0
    if spec.kind in ("save", "load"):
        seconds += 8.0
    seconds += 10.0 * (spec.nodes - 1)  # one more launcher's start and rendezvous
    return seconds


def graph_bound(spec: RunSpec, sizes: Sizes, rank: int) -> int | None:
    """Most graphs ``rank`` may hold: 2 (forward, backward) x graphed regions x micro-batches in flight.

    The rank's regions are its chunks' layers' graphed regions plus the loss head on the
    last chunk of the last stage (when the head is graphed); its micro-batches in flight
    are 1 without pipelining, else the most of all chunks forwarded and not yet
    backwarded at once in the rank's schedule order (a graph slot serves any chunk).
    """
    if not spec.graphed:
        return None
    if spec.impl == "full_iteration":
        return 1  # one micro-batch count, one graph
    from megatron.core.pipeline_parallel import schedules, simulate

    per_layer, head = SCOPE_REGIONS[(spec.model, spec.scope)]
    chunks = spec.vpp
    layers_per_chunk = sizes.layers(spec.model) // (spec.pp * chunks)
    micro = microbatches(spec, sizes)
    pp_rank = rank // (spec.nproc // spec.pp)  # Megatron's rank order: pipeline outermost
    order = schedules.rank_order(micro, spec.pp, pp_rank, chunks) if spec.pp > 1 else None
    regions = chunks * layers_per_chunk * per_layer + (1 if head and pp_rank == spec.pp - 1 else 0)
    return 2 * regions * (simulate.max_in_flight(order) if order is not None else 1)


def select(runs: list[RunSpec], only: list[str] | None) -> list[RunSpec]:
    """The runs named in ``only`` (all when None), in table order; unknown names raise."""
    if not only:
        return list(runs)
    known = {r.name for r in runs}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise ValueError(f"--only: unknown run(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    wanted = set(only)
    return [r for r in runs if r.name in wanted]

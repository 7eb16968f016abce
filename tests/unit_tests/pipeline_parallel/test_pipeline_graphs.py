"""CUDA graphs under the real pipeline schedules, through the trainer, on gloo CPU processes.

Graphs cannot be captured on the CPU, so each run goes as far as the CPU allows:

1. A trainer is built from Megatron flags with ``--cuda-graph-impl local`` and
   ``--pipeline-model-parallel-size > 1`` (the validation accepts it; without CUDA the
   session is off), then its session is re-attached with ``record_without_cuda`` so the
   first iteration records through the real schedule (``forward_backward_pipelining``)
   and the plans are made where the capture would start.
2. The session is then put in the captured state with its graphs stood in for by the
   eager region methods, each call and each backward advancing the session's replay
   cursor as a replay does. So the later iterations check the recorded order event by
   event, the schedule's micro-batch count and key, and receive into the session's
   static inputs where ``graph_comm.py`` says the slot is free, under
   ``receive_buffer``'s own check that the slot is not in the middle of a micro-batch.

Checked on every rank, for PP=2 and PP=4 1F1B (1, 2, 4, 8 micro-batches), PP=2 with
two virtual stages per rank, in both spellings (2, 4, 8 micro-batches, and 4 with the
attn and mlp scopes; interleaving needs at least as many micro-batches as stages), and
PP=2 with a
``--pipeline-model-parallel-layout`` of three virtual stages per rank, some of them
without layers (6 micro-batches): the recorded order, slots, cycles and plans are those
``simulate.py`` and ``graph_comm.py`` predict for that rank (a slot serves micro-batches
of any chunk); the graph count is at most regions x micro-batches in flight; receives land in place exactly as decided; losses equal a graphs-off run of the same layout bitwise (the same
kernels on the same values: the stand-ins run the regions' own eager code); and a
changed micro-batch count or interleaving group after capture is a clear error.
Also: ``--cuda-graph-scope`` is checked against the layers of every stage (a hybrid
stage without attention accepts ``attn``).
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow  # 1-3 minutes on 2 CPU cores: 16 runs of 2 and 4 processes

BASE = (
    "--num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --lr 1e-3 --lr-decay-style constant --seed 1234 --mock-data --tokenizer-type "
    "NullTokenizer --vocab-size 64 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 "
    "--log-interval 1 --eval-iters 0"
)
ITERATIONS = 3  # one recording, two "replays"
PP2, PP4 = "--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 4"
VPP = {
    "vpp2": PP2 + " --num-virtual-stages-per-pipeline-rank 2",
    "vpp2_layers": PP2 + " --num-layers-per-virtual-pipeline-stage 1",
}
LAYOUT = PP2 + " --pipeline-model-parallel-layout E|tt||t|t|L"
GRAPHS = "--cuda-graph-impl local"


def cases(world_size):
    """name -> (flags, micro-batches, scope) of the runs of one world size."""
    if world_size == 4:
        return {f"pp4_m{m}": (PP4, m, "") for m in (1, 2, 4, 8)}
    out = {f"pp2_m{m}": (PP2, m, "") for m in (1, 2, 4, 8)}
    out["pp2_m4_attn"] = (PP2, 4, "attn")  # the received input feeds a graph, the sent output is eager
    out["pp2_m4_mlp"] = (PP2, 4, "mlp")  # the other way round
    for name, flags in VPP.items():
        out.update({f"{name}_m{m}": (flags, m, "") for m in (2, 4, 8)})
    # Slots serve both chunks; partial scopes put eager code at the chunk edges.
    out["vpp2_m4_attn"] = (VPP["vpp2"], 4, "attn")
    out["vpp2_m4_mlp"] = (VPP["vpp2"], 4, "mlp")
    # A layout string with chunks of no graphed region: rank 0 holds the embedding alone, an
    # empty chunk and layer 4; rank 1 layers 1-2, layer 3 and the loss alone.
    for scope in ("", "attn"):
        out[f"layout_empty_stages_m6{'_' + scope if scope else ''}"] = (LAYOUT, 6, scope)
    return out


# ---------------------------------------------------------------------- on each rank


def _argv(flags, m, graphs, cache):
    return f"{BASE} {flags} --global-batch-size {m} --train-iters {ITERATIONS} {graphs}".split() + [
        "--data-cache-path",
        cache,
    ]


def _train(trainer, iterations, after_step=None):
    from megatron.training.data import build_data_iterators

    it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
    trainer.model.train()
    losses = []
    for i in range(iterations):
        losses.append(trainer.train_step(it)[0].item())
        if after_step is not None:
            after_step(i)
    return losses


def _eager_stand_ins(session):
    """Routes every region to its eager method, advancing the session's cursor as a
    forward replay and (through ``RecordBackward``) a backward replay would."""
    from megatron.core.transformer.cuda_graphs.plan import BWD, FWD, Event
    from megatron.core.transformer.cuda_graphs.replay import RecordBackward

    def stand_in(region):
        def call(*args, **kwargs):
            slot = session.slot
            session._advance(Event(FWD, region.index, slot), region)
            outs = list(region.split_outputs(region.fn(*args, **kwargs)))
            idx = [j for j, o in enumerate(outs) if o.requires_grad]
            if idx:
                backward = Event(BWD, region.index, slot)
                wrapped = RecordBackward.apply(
                    lambda grads: session._advance(backward, region), *[outs[j] for j in idx]
                )
                for j, w in zip(idx, wrapped):
                    outs[j] = w
            return region.join_outputs(outs)

        return call

    for region in session.regions:
        region.module.__dict__[region.method_name] = stand_in(region)


def _as_captured(session):
    """The recorded session in the captured state: graphs stood in for eagerly, a CPU
    tensor for every static input a receive may land in; counts the in-place receives."""
    import torch

    from megatron.core.transformer.cuda_graphs.session import GraphState

    session.buffers = {}
    for slot, plan in session.plans.items():
        regions = {e.region for e in session.cycles[slot]}
        session.buffers[slot] = {
            plan.owner(("input", r, i)): torch.empty(session.regions[r].arg_meta[i].shape)
            for r, i in session.received_inputs
            if r in regions
        }
    _eager_stand_ins(session)
    session.state, session.cursor = GraphState.CAPTURED, 0
    landed = []
    receive_buffer = session.receive_buffer

    def counted(slot, chunk=0):
        buffer = receive_buffer(slot, chunk)
        landed.append(slot if buffer is not None else None)
        return buffer

    session.receive_buffer = counted
    return landed


def _chunk_regions(session, model):
    from megatron.core.pipeline_parallel.schedules import model_chunks

    out = []
    for chunk in model_chunks(model):
        modules = {id(m) for m in chunk.modules()}
        out.append([r.index for r in session.regions if id(r.module) in modules])
    return out


def _graphed(argv, m):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import model_chunks, pipeline_schedule_key
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.cuda_graphs.regions import graphable_layers
    from megatron.training.training import build_trainer

    trainer = build_trainer(argv)  # the validation accepts graphs with PP; no CUDA: the session is off
    try:
        cfg, pg = trainer.cfg, trainer.pg
        assert not trainer.graphs.active
        trainer.graphs.close()
        session = cuda_graphs.attach(
            trainer.model.module,
            cfg.cuda_graph,
            model_config=cfg.model,
            grad_sinks=[trainer.model],
            record_without_cuda=True,
            scope_group=pg.pp,
        )
        trainer.graphs = session
        session.end_of_iteration = session.make_plans  # where the capture would start
        found = {}

        def after_step(i):
            if i == 0:
                del session.end_of_iteration
                found["landed"] = _as_captured(session)

        losses = _train(trainer, ITERATIONS, after_step)
        assert session.cursor == 0  # every replayed iteration ran all recorded events
        chunks = len(_chunk_regions(session, trainer.model.module))
        # A changed micro-batch count after capture: a clear error before any exchange.
        try:
            trainer.schedule(
                forward_step=trainer.forward_step,
                next_batch=lambda: None,
                model=trainer.model,
                num_microbatches=m + 2,
                graphs=session,
            )
            changed = None
        except ValueError as err:
            changed = str(err)
        # Another interleaving group after capture (same count, another order): a clear error too.
        regrouped = None
        if chunks > 1 and m > pg.pp_size:
            try:
                trainer.schedule(
                    forward_step=trainer.forward_step,
                    next_batch=lambda: None,
                    model=trainer.model,
                    num_microbatches=m,
                    graphs=session,
                    microbatch_group_size=m,
                )
            except ValueError as err:
                regrouped = str(err)
        return {
            "losses": losses,
            "order": [(e.phase, e.region, e.slot) for e in session.order],
            "cycles": session.cycles,
            "plans": session.plans,
            "ios": [(r.name, list(r.sources), r.input_requires_grad, r.output_requires_grad) for r in session.regions],
            "chunk_regions": _chunk_regions(session, trainer.model.module),
            "chunk_layers": [len(graphable_layers(c)) for c in model_chunks(trainer.model.module)],
            "slot_weights": trainer._slot_weights(trainer.model.module),  # what the trainer passes on CUDA
            "received_inputs": sorted(session.received_inputs),
            "num_graphs_bound_slots": len(session.cycles),
            "recorded": (session.recorded_microbatches, session.recorded_schedule),
            "key": pipeline_schedule_key(pg.pp_size, pg.pp_rank, chunks),
            "landed": found["landed"],
            "changed": changed,
            "regrouped": regrouped,
            "summary": session.summary_line(stage=(pg.pp_rank, pg.pp_size)),
        }
    finally:
        parallel_state.destroy(trainer.pg)


def _eager(argv):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    trainer = build_trainer(argv)
    try:
        return _train(trainer, ITERATIONS)
    finally:
        parallel_state.destroy(trainer.pg)


def _rank_runs(rank, world_size, runs, cache):
    import warnings

    out, eager = {}, {}
    for name, (flags, m, scope) in runs.items():
        graphs = f"{GRAPHS} --cuda-graph-scope {scope}".rstrip()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CUDA is not available: graphs are off
            if (flags, m) not in eager:  # one graphs-off run per layout and micro-batch count
                eager[(flags, m)] = _eager(_argv(flags, m, "", cache))
            out[name] = {"eager": eager[(flags, m)], "graphed": _graphed(_argv(flags, m, graphs, cache), m)}
    return out


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """One index cache for every run (building the mock data's index is the slow part)."""
    return str(tmp_path_factory.mktemp("index_cache"))


@pytest.fixture(scope="module")
def results(data_cache):
    """name -> per-rank results, for every case of both world sizes."""
    out = {}
    for world_size in (2, 4):
        per_rank = run_distributed(_rank_runs, world_size, cases(world_size), data_cache, timeout=900)
        for name in cases(world_size):
            out[name] = [r[name] for r in per_rank]
    return out


# ---------------------------------------------------------------------- checks


def _all_cases():
    return {**cases(2), **cases(4)}


def _expected(name, rank, got):
    """The order, cycles and plans ``simulate.py`` and ``graph_comm.py`` predict for ``rank``."""
    from megatron.core.pipeline_parallel import graph_comm, schedules, simulate
    from megatron.core.pipeline_parallel.timetable import build_timetable
    from megatron.core.transformer.cuda_graphs.plan import (
        BWD,
        FWD,
        CommRead,
        CommRecv,
        Event,
        RegionIO,
        build_plan,
        run_cycle,
        slot_runs,
    )

    flags, m, scope = _all_cases()[name]
    pp = 4 if flags == PP4 else 2
    regions = got["chunk_regions"]
    chunks = len(regions)
    chunk_of = {r: c for c in range(chunks) for r in regions[c]}
    schedule = "1f1b" if chunks == 1 else "interleaved"
    order = simulate.rank_order(schedule, m, pp, rank, chunks)
    events = []
    for step in simulate.slot_steps(order, got["chunk_layers"]):  # the weights the schedule uses
        mine = regions[step.chunk]
        events += [Event(FWD, r, step.slot) for r in mine] if step.phase == "F" else []
        events += [Event(BWD, r, step.slot) for r in reversed(mine)] if step.phase == "B" else []
    runs = slot_runs(events, chunk_of)
    orders = [schedules.rank_order(m, pp, r, chunks) for r in range(pp)]
    decided = graph_comm.plan_graph_comm(order, build_timetable(orders, chunks)[rank], got["chunk_layers"])
    ios = [RegionIO(*io) for io in got["ios"]]
    cycles, plans = {}, {}
    for slot, slot_runs_ in runs.items():
        cycles[slot] = run_cycle(slot_runs_)
        comm = []
        for c, _ in slot_runs_:  # the edges of every chunk the slot serves
            first, last, stage = regions[c][0], regions[c][-1], c * pp + rank
            if stage > 0 and scope != "mlp":  # eager attention reads the received input first
                comm.append(CommRecv(("input", first, 0)))
                if decided.grad_sent_in_place[slot]:
                    comm.append(CommRead(("grad_input", first, 0)))
            if stage < pp * chunks - 1 and scope != "attn":  # an eager MLP makes the sent output
                comm.append(CommRead(("output", last, 0), until=(BWD, last)))
        plans[slot] = build_plan(cycles[slot], ios, comm, chunk_of)
    return order, events, cycles, plans, decided


@pytest.mark.parametrize("name", list(_all_cases()))
def test_recorded_order_slots_cycles_and_plans_are_the_predicted_ones(results, name):
    from megatron.core.pipeline_parallel import simulate

    for rank, r in enumerate(results[name]):
        got = r["graphed"]
        order, events, cycles, plans, _ = _expected(name, rank, got)
        assert got["order"] == [(e.phase, e.region, e.slot) for e in events], f"rank {rank}"
        assert got["cycles"] == cycles, f"rank {rank}"
        assert got["plans"] == plans, f"rank {rank}"
        assert got["recorded"] == (_all_cases()[name][1], got["key"])
        # Graph count: one forward and one backward graph per region of every chunk a slot
        # serves; at most regions x micro-batches in flight (slots: those of every chunk at once).
        regions = got["chunk_regions"]
        graphs = sum(len(c) for c in got["cycles"].values())
        bound = 2 * sum(map(len, regions)) * simulate.max_in_flight(order)
        assert graphs <= bound, f"rank {rank}: {graphs} graphs, over 2 x regions x micro-batches in flight ({bound})"
        if got["summary"]:
            assert got["summary"].startswith(f"graph pool | pipeline rank: {rank} of ")


@pytest.mark.parametrize("name", ["pp2_m4", "vpp2_m4", "layout_empty_stages_m6"])
def test_slot_weights_are_what_each_chunk_keeps(results, name):
    """The trainer sizes graph slots by each chunk's analytic activation bytes: equal for
    chunks of equal layers, more for the chunk holding the graphed loss head, none for a
    chunk without graphed regions."""
    for rank, r in enumerate(results[name]):
        got = r["graphed"]
        weights, layers, regions = got["slot_weights"], got["chunk_layers"], got["chunk_regions"]
        assert len(weights) == len(layers) and all((w == 0) == (not rs) for w, rs in zip(weights, regions))
        plain = {w / n for w, n, rs in zip(weights, layers, regions) if n and len(rs) == n}  # per layer
        assert len(plain) <= 1, f"rank {rank}: {weights}"
        for w, n, rs in zip(weights, layers, regions):
            if len(rs) > n and plain:  # the chunk with the loss head
                assert w > n * min(plain), f"rank {rank}: {weights}"


@pytest.mark.parametrize("name", list(_all_cases()))
def test_receives_land_in_place_as_decided(results, name):
    for rank, r in enumerate(results[name]):
        got = r["graphed"]
        _, _, _, _, decided = _expected(name, rank, got)
        first_inputs = {(regions[0], 0) for regions in got["chunk_regions"] if regions}
        wanted = []
        for (chunk, mb), in_place in decided.receive_in_place.items():
            regions = got["chunk_regions"][chunk]  # none: a chunk without layers passes its input on
            reads = bool(regions) and (regions[0], 0) in got["received_inputs"]
            if in_place and reads:
                wanted.append(decided.slot_of[(chunk, mb)])
        # Every receive the decision allows asks receive_buffer, once per replayed iteration.
        landed = [s for s in got["landed"] if s is not None]
        assert sorted(landed) == sorted(wanted * (ITERATIONS - 1)), f"rank {rank}"
        assert set(got["received_inputs"]) <= first_inputs
        if _all_cases()[name][2] == "mlp":
            assert not got["received_inputs"] and not landed
        elif rank > 0 or len(got["chunk_regions"]) > 1:
            assert got["received_inputs"], f"rank {rank}: a later stage's first graph reads the received input"


@pytest.mark.parametrize("name", list(_all_cases()))
def test_losses_equal_graphs_off(results, name):
    for rank, r in enumerate(results[name]):
        assert r["graphed"]["losses"] == r["eager"], f"rank {rank}"  # bitwise: the same kernels run


def test_changed_micro_batch_count_after_capture_is_a_clear_error(results):
    for name, (_, m, _) in _all_cases().items():
        for r in results[name]:
            changed = r["graphed"]["changed"]
            assert changed and f"captured for {m} micro-batches per iteration in" in changed, (name, changed)
            assert f"this iteration has {m + 2}; a pipelined replay order depends on the count" in changed


def test_changed_interleaving_group_after_capture_is_a_clear_error(results):
    checked = 0
    for name, (flags, m, _) in _all_cases().items():
        if flags in VPP.values() and m > 2:
            for r in results[name]:
                assert "CUDA graphs were captured under the schedule ('interleaved', 2," in r["graphed"]["regrouped"]
                checked += 1
    assert checked == 12  # (2 spellings x (4, 8) micro-batches + the attn and mlp scopes at 4) x 2 ranks


def test_some_receives_copy_and_some_land_in_place(results):
    """The layouts cover both sides of the receive decision."""
    in_place = copied = 0
    for name in _all_cases():
        for rank, r in enumerate(results[name]):
            decided = _expected(name, rank, r["graphed"])[4]
            in_place += sum(decided.receive_in_place.values())
            copied += sum(not v for v in decided.receive_in_place.values())
    assert in_place > 0 and copied > 0


# ---------------------------------------------------------------------- scopes over stages

HYBRID = (
    "--hidden-size 32 --num-attention-heads 4 --mamba-state-dim 8 --mamba-head-dim 8 --mamba-num-groups 2 "
    "--position-embedding-type none --normalization RMSNorm --disable-bias-linear --seq-length 16 "
    "--micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --train-iters 1 --mock-data --vocab-size 64 "
    "--tokenizer-type NullTokenizer --num-workers 0 --eval-iters 0 " + PP2
)


def _hybrid_stage_scopes(rank, world_size, scope):
    """Builds a hybrid trainer whose second stage has no attention layer, graphing ``scope``."""
    import warnings

    import pretrain_hybrid
    from megatron.core import parallel_state
    from megatron.core.transformer import cuda_graphs
    from megatron.training.training import build_trainer

    argv = f"{HYBRID} --hybrid-layer-pattern M*|M- --cuda-graph-impl local --cuda-graph-scope {scope}".split()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CUDA is not available: graphs are off
        trainer = build_trainer(argv, **pretrain_hybrid.providers(argv))
    try:
        trainer.graphs.close()
        alone = None
        try:  # this stage's layers alone
            cuda_graphs.attach(trainer.model.module, trainer.cfg.cuda_graph, model_config=trainer.cfg.model).close()
        except ValueError as err:
            alone = str(err)
        return alone
    finally:
        parallel_state.destroy(trainer.pg)


def test_scopes_are_checked_against_every_stage():
    """``--cuda-graph-scope attn`` with a hybrid stage that has no attention layer: the
    trainer accepts it (the other stage has one); that stage's layers alone would not."""
    alone = run_distributed(_hybrid_stage_scopes, 2, "attn", timeout=300)
    assert alone[0] is None
    assert "--cuda-graph-scope attn: this model has no 'attn' region" in alone[1]

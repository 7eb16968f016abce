"""tools/pool_peak.py on the CPU: the schedule it runs with --vpp-rank (the trace reading is
tools/alloc_trace.py's, tested in test_alloc_trace.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import pool_peak  # noqa: E402


def test_vpp_rank_runs_the_interleaved_order_of_two_chunks():
    import types

    from megatron.core.pipeline_parallel import simulate

    trainer = types.SimpleNamespace(schedule="default")
    assert pool_peak.with_schedule(trainer, None).schedule == "default"
    schedule = pool_peak.with_schedule(trainer, 1).schedule
    assert schedule.func is simulate.forward_backward_chunks
    assert schedule.keywords == {"num_chunks": 2, "pp_size": 2, "pp_rank": 1}

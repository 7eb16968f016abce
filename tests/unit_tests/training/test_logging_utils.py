"""The iteration and memory lines, the FLOPs formula and the metrics sinks."""

import datetime
import json
import math
import sys

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import logging_utils
from megatron.training.logging_utils import (
    MetricsWriter,
    format_iteration_line,
    format_memory_line,
    memory_metrics,
    memory_stats_mb,
    num_floating_point_operations,
    print_last_rank,
    print_rank_0,
    throughput_tflops_per_gpu,
)

STAMP = datetime.datetime(2026, 11, 30, 7, 37, 14, 123456)

EXPECTED_LINE = (
    " [2026-11-30 07:37:14.123456] iteration        5/      50 | consumed samples:           40 | "
    "elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 12.3 | "
    "learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 1.234567E+01 | loss scale: 1.0 | "
    "grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)


def _line(**overrides):
    kwargs = dict(
        iteration=5,
        train_iters=50,
        consumed_samples=40,
        elapsed_ms=123.4,
        lr=1e-4,
        global_batch_size=8,
        losses={"lm loss": 12.345671},
        loss_scale=1.0,
        grad_norm=1.2341,
        skipped_iters=0,
        nan_iters=0,
        throughput_tflops=12.3,
        timestamp=STAMP,
    )
    kwargs.update(overrides)
    return format_iteration_line(**kwargs)


def test_iteration_line_exact():
    assert _line() == EXPECTED_LINE


def test_iteration_line_optional_parts():
    line = _line(
        throughput_tflops=None, grad_norm=None, num_zeros=17.0, params_norm=301.23456, skipped_iters=3, nan_iters=12
    )
    assert line == (
        " [2026-11-30 07:37:14.123456] iteration        5/      50 | consumed samples:           40 | "
        "elapsed time per iteration (ms): 123.4 | learning rate: 1.000000E-04 | global batch size:     8 | "
        "lm loss: 1.234567E+01 | loss scale: 1.0 | num zeros: 17.0 | params norm: 301.235 | "
        "number of skipped iterations:   3 | number of nan iterations:  12 |"
    )


def test_iteration_line_several_losses_in_order_and_big_numbers():
    line = _line(losses={"lm loss": 2.5, "load balancing loss": 0.01}, iteration=123456789, loss_scale=2.0**32)
    assert "| lm loss: 2.500000E+00 | load balancing loss: 1.000000E-02 |" in line
    assert "iteration 123456789/      50 |" in line  # wider than 8 digits: grows, like Megatron
    assert "| loss scale: 4294967296.0 |" in line


def test_iteration_line_defaults_to_now():
    line = _line(timestamp=None)
    assert line.startswith(" [")  # Megatron's leading space
    stamp = datetime.datetime.strptime(line[2:28], "%Y-%m-%d %H:%M:%S.%f")
    assert abs((datetime.datetime.now() - stamp).total_seconds()) < 60


def test_memory_line():
    line = format_memory_line(0, "(after 1 iterations)", 123.454, 234.56, 300.0, 300.0)
    assert line == (
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 123.45 | max allocated: 234.56 | "
        "reserved: 300.00 | max reserved: 300.00"
    )
    extra = {"graph pool reserved": 64.0, "graph pool live": 12.5}
    line = format_memory_line(3, "(after capture)", 1, 2, 3, 4, extra=extra)
    assert line.endswith("| max reserved: 4.00 | graph pool reserved: 64.00 | graph pool live: 12.50")
    assert line.startswith("[Rank 3] (after capture) memory (MB) | allocated: 1.00 |")


def test_memory_stats_cpu_are_zeros_and_feed_the_line():
    stats = memory_stats_mb(torch.device("cpu"))
    assert stats == {"allocated_mb": 0.0, "max_allocated_mb": 0.0, "reserved_mb": 0.0, "max_reserved_mb": 0.0}
    assert "allocated: 0.00" in format_memory_line(0, "x", **stats)
    assert memory_metrics(
        {"allocated_mb": 1.0, "max_allocated_mb": 2.0, "reserved_mb": 3.0, "max_reserved_mb": 4.0}
    ) == {
        "mem-allocated-bytes": 1048576.0,
        "mem-max-allocated-bytes": 2097152.0,
        "mem-reserved-bytes": 3145728.0,
        "mem-max-reserved-bytes": 4194304.0,
    }


@pytest.mark.gpu
def test_memory_stats_cuda():
    device = torch.device("cuda")
    x = torch.empty(4 * 1024 * 1024, dtype=torch.uint8, device=device)
    stats = memory_stats_mb(device)
    assert stats["allocated_mb"] >= 4.0 and stats["reserved_mb"] >= stats["allocated_mb"]
    assert stats["max_allocated_mb"] >= stats["allocated_mb"]
    del x


def _hand_count(cfg, b, s, V):
    """Sums 2*m*k*n over every matmul of one sequence's forward, times 3 and b; the two
    attention matmuls count half (causal: half of the s x s square), as Megatron counts them."""
    h, a, d, L = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.num_layers
    g = cfg.num_query_groups if cfg.group_query_attention else a
    f = cfg.ffn_hidden_size
    attention = [
        *[(s, d, s)] * a,  # Q K^T per head
        *[(s, s, d)] * a,  # P V per head
    ]
    matmuls = [
        (s, h, a * d + 2 * g * d),  # QKV
        (s, a * d, h),  # projection
        (s, h, f * (2 if cfg.gated_linear_unit else 1)),  # fc1
        (s, f, h),  # fc2
    ]
    causal = sum(2 * m * k * n for m, k, n in attention) // 2
    forward = L * (sum(2 * m * k * n for m, k, n in matmuls) + causal) + 2 * s * h * V
    return 3 * b * forward


def test_flops_tiny_config_by_hand():
    cfg = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=2, ffn_hidden_size=8)
    # Per token forward: QKV 2*4*12=96, causal attention 2*2*3*2*2/2=24, proj 32, fc1 64, fc2 64, logits 40.
    assert num_floating_point_operations(cfg, batch_size=1, seq_length=3, vocab_size=5) == 3 * 1 * 3 * (
        96 + 24 + 32 + 64 + 64 + 40
    )
    cfg.finalize()
    assert num_floating_point_operations(cfg, batch_size=2, seq_length=3, vocab_size=5) == _hand_count(cfg, 2, 3, 5)


@pytest.mark.parametrize("swiglu", [False, True])
def test_flops_gqa_swiglu_matches_hand_count_and_closed_form(swiglu):
    cfg = TransformerConfig(
        num_layers=3,
        hidden_size=64,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=96,
        gated_linear_unit=swiglu,
    ).finalize()
    b, s, V, L, h, a, g, d, f = 4, 32, 1000, 3, 64, 8, 2, 16, 96
    flops = num_floating_point_operations(cfg, batch_size=b, seq_length=s, vocab_size=V)
    assert flops == _hand_count(cfg, b, s, V)
    # Megatron's closed form, causal: 12 b s L h^2 [(1 + g/a + s/(2h))(a d / h) + (f/h) gm] + 6 b s h V.
    gm = 1.5 if swiglu else 1.0
    closed = 12 * b * s * L * h * h * ((1 + g / a + s / (2 * h)) * (a * d / h) + (f / h) * gm) + 6 * b * s * h * V
    assert math.isclose(flops, closed, rel_tol=1e-12)


def test_flops_unfinalized_config_uses_derived_defaults():
    raw = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    done = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4).finalize()
    kw = dict(batch_size=2, seq_length=16, vocab_size=128)
    assert num_floating_point_operations(raw, **kw) == num_floating_point_operations(done, **kw)


def test_throughput():
    assert throughput_tflops_per_gpu(8e12, 0.5, 4) == pytest.approx(4.0)


def test_metrics_writer_jsonl(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    writer = MetricsWriter(str(path), None, enabled_on_this_rank=True)
    writer.write(1, {"lm loss": 10.5, "learning-rate": 1e-4, "grad-norm": torch.tensor(2.0)})
    # Flushed on every write: readable before close.
    assert json.loads(path.read_text().splitlines()[0]) == {
        "iteration": 1,
        "lm loss": 10.5,
        "learning-rate": 1e-4,
        "grad-norm": 2.0,
    }
    writer.write(2, {"lm loss": float("nan"), "grad-norm": None}, samples=16)
    writer.close()
    writer.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2
    assert rows[1]["iteration"] == 2 and rows[1]["samples"] == 16 and rows[1]["grad-norm"] is None
    assert math.isnan(rows[1]["lm loss"])
    # Appends across runs (resumed training).
    with MetricsWriter(str(path), None, enabled_on_this_rank=True) as again:
        again.write(3, {"lm loss": 9.0})
    assert len(path.read_text().splitlines()) == 3


def test_metrics_writer_disabled_rank_writes_nothing(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path), None, enabled_on_this_rank=False)
    writer.write(1, {"lm loss": 1.0})
    writer.close()
    assert not path.exists()


class _FakeSummaryWriter:
    def __init__(self):
        self.scalars = []
        self.closed = False

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_metrics_writer_tensorboard_names(tmp_path, monkeypatch):
    fake = _FakeSummaryWriter()
    monkeypatch.setattr(logging_utils, "_check_tensorboard_installed", lambda: None)
    monkeypatch.setattr(logging_utils, "_make_summary_writer", lambda log_dir: fake)
    writer = MetricsWriter(None, str(tmp_path), enabled_on_this_rank=True)
    writer.write(
        7, {"lm loss": 3.0, "mem-allocated-bytes": 1024.0, "graph-pool-bytes": 5.0, "num-zeros": None}, samples=56
    )
    writer.close()
    assert ("lm loss", 3.0, 7) in fake.scalars
    assert ("lm loss vs samples", 3.0, 56) in fake.scalars
    assert ("mem-allocated-bytes", 1024.0, 7) in fake.scalars
    assert ("graph-pool-bytes vs samples", 5.0, 56) in fake.scalars
    assert not any(tag.startswith("num-zeros") for tag, _, _ in fake.scalars)
    assert fake.closed


def test_metrics_writer_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # makes `import tensorboard` fail
    for enabled in (True, False):  # every rank checks, not only the writing one
        with pytest.raises(ValueError, match="pip install tensorboard"):
            MetricsWriter(None, str(tmp_path), enabled_on_this_rank=enabled)
    MetricsWriter(None, None, enabled_on_this_rank=True).close()  # no TensorBoard asked: fine


def test_print_helpers(capsys):
    print_rank_0("hello from 0")
    print_last_rank("hello from last")
    out = capsys.readouterr().out
    assert out == "hello from 0\nhello from last\n"


def test_metrics_file_with_a_torn_last_line_is_repaired(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"iteration": 1, "lm loss": 5.0}\n{"iteration": 2, "lm lo')
    with logging_utils.MetricsWriter(str(path), None, enabled_on_this_rank=True) as w:
        w.write(3, {"lm loss": 4.0})
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 3]
    assert "ended in a torn line (23 bytes" in capsys.readouterr().out
    # A whole record that only lacks its newline is kept.
    path.write_text('{"iteration": 1}')
    with logging_utils.MetricsWriter(str(path), None, enabled_on_this_rank=True) as w:
        w.write(2, {})
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2]
    # Nothing but a torn line, longer than one read block.
    path.write_text('{"x": "' + "y" * 70000)
    assert logging_utils.repair_jsonl_tail(str(path)) == 70007 and path.read_text() == ""


def test_metrics_and_tensorboard_paths_of_the_wrong_kind(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(ValueError, match=r"--tensorboard-dir .*f is a file, not a folder"):
        logging_utils.MetricsWriter(None, str(a_file), enabled_on_this_rank=True)
    with pytest.raises(ValueError, match=r"--metrics-file .* is a folder"):
        logging_utils.MetricsWriter(str(tmp_path), None, enabled_on_this_rank=True)


class _FakeWandb:
    """Stands for the wandb module: records init, log and finish."""

    def __init__(self):
        self.init_kwargs, self.logged, self.finished = None, [], False

    def init(self, **kwargs):
        self.init_kwargs = kwargs

    def log(self, scalars, step):
        self.logged.append((step, dict(scalars)))

    def finish(self):
        self.finished = True


def test_wandb_gets_the_tensorboard_records_of_a_training_run(tmp_path, monkeypatch, tiny_argv):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    fake = _FakeWandb()
    monkeypatch.setattr(logging_utils, "_import_wandb", lambda: fake)
    argv = tiny_argv(
        f"--train-iters 3 --log-interval 1 --wandb-project proj --wandb-exp-name run1 --wandb-entity team "
        f"--save {tmp_path}/ckpt --save-interval 100"
    )
    trainer = build_trainer(argv)
    try:
        history = trainer.train()
    finally:
        trainer.close()
        parallel_state.destroy(trainer.pg)
    assert fake.init_kwargs["project"] == "proj" and fake.init_kwargs["name"] == "run1"
    assert fake.init_kwargs["entity"] == "team"
    assert fake.init_kwargs["dir"] == f"{tmp_path}/ckpt/wandb" and (tmp_path / "ckpt" / "wandb").is_dir()
    run_config = fake.init_kwargs["config"]
    assert run_config["model"]["num_layers"] == 2 and run_config["logging"]["wandb_project"] == "proj"
    steps = [step for step, scalars in fake.logged if "lm loss" in scalars]
    assert steps == [1, 2, 3]
    losses = [scalars["lm loss"] for _, scalars in fake.logged if "lm loss" in scalars]
    assert losses == pytest.approx([h["lm loss"] for h in history])
    assert fake.finished


def test_wandb_flag_errors_name_the_fix(tmp_path, monkeypatch, tiny_argv):
    from megatron.training.arguments import parse_args

    def validate(extra, *more):
        cfg = parse_args(tiny_argv("--train-iters 2", extra) + list(more)).resolve(world_size=1)
        cfg.validate()

    # As Megatron: no --wandb-exp-name lets wandb name the run; an empty one is refused.
    with pytest.raises(ValueError, match="--wandb-project proj with an empty --wandb-exp-name"):
        validate("--wandb-project proj", "--wandb-exp-name", "")
    validate(f"--wandb-project proj --wandb-save-dir {tmp_path}")
    with pytest.raises(ValueError, match="--wandb-project needs --wandb-save-dir DIR"):
        validate("--wandb-project proj --wandb-exp-name r")
    validate(f"--wandb-project proj --wandb-exp-name r --wandb-save-dir {tmp_path}")
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    for enabled in (True, False):  # every rank checks
        with pytest.raises(ValueError, match="pip install wandb"):
            MetricsWriter(None, None, enabled_on_this_rank=enabled, wandb={"dir": str(tmp_path)})


def test_memory_line_prints_counts_as_integers():
    extra = {"graph pool reserved": 64.0, "graphs": 16, "graph capture (s)": 0.25, "pipeline rank": 1}
    line = format_memory_line(0, "(after 1 iterations)", 1, 2, 3, 4, extra=extra)
    assert line.endswith("| graph pool reserved: 64.00 | graphs: 16 | graph capture (s): 0.25 | pipeline rank: 1")

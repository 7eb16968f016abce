"""What the training loop records: JSONL metrics per logged iteration and TensorBoard scalars."""

import json

import pytest

from megatron.training.training import pretrain

FLAGS = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 --lr-decay-style linear --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0 --hidden-dropout 0.0 --attention-dropout 0.0"
).split()
MEGATRON_SCALARS = ("lm loss", "learning-rate", "grad-norm", "iteration-time", "loss-scale", "batch-size")
MEMORY_SCALARS = ("mem-allocated-bytes", "mem-max-allocated-bytes", "mem-reserved-bytes", "mem-max-reserved-bytes")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_metrics_file_has_every_scalar_per_iteration(tmp_path):
    path = tmp_path / "m.jsonl"
    trainer = pretrain(FLAGS + ["--train-iters", "4", "--log-interval", "1", "--metrics-file", str(path),
                                "--log-memory-to-tensorboard"])  # fmt: skip
    records = read_jsonl(path)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert [r["samples"] for r in records] == [4, 8, 12, 16]
    for i, r in enumerate(records, start=1):
        assert set(MEGATRON_SCALARS + MEMORY_SCALARS) <= set(r), sorted(r)
        assert r["batch-size"] == 4 and r["loss-scale"] == 1.0
        assert r["learning-rate"] == pytest.approx(trainer.scheduler.get_lr(i))
        assert r["grad-norm"] > 0 and r["iteration-time"] > 0
    assert [r["lm loss"] for r in records] == [h["lm loss"] for h in trainer.history]
    assert records[0]["learning-rate"] == pytest.approx(1e-3) and records[-1]["learning-rate"] == pytest.approx(1e-4)


def test_log_interval_averages_the_window(tmp_path):
    every = tmp_path / "every.jsonl"
    pretrain(FLAGS + ["--train-iters", "5", "--log-interval", "1", "--metrics-file", str(every)])
    sparse = tmp_path / "sparse.jsonl"
    pretrain(FLAGS + ["--train-iters", "5", "--log-interval", "2", "--metrics-file", str(sparse)])
    per_iter = [r["lm loss"] for r in read_jsonl(every)]
    records = read_jsonl(sparse)
    assert [r["iteration"] for r in records] == [1, 2, 4]  # Megatron's: after iteration 1, then every N
    assert records[0]["lm loss"] == pytest.approx(per_iter[0], rel=1e-6)
    assert records[1]["lm loss"] == pytest.approx(per_iter[1], rel=1e-6)  # the window restarts after 1
    assert records[2]["lm loss"] == pytest.approx((per_iter[2] + per_iter[3]) / 2, rel=1e-6)


def test_tensorboard_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, path = tmp_path / "tb", tmp_path / "m.jsonl"
    pretrain(FLAGS + ["--train-iters", "3", "--log-interval", "1", "--tensorboard-dir", str(tb),
                      "--metrics-file", str(path), "--log-memory-to-tensorboard",
                      "--log-timers-to-tensorboard"])  # fmt: skip
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(MEGATRON_SCALARS + MEMORY_SCALARS) <= tags, sorted(tags)
    assert "lm loss vs samples" in tags
    records = read_jsonl(path)
    for name in MEGATRON_SCALARS:
        scalars = events.Scalars(name)
        assert [s.step for s in scalars] == [1, 2, 3], name
        assert [s.value for s in scalars] == pytest.approx([r[name] for r in records], rel=1e-6), name
    assert [s.step for s in events.Scalars("lm loss vs samples")] == [4, 8, 12]


@pytest.mark.gpu
def test_graph_pool_bytes_are_recorded_gpu(tmp_path):
    path = tmp_path / "m.jsonl"
    pretrain(FLAGS + ["--train-iters", "3", "--log-interval", "1", "--metrics-file", str(path), "--bf16",
                      "--log-memory-to-tensorboard", "--cuda-graph-impl", "local"])  # fmt: skip
    records = read_jsonl(path)
    assert all(r["mem-allocated-bytes"] > 0 for r in records)
    # Graphs are captured at the end of iteration 1; from then on the pool is accounted.
    # Between steps nothing may be live: every static buffer is released to later graphs.
    assert all(r["graph-pool-reserved-bytes"] > 0 for r in records[1:])
    assert all(r["graph-pool-reserved-bytes"] >= r["graph-pool-live-bytes"] >= 0 for r in records[1:])
    assert all(r["graph-count"] == 2 * (1 + 1) for r in records[1:])  # the layer and the head, fwd and bwd


def test_tensorboard_lm_loss_every_iteration_whatever_the_log_interval(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, path = tmp_path / "tb", tmp_path / "m.jsonl"
    pretrain(FLAGS + ["--train-iters", "4", "--log-interval", "1", "--metrics-file", str(path)])
    per_iter = [r["lm loss"] for r in read_jsonl(path)]
    pretrain(FLAGS + ["--train-iters", "4", "--log-interval", "4", "--tensorboard-dir", str(tb),
                      "--log-num-zeros-in-grad"])  # fmt: skip
    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = events.Scalars("lm loss")
    assert [s.step for s in scalars] == [1, 2, 3, 4]  # as Megatron: each iteration's loss, not window means
    assert [s.value for s in scalars] == pytest.approx(per_iter, rel=1e-6)
    assert [s.step for s in events.Scalars("num-zeros")] == [1, 4]


def test_moe_per_layer_losses_in_tensorboard(tmp_path):
    # --moe-per-layer-logging: Megatron's moe/<name>_layer_<i> scalars beside the layer-mean on the log line.
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, path = tmp_path / "tb", tmp_path / "m.jsonl"
    moe = ["--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
           "--moe-z-loss-coeff", "1e-3", "--moe-per-layer-logging"]  # fmt: skip
    pretrain(FLAGS[2:] + moe + ["--train-iters", "2", "--log-interval", "1", "--tensorboard-dir", str(tb),
                                "--metrics-file", str(path)])  # fmt: skip
    events = EventAccumulator(str(tb))
    events.Reload()
    records = read_jsonl(path)
    for name in ("load_balancing_loss", "z_loss"):
        layers = [[s.value for s in events.Scalars(f"moe/{name}_layer_{i}")] for i in (0, 1)]
        assert all(len(v) == 2 for v in layers)
        means = [(a + b) / 2 for a, b in zip(*layers)]
        assert means == pytest.approx([r[name] for r in records], rel=1e-5)  # fp32 metric sums


def _scalar_tags(tb) -> set:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    return events


@pytest.mark.parametrize("off", ["--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard"])
def test_tensorboard_world_size_and_no_loss_scale(tmp_path, off):
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    pretrain(FLAGS + ["--train-iters", "2", "--tensorboard-dir", str(tb), "--log-world-size-to-tensorboard", off])
    events = _scalar_tags(tb)
    tags = set(events.Tags()["scalars"])
    assert "loss-scale" not in tags and "lm loss" in tags
    assert [(s.step, s.value) for s in events.Scalars("world-size")] == [(1, 1.0), (2, 1.0)]
    assert [s.step for s in events.Scalars("world-size vs samples")] == [4, 8]


def test_tensorboard_validation_and_test_losses_as_megatron_tags_them(tmp_path):
    """Megatron writes the test split's loss under "lm loss validation" too (the metrics file keeps
    them apart); the evaluations after training come after the one at the last iteration."""
    pytest.importorskip("tensorboard")
    tb, path = tmp_path / "tb", tmp_path / "m.jsonl"
    flags = ["--train-iters", "4", "--eval-iters", "1", "--eval-interval", "2", "--log-validation-ppl-to-tensorboard"]
    pretrain(FLAGS + flags + ["--tensorboard-dir", str(tb), "--metrics-file", str(path)])
    records = read_jsonl(path)
    valid = [r["lm loss validation"] for r in records if "lm loss validation" in r]
    test = [r["lm loss test"] for r in records if "lm loss test" in r]
    events = _scalar_tags(tb)
    scalars = events.Scalars("lm loss validation")
    assert [s.step for s in scalars] == [2, 4, 4, 4]
    assert [s.value for s in scalars] == pytest.approx(valid + test, rel=1e-6)
    assert len(events.Scalars("lm loss validation ppl")) == 4


@pytest.mark.gpu
def test_memory_line_with_device_memory_used_gpu(capfd):
    pretrain(FLAGS + ["--train-iters", "2", "--log-device-memory-used"])  # FLAGS warm up for one iteration
    line = next(x for x in capfd.readouterr().out.splitlines() if "memory (MB)" in x)
    used = float(line.split("| total device memory used: ")[1].split(" ")[0])
    allocated = float(line.split("| allocated: ")[1].split(" ")[0])
    assert used >= allocated > 0  # the driver's count includes the CUDA context and the allocator's cache

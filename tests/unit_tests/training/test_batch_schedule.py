"""--rampup-batch-size and --step-batch-size-schedule: the schedule, the flags, and training (CPU).

Expected values are worked by hand from Megatron's rules (module docstring of
``megatron/training/batch_schedule.py``); the loop references below are Megatron's
``update_train_iters`` written out step by step.
"""

import math

import pytest

from megatron.core import parallel_state
from megatron.training.arguments import parse_args
from megatron.training.batch_schedule import BatchSchedule, parse_count, parse_step_schedule
from megatron.training.checkpointing import read_tracker
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer, pretrain
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.census import test_census as census

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 128 --num-workers 0 --log-interval 1 --attention-dropout 0.0 --hidden-dropout 0.1 "
    "--seed 1234 --ckpt-format torch"
).split()
RAMP = ["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12"]
STEPS = ["--step-batch-size-schedule", "0:2 128:4 320:8"]  # tokens: 0, 4 and 10 samples of 32 tokens


def resolved(*extra, world_size=1):
    cfg = parse_args(FLAGS + [str(x) for x in extra]).resolve(world_size)
    cfg.validate()
    return cfg


def run(*extra):
    return pretrain(FLAGS + [str(x) for x in extra])


# ------------------------------------------------------------------ the schedule, pure
def test_counts_take_megatron_suffixes():
    assert parse_count("200B") == 200 * 10**9
    assert parse_count("2.5k") == 2500
    assert parse_count("1T") == 10**12 and parse_count("3M") == 3 * 10**6 and parse_count("768") == 768
    with pytest.raises(ValueError, match="--step-batch-size-schedule: '20X' is not a number"):
        parse_count("20X")


def test_census_schedule_in_tokens_becomes_samples():
    # gpt3_15b_8t_release: seq 4096; 200B tokens = 48,828,125 samples.
    assert parse_step_schedule("0:384 200B:768 400B:1152", 4096) == [(0, 384), (48828125, 768), (97656250, 1152)]
    assert parse_step_schedule("400B:1152,0:384", None) == [(0, 384), (400 * 10**9, 1152)]  # sorted; commas


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "is empty"),
        ("0-384", "is not THRESHOLD:BATCH_SIZE"),
        ("64:384 128:768", "first threshold must be 0"),
        ("0:384 64:768 65:1152", "strictly increasing"),  # 64 and 65 tokens are both 2 samples of 32
        ("0:0", "must be positive"),
    ],
)
def test_bad_step_schedules_name_the_flag(text, match):
    with pytest.raises(ValueError, match=f"--step-batch-size-schedule.*{match}"):
        parse_step_schedule(text, 32)


def test_rampup_sizes_follow_megatrons_formula():
    # START 16, INCREMENT 8, 300000 samples, to 1024: 126 increments of 300000/126 samples each.
    s = BatchSchedule(1024, 1, 8, rampup=(16, 8, 300000))
    per = 300000 / 126
    assert s.global_batch_size_at(0) == 16
    assert s.global_batch_size_at(math.ceil(per) - 1) == 16
    assert s.global_batch_size_at(math.ceil(per)) == 24
    assert s.global_batch_size_at(150000) == 16 + 8 * 63  # int(150000 / per) = 63
    assert s.global_batch_size_at(300000) == 1024 and s.global_batch_size_at(300001) == 1024
    assert s.num_microbatches_at(150000) == 65  # 520 / (1 x 8)


def test_step_schedule_sizes_and_microbatches():
    s = BatchSchedule(8, 2, 1, steps=((0, 2), (4, 4), (10, 8)))
    assert [s.global_batch_size_at(c) for c in (0, 3, 4, 9, 10, 10**9)] == [2, 2, 4, 4, 8, 8]
    assert [s.num_microbatches_at(c) for c in (0, 4, 10)] == [1, 2, 4]
    odd = BatchSchedule(8, 2, 2, steps=((0, 6), (10, 8)))
    with pytest.raises(ValueError, match=r"--step-batch-size-schedule: the global batch size 6 .* divisible"):
        odd.num_microbatches_at(0)


def _megatron_step_iterations(s, train_samples):
    consumed = iterations = 0
    while consumed < train_samples:
        consumed += s.global_batch_size_at(consumed)
        iterations += 1
    return iterations


def _megatron_rampup_iterations(s, train_samples):
    consumed = iterations = 0
    while consumed <= s.rampup[2] and consumed <= train_samples:
        consumed += s.global_batch_size_at(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // s.global_batch_size
    return iterations


@pytest.mark.parametrize("train_samples", [1, 2, 3, 5, 10, 11, 39, 40, 41, 1000, 12345])
def test_iterations_and_samples_match_the_step_by_step_loops(train_samples):
    step = BatchSchedule(8, 2, 1, steps=((0, 2), (4, 4), (10, 8), (500, 16)))
    ramp = BatchSchedule(8, 2, 1, rampup=(2, 2, 12))
    assert step.iterations_for(train_samples) == _megatron_step_iterations(step, train_samples)
    assert ramp.iterations_for(train_samples) == _megatron_rampup_iterations(ramp, train_samples)
    for s in (step, ramp):
        for start in (0, 3, 14):
            consumed = start
            for _ in range(train_samples % 97):
                consumed += s.global_batch_size_at(consumed)
            assert s.samples_after(start, train_samples % 97) == consumed


def test_sizes_between_lists_each_new_size_once():
    s = BatchSchedule(8, 2, 1, rampup=(2, 2, 12))
    assert s.sizes_between(0, 9) == [(0, 2), (4, 4), (8, 6), (14, 8)]
    assert s.sizes_between(14, 3) == [(14, 8)]


# ------------------------------------------------------------------ flags
def test_flags_resolve_iterations_and_global_batch():
    cfg = resolved(*RAMP, "--train-samples", 60)
    assert cfg.training.train_iters == 9  # 2, 2, 4, 6 in the ramp (14 samples), then 46 // 8 = 5
    cfg = resolved(*STEPS, "--train-samples", 40)
    assert cfg.training.global_batch_size == 8  # the schedule's last batch
    assert cfg.training.train_iters == 8  # 2, 2, 4, 4, then 8 until 40 samples are passed: 8, 8, 8, 8
    assert cfg.batch_schedule.varies and not resolved("--global-batch-size", 4).batch_schedule.varies


def test_schedule_as_separate_words_and_an_equal_global_batch_are_accepted():
    # Upstream's examples/gpt3/train_gpt3_175b_distributed.sh: the schedule array element is word-split by
    # the shell, and --global-batch-size repeats the schedule's last batch.
    cfg = resolved(
        "--global-batch-size", 8, "--step-batch-size-schedule", "0:2", "128:4", "320:8", "--train-samples", 40
    )
    assert cfg.training.global_batch_size == 8
    assert cfg.batch_schedule.steps == resolved(*STEPS, "--train-samples", 40).batch_schedule.steps
    assert cfg.training.train_iters == 8


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--global-batch-size", 4, *STEPS], r"--global-batch-size 4 differs from the last batch size .* \(8\)"),
        ([*STEPS, "--rampup-batch-size", 2, 2, 8], "--step-batch-size-schedule and --rampup-batch-size"),
        (["--global-batch-size", 8, "--rampup-batch-size", 10, 2, 8], "must be >= START"),
        (["--global-batch-size", 8, "--rampup-batch-size", 2, 4, 8], r"- START \(6\) must be divisible by INCREMENT"),
        (["--global-batch-size", 8, "--rampup-batch-size", 0, 2, 8], "START must be positive"),
        (["--step-batch-size-schedule", "0:4 64:x"], "'x' is not a number"),
    ],
)
def test_flag_mistakes_raise_naming_the_flag(extra, match):
    with pytest.raises(ValueError, match=match):
        resolved(*extra)


def test_a_size_not_divisible_by_micro_batch_times_dp_fails_before_training():
    # Ramp 2 -> 4 -> 6 with micro batch 2 on one rank is fine; micro batch 4 cannot make 2 or 6.
    with pytest.raises(ValueError, match=r"--rampup-batch-size: the global batch size 2 .* --micro-batch-size \(4\)"):
        build_trainer(
            FLAGS + ["--micro-batch-size", "4", "--global-batch-size", "8"] + RAMP[2:] + ["--train-iters", "4"]
        )


# ------------------------------------------------------------------ training
def test_ramp_trains_with_megatron_batches_samples_and_lr():
    trainer = run(*RAMP, "--train-samples", 60, "--lr-warmup-samples", 10)
    h = trainer.history
    assert [r["batch-size"] for r in h] == [2, 2, 4, 6, 8, 8, 8, 8, 8]
    assert trainer.consumed_samples == 54
    consumed = 0
    for r in h:  # lr in samples (float64 reference): warm-up over 10, cosine to 1e-4 at 60
        consumed += r["batch-size"]
        if consumed <= 10:
            want = 1e-3 * consumed / 10
        else:
            want = 1e-4 + 0.5 * (math.cos(math.pi * (consumed - 10) / 50) + 1) * 9e-4
        assert r["learning-rate"] == pytest.approx(want, rel=1e-12)


def test_step_schedule_with_iterations_counts_lr_in_samples_of_the_last_batch():
    trainer = run(*STEPS, "--train-iters", 6, "--lr-decay-iters", 6, "--lr-warmup-iters", 1)
    assert [r["batch-size"] for r in trainer.history] == [2, 2, 4, 4, 8, 8]
    # Megatron: warm-up 1 x 8 samples, decay over 6 x 8 samples; steps of each iteration's batch.
    assert trainer.history[0]["learning-rate"] == pytest.approx(1e-3 * 2 / 8, rel=1e-12)
    ratio = (20 - 8) / 40
    want = 1e-4 + 0.5 * (math.cos(math.pi * ratio) + 1) * 9e-4
    assert trainer.history[4]["learning-rate"] == pytest.approx(want, rel=1e-12)


def test_ramp_reads_micro_batches_in_megatrons_sample_order():
    """The ramped run's micro-batches are the constant run's, in order: the sampler hands out
    consecutive micro-batches whatever the global batch."""
    trainer = build_trainer(FLAGS + RAMP + ["--train-iters", "5"])
    parallel_state.destroy(trainer.pg)
    seen = []
    original = trainer.forward_step

    def spy(batch, model):
        seen.append(batch["tokens"].clone())
        return original(batch, model)

    trainer.forward_step = spy
    trainer.train()
    assert len(seen) == 11  # 1 + 1 + 2 + 3 + 4 micro-batches
    reference = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
    for i, tokens in enumerate(seen):
        assert (next(reference)["tokens"] == tokens).all(), f"micro-batch {i} differs"


@pytest.mark.parametrize("schedule, ckpt_format", [("ramp", "torch"), ("steps", "torch_dist")])
def test_resume_mid_ramp_is_bitwise_equal_to_uninterrupted(tmp_path, schedule, ckpt_format):
    flags = [*(RAMP if schedule == "ramp" else STEPS), "--ckpt-format", ckpt_format]
    full = run(*flags, "--train-iters", 8)
    part = run(*flags, "--train-iters", 8, "--exit-interval", 3, "--save", tmp_path / "c")
    assert read_tracker(str(tmp_path / "c"))[0] == 3
    resumed = run(*flags, "--train-iters", 8, "--load", tmp_path / "c")
    loss = [r["lm loss"] for r in full.history]
    assert [r["lm loss"] for r in part.history] == loss[:3]
    assert [r["lm loss"] for r in resumed.history] == loss[3:]  # bitwise: floats compared with ==
    assert [r["batch-size"] for r in resumed.history] == [r["batch-size"] for r in full.history][3:]
    assert [r["learning-rate"] for r in resumed.history] == [r["learning-rate"] for r in full.history][3:]
    assert resumed.consumed_samples == full.consumed_samples


def test_a_new_micro_batch_count_saves_a_checkpoint_first(tmp_path):
    # Megatron saves when the number of micro-batches changes (with --save): here before
    # iterations 3 (2 -> 4), 4 (-> 6) and 5 (-> 8), plus the end of training.
    run(*RAMP, "--train-iters", 6, "--save", tmp_path / "c")
    saved = sorted(p.name for p in (tmp_path / "c").iterdir() if p.name.startswith("iter_"))
    assert saved == ["iter_0000002", "iter_0000003", "iter_0000004", "iter_0000006"]


DP_RAMP = ["--hidden-dropout", "0.0", "--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16"]


def _dp2_ramp(rank, world_size):
    trainer = pretrain(FLAGS + DP_RAMP + ["--train-iters", "6"])
    return [(r["batch-size"], r["lm loss"]) for r in trainer.history], trainer.consumed_samples


def test_data_parallel_ramp_follows_one_rank():
    """DP=2 takes 1, 1, 2, 3, 3, 3 micro-batches per rank where one rank takes twice as many: the
    same global batches, so the same losses up to the order of fp32 additions (1e-5 relative)."""
    one = run(*DP_RAMP, "--train-iters", 6)
    expected = [(r["batch-size"], r["lm loss"]) for r in one.history]
    assert [b for b, _ in expected] == [4, 4, 8, 12, 12, 12]
    results = run_distributed(_dp2_ramp, 2, timeout=240)
    for history, consumed in results:
        assert consumed == one.consumed_samples == 52
        assert [b for b, _ in history] == [b for b, _ in expected]
        for i, ((_, a), (_, b)) in enumerate(zip(history, expected)):
            assert abs(a - b) <= 1e-5 * abs(b), f"iteration {i + 1}: DP=2 {a} vs one rank {b}"


def test_census_step_schedule_config_trains_with_the_test_tokenizer(tmp_path):
    """gpt3_15b_8t_release as the census scales it (its SentencePiece tokenizer, W&B, checkpoint and
    layout flags swapped for the test GPT-2 vocabulary on one device): batches 4, 8, 12 as scheduled."""
    entry = census.CENSUS["gpt/gpt3_15b_8t_release"]
    args = dict(entry["MODEL_ARGS"], **{"--vocab-file": "${ASSETS}/vocab.json", "--merge-file": "${ASSETS}/merges.txt"})
    # One device's sizes (the census's are for TP 8), no checkpoints: the schedule is what is tested.
    args.update({"--log-interval": 1, "--hidden-size": 64, "--num-attention-heads": 4, "--num-query-groups": 2})
    drop = ("--tensor-model-parallel-size", "--sequence-parallel", "--tokenizer-type", "--tokenizer-model")
    drop += ("--wandb-project", "--wandb-entity", "--save", "--load", "--async-save", "--use-persistent-ckpt-worker")
    trainer = pretrain(census.argv_of(args, tmp_path, drop=drop))
    assert [r["batch-size"] for r in trainer.history] == [4, 4, 8, 8] + [12] * 6
    assert trainer.consumed_samples == 96 and all(math.isfinite(r["lm loss"]) for r in trainer.history)


PIPE_RAMP = [
    *"--num-layers 4 --hidden-dropout 0.0 --global-batch-size 12 --rampup-batch-size 4 4 16".split(),
    *"--train-iters 5 --lr-warmup-iters 1 --lr-decay-style cosine".split(),
]


def _pipeline_ramps(rank, world_size):
    out = {}
    for name, extra in (("pp2", []), ("pp2_vpp2", ["--num-virtual-stages-per-pipeline-rank", "2"])):
        trainer = pretrain(FLAGS + PIPE_RAMP + ["--pipeline-model-parallel-size", "2", *extra])
        out[name] = [(r["batch-size"], r["lm loss"]) for r in trainer.history]
    return out


def test_pipelined_schedules_follow_the_ramp():
    """1F1B and interleaved over two stages take 2, 2, 4, 6, 6 micro-batches per step: the losses
    of one process up to the order of fp32 additions (1e-5 relative)."""
    one = run(*PIPE_RAMP)
    expected = [(r["batch-size"], r["lm loss"]) for r in one.history]
    assert [b for b, _ in expected] == [4, 4, 8, 12, 12]
    last = run_distributed(_pipeline_ramps, 2, timeout=400)[1]  # the last stage logs the loss
    for name, history in last.items():
        assert [b for b, _ in history] == [b for b, _ in expected], name
        for i, ((_, a), (_, b)) in enumerate(zip(history, expected)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name}, iteration {i + 1}: {a} vs one process {b}"


def _interleaved_ramp_error(rank, world_size):
    argv = FLAGS + "--num-layers 4 --global-batch-size 8 --rampup-batch-size 2 2 8 --train-iters 4".split()
    argv += "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2".split()
    try:
        build_trainer(argv)
    except ValueError as e:
        return str(e)
    return None


def test_an_interleaved_ramp_size_that_cannot_run_fails_before_training():
    for message in run_distributed(_interleaved_ramp_error, 2, timeout=240):
        assert message is not None and message.startswith(
            "--rampup-batch-size: the global batch size 2 (1 micro-batches): the interleaved schedule needs"
        ), message

"""Megatron flags that the whole-parser inventory (census/upstream_flags.txt) brought in with their meaning:
--add-qkv-bias, --embedding-init-method-std, --eod-mask-loss, --exit-on-missing-checkpoint,
--encoder-num-layers, and the deprecated spellings Megatron still rewrites."""

import math
import warnings

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.datasets.builder import build_train_valid_test_datasets
from megatron.training.arguments import parse_args
from megatron.training.training import build_trainer

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 64 --num-workers 0 --log-interval 1"
)


def _model(extra: str):
    trainer = build_trainer(f"{FLAGS} {extra}".split())
    parallel_state.destroy(trainer.pg)
    return trainer.model.module, trainer


def test_add_qkv_bias_gives_the_qkv_projection_alone_a_bias():
    model, _ = _model("--disable-bias-linear --add-qkv-bias")
    names = [n for n, _ in model.named_parameters() if n.endswith("bias") and "norm" not in n]
    assert names and all("linear_qkv" in n for n in names), names
    plain, _ = _model("--disable-bias-linear")
    assert not [n for n, _ in plain.named_parameters() if n.endswith("bias") and "norm" not in n]


def test_embedding_init_method_std():
    model, _ = _model("--embedding-init-method-std 0.5 --init-method-std 0.01")
    emb = model.embedding.word_embeddings.weight
    assert 0.4 < emb.std().item() < 0.6
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.std().item() < 0.02


def test_eod_mask_loss_masks_end_of_document_inputs():
    cfg = parse_args(f"{FLAGS} --eod-mask-loss".split()).resolve()
    _, trainer = _model("--eod-mask-loss")
    train, _, _ = build_train_valid_test_datasets(
        cfg.data, trainer.tokenizer, seq_length=16, seed=1, num_samples=(20, 0, 0)
    )
    eod = trainer.tokenizer.eod
    seen = 0
    for i in range(20):
        s = train[i]
        at_eod = s["tokens"] == eod
        seen += int(at_eod.sum())
        assert torch.equal(s["loss_mask"][at_eod], torch.zeros(int(at_eod.sum())))
        assert torch.all(s["loss_mask"][~at_eod] == 1)
    assert seen > 0, "the mock documents should contain end-of-document tokens"


def test_exit_on_missing_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = f"{FLAGS} --save {save} --load {save}".split()
    with pytest.raises(ValueError, match="--exit-on-missing-checkpoint asks for one"):
        build_trainer([*argv, "--exit-on-missing-checkpoint"])
    trainer = build_trainer(argv)  # without it, the resume idiom trains from scratch
    parallel_state.destroy(trainer.pg)
    trainer.close()


def test_older_spellings():
    assert parse_args(["--encoder-num-layers", "5"]).model.num_layers == 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = parse_args(["--use-rotary-position-embeddings", "--no-weight-decay-cond-type=apply_wd_to_qk_layernorm"])
    assert cfg.model.position_embedding_type == "rope" and cfg.optimizer.apply_wd_to_qk_layernorm
    assert len([w for w in caught if "deprecated" in str(w.message)]) == 2
    with pytest.raises(ValueError, match="--no-weight-decay-cond-type 'qwen' is not valid"):
        parse_args(["--no-weight-decay-cond-type", "qwen"])
    for flag, words in (("--batch-size", "use --micro-batch-size"), ("--warmup", "use --lr-warmup-fraction")):
        with pytest.raises(ValueError, match=words):
            parse_args([flag, "4"])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_no_save_optim_and_rng(tmp_path, fmt):
    """Checkpoints without optimizer/schedule and RNG state; loading one asks for the matching
    --no-load-* flag, and with them resumes at the saved iteration from the saved weights."""
    save = str(tmp_path / "ckpt")
    base = f"{FLAGS} --ckpt-format {fmt} --save {save}".split()
    trainer = build_trainer([*base, "--no-save-optim", "--no-save-rng"])
    trainer.train()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    parallel_state.destroy(trainer.pg)
    trainer.close()
    if fmt == "torch":
        state = torch.load(f"{save}/iter_0000002/mp_rank_00/model_optim_rng.pt", weights_only=True)
        assert not {"optimizer", "opt_param_scheduler", "rng_state"} & set(state) and "model" in state
    for extra, words in (([], "load it with --no-load-optim --no-load-rng"), (["--no-load-optim"], "--no-load-rng")):
        with pytest.raises(ValueError, match=words):
            build_trainer([*base, "--load", save, "--train-iters", "3", *extra])
    trainer = build_trainer([*base, "--load", save, "--train-iters", "3", "--no-load-optim", "--no-load-rng"])
    try:
        assert trainer.iteration == 2
        for k, v in trainer.model.state_dict().items():
            assert torch.equal(v, weights[k]), k
    finally:
        parallel_state.destroy(trainer.pg)
        trainer.close()


def test_reset_position_ids_reaches_the_dataset():
    cfg = parse_args(f"{FLAGS} --reset-position-ids".split()).resolve()
    _, trainer = _model("--reset-position-ids")
    train, _, _ = build_train_valid_test_datasets(
        cfg.data, trainer.tokenizer, seq_length=16, seed=1, num_samples=(20, 0, 0)
    )
    restarted = 0
    for i in range(20):
        s = train[i]
        positions, after_eod = s["position_ids"], torch.nonzero(s["tokens"][:-1] == trainer.tokenizer.eod)
        for j in after_eod.flatten().tolist():
            assert positions[j + 1] == 0
            restarted += 1
    assert restarted > 0


def test_legacy_model_switches_are_accepted_and_change_nothing():
    """Megatron's core models never read --openai-gelu or --apply-residual-connection-post-layernorm."""
    flags = ["--openai-gelu", "--apply-residual-connection-post-layernorm"]
    with_them, without = parse_args(FLAGS.split() + flags), parse_args(FLAGS.split())
    assert with_them.ignored_flags == flags
    with_them.ignored_flags = without.ignored_flags = []
    with_them.given_fields = without.given_fields = []
    assert with_them == without


def _jsonl(path) -> dict[int, dict]:
    import json

    return {r["iteration"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_iterations_to_skip_drop_their_batch_and_train_nothing(tmp_path):
    """Megatron's --iterations-to-skip: the batch of a skipped iteration is read and dropped; no step, no LR
    step, no log line. The next iteration trains on the batch after it, as the run without the skip does."""
    common = FLAGS.split() + "--train-iters 5 --global-batch-size 4 --hidden-dropout 0 --attention-dropout 0".split()
    plain, skipping = tmp_path / "plain.jsonl", tmp_path / "skip.jsonl"
    whole = build_trainer(common + ["--metrics-file", str(plain)])
    whole.history = whole.train()
    parallel_state.destroy(whole.pg)
    trainer = build_trainer(common + ["--iterations-to-skip", "2", "3", "--metrics-file", str(skipping)])
    trainer.history = trainer.train()
    parallel_state.destroy(trainer.pg)
    got, want = _jsonl(skipping), _jsonl(plain)
    assert sorted(got) == [1, 4, 5]
    assert got[1]["lm loss"] == want[1]["lm loss"]
    assert trainer.consumed_samples == 5 * 4 and trainer.state.skipped_train_samples == 2 * 4
    assert trainer.scheduler.num_steps == 3  # the schedule moved on three steps, not five
    assert got[4]["learning-rate"] == pytest.approx(trainer.scheduler.get_lr(2))  # as Megatron logs it
    assert got[4]["lm loss"] != want[4]["lm loss"]  # the weights of one step on the batch of iteration 4


def _dp_random_init_run(rank, world_size, argv):
    trainer = build_trainer(argv)
    weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, weights)
    trainer.history = trainer.train()
    parallel_state.destroy(trainer.pg)
    return all(torch.equal(g, gathered[0]) for g in gathered), [r["lm loss"] for r in trainer.history]


def test_data_parallel_random_init_changes_dropout_per_rank_not_the_weights():
    from tests.unit_tests.dist_utils import run_distributed

    argv = FLAGS.split() + "--train-iters 3 --global-batch-size 4 --micro-batch-size 2 --attention-dropout 0".split()
    (same_w, with_dropout), _ = run_distributed(_dp_random_init_run, 2, argv + ["--hidden-dropout", "0.5"])
    (same_w2, per_rank), _ = run_distributed(
        _dp_random_init_run, 2, argv + ["--hidden-dropout", "0.5", "--data-parallel-random-init"]
    )
    assert same_w and same_w2  # the initial weights are the same on both ranks
    assert per_rank[0] != with_dropout[0]  # rank 1 drew other dropout masks
    (_, no_dropout), _ = run_distributed(_dp_random_init_run, 2, argv + ["--hidden-dropout", "0"])
    (_, no_dropout_flag), _ = run_distributed(
        _dp_random_init_run, 2, argv + ["--hidden-dropout", "0", "--data-parallel-random-init"]
    )
    assert no_dropout_flag == no_dropout  # without random draws in the step, the flag changes nothing


def test_padded_vocab_size_and_no_pad_vocab_size():
    from megatron.training.data import model_vocab_size

    def rows(extra):
        model, _ = _model(extra)
        return model.embedding.word_embeddings.weight.shape[0]

    assert rows("") == 128  # --vocab-size 64 padded to --make-vocab-size-divisible-by 128
    assert rows("--padded-vocab-size 100") == 100
    assert rows("--no-pad-vocab-size") == rows("--disable-pad-vocab-size") == 64
    with pytest.raises(ValueError, match=r"--padded-vocab-size 32 is smaller than the tokenizer's vocabulary \(64\)"):
        _model("--padded-vocab-size 32")
    d = parse_args(f"{FLAGS} --padded-vocab-size 101".split()).data
    with pytest.raises(ValueError, match="--padded-vocab-size 101 does not split over --tensor-model-parallel-size 2"):
        model_vocab_size(d, 64, 2)


def test_null_tokenizer_eod_and_pad_ids():
    cfg = parse_args(f"{FLAGS} --null-tokenizer-eod-id 0 --null-tokenizer-pad-id 5".split()).resolve()
    _, trainer = _model("--null-tokenizer-eod-id 0 --null-tokenizer-pad-id 5")
    assert (trainer.tokenizer.eod, trainer.tokenizer.pad) == (0, 5)
    train, _, _ = build_train_valid_test_datasets(
        cfg.data, trainer.tokenizer, seq_length=16, seed=1, num_samples=(40, 0, 0)
    )
    samples = [train[i] for i in range(40)]
    assert any((s["tokens"] == 0).any() for s in samples)  # documents end with id 0
    for s in samples:  # id 5 is padding: out of the loss, fed as 0
        assert not (s["labels"] == 5).any() and not (s["tokens"] == 5).any()
    assert any((s["loss_mask"] == 0).any() for s in samples)
    with pytest.raises(ValueError, match=r"--null-tokenizer-eod-id 64 is outside \[0, --vocab-size 64\)"):
        _model("--null-tokenizer-eod-id 64")


def test_decrease_batch_size_if_needed():
    argv = FLAGS.split() + "--micro-batch-size 2 --global-batch-size 10".split()
    with pytest.warns(UserWarning, match="decreasing batch size from 10 to 8"):
        cfg = parse_args(argv + ["--decrease-batch-size-if-needed"]).resolve(world_size=4)  # 2 x 4 per step
    cfg.validate()
    assert cfg.training.global_batch_size == 8 and cfg.num_microbatches == 1
    with pytest.raises(ValueError, match=r"--global-batch-size \(10\) must be divisible"):
        parse_args(argv).resolve(world_size=4).validate()
    with pytest.raises(ValueError, match="Cannot specify both --step-batch-size-schedule"):
        parse_args(argv + "--decrease-batch-size-if-needed --step-batch-size-schedule 0:10".split()).resolve()


def test_pipeline_comm_backend_nccl_is_accepted_other_backends_not():
    cfg = parse_args(FLAGS.split() + ["--pipeline-model-parallel-comm-backend", "nccl"])
    assert cfg.ignored_flags == ["--pipeline-model-parallel-comm-backend"]
    with pytest.raises(ValueError, match="--pipeline-model-parallel-comm-backend ucc is not supported"):
        parse_args(FLAGS.split() + ["--pipeline-model-parallel-comm-backend", "ucc"])


def test_llama4_attention_flags_train():
    from megatron.training.training import pretrain

    trainer = pretrain(FLAGS.split() + "--position-embedding-type rope --qk-l2-norm --no-rope-freq 2".split())
    assert all(math.isfinite(r["lm loss"]) for r in trainer.history)
    layers = trainer.model.module.decoder.layers
    assert [layer.self_attention.skips_rope for layer in layers] == [False, True]


def test_phase_transition_iterations(tmp_path, capsys):
    """A data phase ends with a save and a stop; the next launch builds its own training data and reads it
    from the first sample (Megatron's --phase-transition-iterations)."""
    import json

    from megatron.training.data import build_data_iterators
    from megatron.training.training import pretrain

    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    flags = FLAGS.split() + "--train-iters 4 --phase-transition-iterations 2".split()  # the last --train-iters wins
    first = pretrain(flags + ["--save", str(save), "--metrics-file", str(metrics)])
    assert first.iteration == 2 and "exiting at iteration 2: the end of a data phase" in capsys.readouterr().out
    second = pretrain(flags + ["--save", str(save), "--load", str(save), "--metrics-file", str(metrics)])
    assert second.iteration == 4
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]

    trainer = build_trainer(flags)
    try:
        cfg, gbs = trainer.cfg, trainer.cfg.training.global_batch_size
        phase = build_data_iterators(cfg, trainer.tokenizer, trainer.pg, 2 * gbs).train
        own = build_train_valid_test_datasets(
            cfg.data, trainer.tokenizer, seq_length=16, seed=cfg.training.seed, num_samples=(2 * gbs, 0, 0)
        )[0]
        assert torch.equal(next(phase)["tokens"], torch.stack([own[i]["tokens"] for i in range(2)]))
    finally:
        parallel_state.destroy(trainer.pg)
    with pytest.raises(ValueError, match="--phase-transition-iterations 'a,b': expected iterations"):
        _model("--phase-transition-iterations a,b")


def test_save_params_and_wgrads_intervals(tmp_path):
    """Megatron's debug dumps: every parameter after the step and every reduced main gradient before it.
    With plain SGD (no momentum, decay or clipping) the dumps must satisfy p_n = p_(n-1) - lr * g_n."""
    from types import SimpleNamespace

    from megatron.training.tensor_dumps import dump_name
    from megatron.training.training import pretrain

    save = tmp_path / "ckpt"
    sgd = "--optimizer sgd --sgd-momentum 0 --weight-decay 0 --clip-grad 0 --lr 0.1 --lr-decay-style constant"
    flags = f"{FLAGS} {sgd} --train-iters 3 --save {save} --save-params-interval 1 --save-wgrads-interval 1"
    trainer = pretrain(flags.split())

    def load(label, n):
        return torch.load(save / label / f"iter_{n:07d}" / "mp_rank_00.pth", weights_only=True)["model_chunk0"]

    final = dict(trainer.model.module.named_parameters())
    assert set(load("params", 3)) == set(final)
    assert all(torch.equal(load("params", 3)[k], final[k].detach()) for k in final)
    for n in (2, 3):
        before, after, grads = load("params", n - 1), load("params", n), load("wgrads", n)
        for k in final:
            torch.testing.assert_close(after[k], before[k] - 0.1 * grads[k], rtol=1e-5, atol=1e-7)
    pg = SimpleNamespace(tp_rank=1, pp_rank=2, pp_size=4, ep_rank=3, ep_size=8)
    assert dump_name(pg) == "mp_rank_01_002_003.pth"
    with pytest.raises(ValueError, match="--save-params-interval 2 needs --save"):
        _model("--save-params-interval 2")

"""--ckpt-format torch_dist: layout, a second launch of the same command resumes, formats, strictness."""

import os

import pytest
import torch

from megatron.training.training import pretrain

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 --lr-decay-style cosine --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0 --log-interval 1 --attention-dropout 0.0 "
    "--hidden-dropout 0.1 --seed 1234 --train-iters 4 --save-interval 2 --bf16"
).split()


def losses(trainer):
    return [r["lm loss"] for r in trainer.history]


@pytest.mark.parametrize("extra", [[], ["--async-save", "--use-persistent-ckpt-worker"]], ids=["sync", "async"])
def test_second_launch_of_the_same_command_resumes(tmp_path, extra):
    ckpt = ["--save", str(tmp_path / "a"), "--load", str(tmp_path / "a")]
    whole = pretrain(FLAGS + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")] + extra)
    first = pretrain(FLAGS + ckpt + extra + ["--exit-interval", "2"])  # stops after the save at 2
    assert first.iteration == 2
    second = pretrain(FLAGS + ckpt + extra)  # the same command line: loads iteration 2
    assert [r["iteration"] for r in second.history] == [3, 4]
    assert losses(first) + losses(second) == losses(whole)  # bitwise: RNG, optimizer, schedule restored
    folder = tmp_path / "a" / "iter_0000004"
    assert (folder / ".metadata").is_file() and (folder / "common.pt").is_file()
    assert (tmp_path / "a" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert not [p for p in os.listdir(tmp_path / "a") if ".tmp-" in p]


def test_keys_are_global_parameter_names(tmp_path):
    import torch.distributed.checkpoint as dcp

    pretrain(FLAGS + ["--save", str(tmp_path), "--train-iters", "2"])
    keys = set(dcp.FileSystemReader(str(tmp_path / "iter_0000002")).read_metadata().state_dict_metadata)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert "model." + name in keys
    # The optimizer state by parameter name (layout-free), with the fp32 copies of the bf16 weights.
    for what in ("exp_avg", "exp_avg_sq", "step", "fp32_param"):
        assert f"optimizer.state.{what}.{name}" in keys
    assert not [k for k in keys if not k.startswith(("model.", "optimizer.state."))]


def test_format_mismatch_needs_auto_detect(tmp_path):
    pretrain(FLAGS + ["--save", str(tmp_path), "--train-iters", "2", "--ckpt-format", "torch"])
    with pytest.raises(ValueError, match="is a torch checkpoint but --ckpt-format is torch_dist"):
        pretrain(FLAGS + ["--load", str(tmp_path)])
    trainer = pretrain(FLAGS + ["--load", str(tmp_path), "--auto-detect-ckpt-format"])
    assert trainer.cfg.checkpoint.ckpt_format == "torch"
    assert [r["iteration"] for r in trainer.history] == [3, 4]


def test_checkpoint_of_another_model_is_refused(tmp_path):
    pretrain(FLAGS + ["--save", str(tmp_path), "--train-iters", "2"])
    # Untied output layer: the checkpoint lacks output_layer.weight.
    other = FLAGS + ["--load", str(tmp_path), "--untie-embeddings-and-output-weights"]
    with pytest.raises(ValueError):
        pretrain(other)


def test_async_save_copies_before_training_changes_weights(tmp_path):
    trainer = pretrain(FLAGS + ["--save", str(tmp_path), "--async-save", "--train-iters", "2", "--save-interval", "1"])
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: torch.empty_like(v) for k, v in trainer.model.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(tmp_path / "iter_0000002"), no_dist=True)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(state["model"][k], v), k


def _dp2_resume(rank, world_size, folder):
    flags = [f for f in FLAGS if f != "--bf16"] + ["--global-batch-size", "8", "--async-save"]
    full = pretrain(flags)
    ckpt = ["--save", folder, "--load", folder]
    pretrain(flags + ckpt + ["--exit-interval", "2"])
    resumed = pretrain(flags + ckpt)
    return losses(full), losses(resumed)


def test_data_parallel_async_save_and_resume(tmp_path):
    from tests.unit_tests.dist_utils import run_distributed

    results = run_distributed(_dp2_resume, 2, str(tmp_path / "c"), timeout=300)
    for full, resumed in results:
        assert resumed == full[2:]
    assert (tmp_path / "c" / "latest_checkpointed_iteration.txt").read_text() == "4"


def _reordered_gpt(cfg, vocab_size, pg, device):
    """The GPT model with its submodules registered in another order: every parameter keeps
    its name, but the parameter order (and so the optimizer's) changes."""
    from megatron.training.training import default_model_provider

    model = default_model_provider(cfg, vocab_size, pg, device)
    first = next(iter(model._modules))
    model._modules[first] = model._modules.pop(first)  # registered last now
    return model


def test_optimizer_state_is_keyed_by_parameter_name(tmp_path):
    import torch.distributed.checkpoint as dcp

    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    saved = pretrain(FLAGS + ["--save", str(tmp_path), "--train-iters", "2"])
    keys = set(dcp.FileSystemReader(str(tmp_path / "iter_0000002")).read_metadata().state_dict_metadata)
    assert "optimizer.state.exp_avg.decoder.layers.0.self_attention.linear_qkv.weight" in keys
    assert "optimizer.state.fp32_param.embedding.word_embeddings.weight" in keys

    loaded = build_trainer(FLAGS + ["--load", str(tmp_path), "--train-iters", "2"], model_provider=_reordered_gpt)
    parallel_state.destroy(loaded.pg)
    order = lambda t: [n for n, _ in t.model.module.named_parameters()]  # noqa: E731
    assert order(loaded) != order(saved) and sorted(order(loaded)) == sorted(order(saved))

    def by_name(trainer):
        opt = trainer.optimizer
        names = {id(p): n for n, p in trainer.model.module.named_parameters()}
        out = {}
        for param, main in zip(opt.model_params, opt.main_params):
            st = opt.optimizer.state[main]
            out[names[id(param)]] = (main, st["exp_avg"], st["exp_avg_sq"], param)
        return out

    a, b = by_name(saved), by_name(loaded)
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert torch.equal(x, y), name

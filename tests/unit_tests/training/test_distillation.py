"""Knowledge distillation (``--export-kd-teacher-load``, ``--export-kd-cfg``): ModelOpt's losses and rules.

The losses are checked against their definitions (float64), the tensor-parallel KL against one
process, the balancer's rules by value, and whole runs: a teacher equal to the student's start
gives a zero logits loss, a run resumes bitwise, DP = 2, TP = 2 and TP = 2 with sequence
parallelism follow one process within 1e-5 relative (fp32; the sums run in another order).
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.training import distillation
from megatron.training.arguments import parse_args
from megatron.training.distillation import KDSettings, balance, hidden_loss, logits_kl
from megatron.training.training import build_trainer
from tests.unit_tests.dist_utils import run_distributed

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 1 --lr-decay-iters 40 --seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1"
)
UPSTREAM_CFG = (  # upstream's gpt3_mcore_te_tp2_pp1_modelopt_distill_resume writes this file
    'intermediate_layer_pairs: [["decoder.final_layernorm", "decoder.final_layernorm"]]\n'
    'logit_layers: ["output_layer", "output_layer"]\nskip_lm_loss: true\nkd_loss_scale: 1.0\n'
)


def _argv(extra: str) -> list[str]:
    return f"{FLAGS} {extra}".split()


def _train(argv: list[str]):
    """Trains through build_trainer; returns the per-iteration records."""
    trainer = build_trainer(argv)
    try:
        return trainer.train()
    finally:
        trainer.graphs.close()
        parallel_state.destroy(trainer.pg)


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A trained teacher in each format, one with 3 layers, and one equal to the student's start (lr 0)."""
    root = tmp_path_factory.mktemp("teachers")
    out = {}
    for name, extra in {
        "torch_dist": "--train-iters 30 --lr 1e-2",  # far from the student's start: a KL of order 1
        "torch": "--train-iters 30 --lr 1e-2 --ckpt-format torch",
        "three_layers": "--train-iters 3 --num-layers 3 --ffn-hidden-size 64",
        "untrained": "--train-iters 1 --lr 0 --min-lr 0",
    }.items():
        out[name] = str(root / name)
        _train(_argv(f"{extra} --save {out[name]}"))
    return out


# ---------------------------------------------------------------------------- the YAML


def test_settings_defaults_and_both_spellings(tmp_path):
    default = KDSettings.from_file(None)
    assert default.logit_layers == ("output_layer", "output_layer") and not default.intermediate_layer_pairs
    assert default.skips_lm_loss and default.logit_kl_temperature == 1.0
    old = KDSettings.from_file(_write(tmp_path / "old.yaml", UPSTREAM_CFG + "logit_kl_temperature: 2.0\n"))
    assert old.intermediate_layer_pairs == (("decoder.final_layernorm", "decoder.final_layernorm", "cosine"),)
    assert old.skips_lm_loss and old.kd_loss_alpha is None and old.logit_kl_temperature == 2.0
    new = KDSettings.from_file(
        _write(tmp_path / "new.yaml", "kd_loss_alpha: 0.5\nintermediate_layer_pairs: [[a, b, mse]]\n")
    )
    assert new.kd_loss_alpha == 0.5 and not new.skips_lm_loss and new.intermediate_layer_pairs == (("a", "b", "mse"),)
    assert KDSettings.from_file(_write(tmp_path / "one.yaml", "kd_loss_alpha: 1.0\n")).skips_lm_loss


@pytest.mark.parametrize(
    "text, words",
    [
        ("kd_loss_alpha: 0.5\nskip_lm_loss: false\n", "give one of them"),
        ("kd_loss_alpha: 1.5\n", "kd_loss_alpha must be in [0, 1]"),
        ("logit_kl_temperature: 0\n", "logit_kl_temperature must be > 0"),
        ("intermediate_layer_pairs: [[a, b, huber]]\n", "unknown intermediate loss 'huber'"),
        ("intermediate_layer_pairs: [[a]]\n", "[student, teacher(, cosine|mse)]"),
        ("logit_layers: [output_layer]\n", "logit_layers must be [student module, teacher module]"),
        ("logit_kl_topk: 64\n", "top-k logit distillation) is not supported yet"),
        ("skip_lm_los: true\n", "unknown field(s) ['skip_lm_los']"),
        ("- a\n- b\n", "must be a YAML mapping"),
        ("a: [\n", "is not valid YAML"),
    ],
)
def test_settings_errors_name_the_file_and_field(tmp_path, text, words):
    path = _write(tmp_path / "kd.yaml", text)
    with pytest.raises(ValueError) as e:
        KDSettings.from_file(path)
    assert path in str(e.value) and words in str(e.value)


# ---------------------------------------------------------------------------- the losses


def test_logits_kl_is_kl_of_teacher_to_student_at_the_temperature():
    g = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(5, 3, 11, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    for t in (1.0, 2.5):
        want = F.kl_div(
            F.log_softmax(student / t, -1), F.log_softmax(teacher / t, -1), reduction="none", log_target=True
        )
        torch.testing.assert_close(logits_kl(student, teacher, t), want.sum(-1), rtol=1e-12, atol=1e-12)
    assert torch.equal(logits_kl(teacher, teacher, 1.0), torch.zeros(5, 3, dtype=torch.float64))


def test_hidden_losses():
    g = torch.Generator().manual_seed(1)
    a, b = (
        torch.randn(4, 2, 8, generator=g, dtype=torch.float64),
        torch.randn(4, 2, 8, generator=g, dtype=torch.float64),
    )
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    torch.testing.assert_close(hidden_loss(a, b, "cosine"), 1 - cos, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hidden_loss(a, b, "mse"), ((a - b) ** 2).mean(-1), rtol=1e-12, atol=1e-12)
    assert hidden_loss(a, 2 * a, "cosine").abs().max() < 1e-12  # direction only


def _kl_tp_rank(rank, world_size, student, teacher):
    """Each rank its vocabulary shard: the summed per-token KL and the shard's gradient of its sum."""
    import torch.distributed as dist

    width = student.shape[-1] // world_size
    mine = student[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    part = logits_kl(mine, teacher[..., rank * width : (rank + 1) * width], 2.0, dist.group.WORLD)
    total = part.detach().clone()
    dist.all_reduce(total)
    part.sum().backward()
    return total, mine.grad


def test_tensor_parallel_kl_and_gradient_equal_one_process():
    g = torch.Generator().manual_seed(2)
    student, teacher = (torch.randn(4, 2, 12, generator=g, dtype=torch.float64) * 4 for _ in range(2))
    full = student.clone().requires_grad_(True)
    want = logits_kl(full, teacher, 2.0)
    want.sum().backward()
    got = run_distributed(_kl_tp_rank, 2, student, teacher)
    for rank, (total, grad) in enumerate(got):
        torch.testing.assert_close(total, want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, full.grad[..., rank * 6 : (rank + 1) * 6], rtol=1e-12, atol=1e-12)


def test_balancer_rules():
    lm, logits, inter = torch.tensor(3.0), torch.tensor(0.5), [torch.tensor(0.1), torch.tensor(0.3)]
    skip = KDSettings()
    total, mean = balance(skip, lm, logits, inter)
    assert mean.item() == pytest.approx(0.2) and total.item() == pytest.approx(1.0)  # 0.5 + 0.2 * (0.5 / 0.2)
    assert balance(skip, lm, logits, [])[0].item() == 0.5
    assert balance(skip, lm, logits, [torch.tensor(0.0)])[0].item() == 0.5  # a zero intermediate adds nothing
    old = KDSettings(skip_lm_loss=False, kd_loss_scale=2.0)  # lm + scale * kd rescaled to lm
    assert balance(old, lm, logits, inter)[0].item() == pytest.approx(3.0 + 2.0 * 3.0)
    alpha = KDSettings(kd_loss_alpha=0.25)
    assert balance(alpha, lm, logits, inter)[0].item() == pytest.approx(0.75 * 3.0 + 0.25 * 1.0)
    # The rescaling factors are constants: the gradient reaches the intermediate loss times logits / mean.
    x = torch.tensor(0.2, requires_grad=True)
    balance(skip, lm, logits, [x])[0].backward()
    assert x.grad.item() == pytest.approx(0.5 / 0.2)


# ---------------------------------------------------------------------------- whole runs


def test_a_teacher_equal_to_the_student_gives_zero_logits_loss(teachers, tmp_path):
    cfg = _write(tmp_path / "kd.yaml", UPSTREAM_CFG)
    history = _train(_argv(f"--train-iters 3 --export-kd-teacher-load {teachers['untrained']} --export-kd-cfg {cfg}"))
    first = history[0]
    assert first["logits distillation loss"] == 0.0 and first["lm loss"] == 0.0  # skipped: reported as 0
    assert first["intermediate distillation loss"] < 1e-6  # 1 - cos of equal vectors, up to rounding
    assert [set(r) >= {"total loss", "lm loss"} for r in history] == [True] * 3


def test_torch_teacher_with_upstreams_config_flags_trains(teachers, tmp_path):
    """Upstream's distillation config's own switches: --export-te-mcore-model, --auto-detect-ckpt-format."""
    cfg = _write(tmp_path / "kd.yaml", UPSTREAM_CFG)
    extra = f"--export-te-mcore-model --auto-detect-ckpt-format --export-kd-teacher-load {teachers['torch']}"
    history = _train(_argv(f"--train-iters 30 {extra} --export-kd-cfg {cfg}"))
    total = [r["total loss"] for r in history]
    assert all(r["lm loss"] == 0.0 for r in history)
    assert sum(total[-5:]) < 0.7 * sum(total[:5]), total  # the student moves towards the teacher
    for r in history:  # with one intermediate pair the total is twice the logits loss
        assert r["total loss"] == pytest.approx(2 * r["logits distillation loss"], rel=1e-6)


def test_lm_loss_combinations(teachers, tmp_path):
    load = f"--export-kd-teacher-load {teachers['torch_dist']}"
    old = _write(tmp_path / "old.yaml", "skip_lm_loss: false\nkd_loss_scale: 1.0\n")
    for r in _train(_argv(f"--train-iters 2 {load} --export-kd-cfg {old}")):
        assert r["lm loss"] > 1.0 and r["total loss"] == pytest.approx(2 * r["lm loss"], rel=1e-6)
    alpha = _write(tmp_path / "alpha.yaml", "kd_loss_alpha: 0.5\n")
    for r in _train(_argv(f"--train-iters 2 {load} --export-kd-cfg {alpha}")):
        want = 0.5 * r["lm loss"] + 0.5 * r["logits distillation loss"]
        assert r["total loss"] == pytest.approx(want, rel=1e-6)


def test_evaluation_reports_the_students_lm_loss(teachers):
    trainer = build_trainer(_argv(f"--train-iters 1 --export-kd-teacher-load {teachers['torch_dist']}"))
    try:
        batch = {
            "tokens": torch.randint(0, 255, (2, 16)),
            "labels": torch.randint(0, 255, (2, 16)),
            "loss_mask": torch.ones(2, 16),
            "position_ids": torch.arange(16).expand(2, 16),
        }
        trainer.model.eval()
        with torch.no_grad():
            loss, metrics = trainer.forward_step(batch, trainer.model)
        per_token = trainer.model(batch["tokens"], batch["position_ids"], batch["labels"])
        assert loss.item() == pytest.approx(per_token.mean().item(), rel=1e-6) and loss.item() > 1.0
        assert metrics["lm loss"].item() == pytest.approx(loss.item())
    finally:
        parallel_state.destroy(trainer.pg)


def test_resume_is_bitwise_and_checkpoints_hold_the_student_alone(teachers, tmp_path):
    kd = f"--export-kd-teacher-load {teachers['torch_dist']} --export-kd-cfg {_write(tmp_path / 'kd.yaml', UPSTREAM_CFG)}"
    whole = _train(_argv(f"--train-iters 6 {kd}"))
    save = str(tmp_path / "student")
    first = _train(_argv(f"--train-iters 6 --exit-interval 3 {kd} --save {save} --ckpt-format torch"))
    second = _train(_argv(f"--train-iters 6 {kd} --save {save} --load {save} --ckpt-format torch"))
    assert [r["total loss"] for r in first + second] == [r["total loss"] for r in whole]
    state = torch.load(os.path.join(save, "iter_0000006", "mp_rank_00", "model_optim_rng.pt"), weights_only=True)
    plain = build_trainer(_argv("--train-iters 1"))  # the same student without distillation
    try:
        assert set(state["model"]) == set(plain.model.state_dict())
    finally:
        parallel_state.destroy(plain.pg)


def test_teacher_model_config_overrides_the_students_flags(teachers, tmp_path):
    load = f"--export-kd-teacher-load {teachers['three_layers']}"
    with pytest.raises(ValueError, match="num_layers"):
        _train(_argv(f"--train-iters 1 {load}"))  # built as the student (2 layers): the checkpoint does not fit
    model_cfg = _write(tmp_path / "teacher.yaml", "num_layers: 3\nffn_hidden_size: 64\n")
    history = _train(_argv(f"--train-iters 2 {load} --export-kd-teacher-model-config {model_cfg}"))
    assert len(history) == 2 and history[0]["logits distillation loss"] > 0
    bad = _write(tmp_path / "bad.yaml", "num_layer: 3\n")
    with pytest.raises(ValueError, match=r"'num_layer' is not a model flag here"):
        _train(_argv(f"--train-iters 1 {load} --export-kd-teacher-model-config {bad}"))


@pytest.mark.parametrize(
    "extra, words",
    [
        ("--export-kd-cfg {cfg}", "configure distillation, which --export-kd-teacher-load turns on"),
        ("--export-kd-teacher-load {missing}", "is not a folder"),
        ("--export-kd-teacher-load {teacher} --export-kd-teacher-ckpt-format torch", "is a torch_dist checkpoint"),
        ("--export-kd-teacher-load {teacher} --export-kd-teacher-ckpt-format torch_dcp", "torch_dcp is not supported"),
        ("--export-kd-teacher-load {teacher} --cuda-graph-impl local", "--cuda-graph-impl is not supported yet"),
        (
            "--export-kd-teacher-load {teacher} --export-kd-cfg {badname}",
            "the student has no module 'decoder.final_norm'",
        ),
    ],
)
def test_bad_input_is_named(teachers, tmp_path, extra, words):
    cfg = _write(tmp_path / "kd.yaml", UPSTREAM_CFG)
    badname = _write(
        tmp_path / "badname.yaml", "intermediate_layer_pairs: [[decoder.final_norm, decoder.final_layernorm]]\n"
    )
    text = extra.format(cfg=cfg, missing=tmp_path / "nope", teacher=teachers["torch_dist"], badname=badname)
    with pytest.raises(ValueError, match=None) as e:
        _train(_argv(f"--train-iters 1 {text}"))
    assert words in str(e.value)


def test_pipeline_parallel_distillation_is_not_supported_yet(teachers):
    cfg = parse_args(
        _argv(f"--train-iters 1 --pipeline-model-parallel-size 2 --export-kd-teacher-load {teachers['torch_dist']}")
    )
    cfg = cfg.resolve(2)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size > 1 is not supported yet"):
        cfg.validate()


def _layouts(rank, world_size, argvs):
    return {name: [(r["total loss"], r["grad-norm"]) for r in _train(argv)] for name, argv in argvs.items()}


def test_parallel_layouts_follow_one_process(teachers, tmp_path):
    cfg = _write(tmp_path / "kd.yaml", UPSTREAM_CFG)
    base = f"--train-iters 6 --export-kd-teacher-load {teachers['torch_dist']} --export-kd-cfg {cfg}"
    one = run_distributed(_layouts, 1, {"one": _argv(base)})[0]["one"]
    layouts = {
        "dp2": _argv(base),
        "tp2": _argv(f"{base} --tensor-model-parallel-size 2"),
        "tp2_sp": _argv(f"{base} --tensor-model-parallel-size 2 --sequence-parallel"),
    }
    got = run_distributed(_layouts, 2, layouts, timeout=300)
    for name in layouts:
        for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got[0][name], one)):
            assert loss == pytest.approx(ref_loss, rel=1e-5), f"{name}, iteration {i + 1}: total loss"
            assert norm == pytest.approx(ref_norm, rel=1e-5), f"{name}, iteration {i + 1}: grad norm"
        assert got[1][name] == got[0][name]  # every rank reports the same means


def test_metrics_file_holds_the_reported_losses(teachers, tmp_path):
    metrics = tmp_path / "m.jsonl"
    _train(_argv(f"--train-iters 2 --export-kd-teacher-load {teachers['torch_dist']} --metrics-file {metrics}"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [sorted(k for k in r if "loss" in k and k != "loss-scale") for r in rows] == [
        ["intermediate distillation loss", "lm loss", "logits distillation loss", "total loss"]
    ] * 2
    assert distillation.TOTAL_LOSS in rows[0]


def test_per_token_loss_reports_the_same_means(teachers, tmp_path):
    """--calculate-per-token-loss: the reported losses are token sums divided by the global token count;
    with every token counted (mock data, no masking) they equal the mean of the micro-batch means."""
    kd = f"--train-iters 2 --export-kd-teacher-load {teachers['torch_dist']} --export-kd-cfg "
    kd += _write(tmp_path / "kd.yaml", UPSTREAM_CFG)
    plain, per_token = _train(_argv(kd)), _train(_argv(f"{kd} --calculate-per-token-loss"))
    first, second = plain[0], per_token[0]  # iteration 1: the same weights either way
    for name in ("total loss", "logits distillation loss", "intermediate distillation loss"):
        assert second[name] == pytest.approx(first[name], rel=1e-6), name
    assert second["lm loss"] == 0.0

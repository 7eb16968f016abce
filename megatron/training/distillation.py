"""Knowledge distillation: a frozen teacher's outputs as the student's training target.

Megatron does this through NVIDIA ModelOpt (``--export-kd-teacher-load``,
``--export-kd-cfg``); here it is native, with ModelOpt's losses and defaults:

- **Logits:** the KL divergence ``KL(teacher || student)`` of the softmaxes of both
  models' ``output_layer`` outputs divided by ``logit_kl_temperature``, summed over the
  vocabulary (the normaliser is taken over every tensor-parallel vocabulary shard).
- **Intermediate pairs** (``intermediate_layer_pairs``: student module, teacher module,
  optionally ``cosine`` (default) or ``mse``): ``1 - cos`` of the two outputs per token,
  or their mean squared difference. Their mean is rescaled to the logits loss's
  magnitude (a detached factor) before it is added to it.
- **Balance with the lm loss.** ``kd_loss_alpha`` (ModelOpt's current field; 1, the
  default, skips the lm loss): ``(1 - alpha) lm + alpha kd``. The older fields that
  upstream's test configs still write, ``skip_lm_loss`` (default true) and
  ``kd_loss_scale``: ``lm + scale * kd * (lm / kd)`` with the ratio detached, i.e. the
  distillation loss rescaled to the lm loss's magnitude. One spelling per file.

Every term is a mean over the loss tokens, as Megatron's token-normalised losses are.
The training log reports Megatron's names: ``lm loss`` (0 in training when the lm loss
is skipped: ModelOpt does not compute it then), ``total loss`` (what is optimised),
``logits distillation loss`` and ``intermediate distillation loss``. Evaluation
optimises nothing and reports the student's real lm loss.

``DistillationConfig`` (the flags) lives here, with the code it configures. What is unusual
here: the teacher is not a submodule of the student, so DDP, the
optimizer and checkpoints never see it (a checkpoint holds the student alone, as with
ModelOpt); its architecture is the student's flags overridden by the teacher's model
config (Megatron's argument names), and its weights load from its own checkpoint,
either format. Outputs are read through forward hooks, so the student must run eagerly
(``RunConfig.validate`` refuses CUDA graphs with distillation).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.config_utils import Freezable, flag_field, require
from megatron.core.models.gpt.loss import mask_kwargs
from megatron.core.pipeline_parallel.schedules import NUM_TOKENS

LM_LOSS, TOTAL_LOSS = "lm loss", "total loss"
LOGITS_LOSS, INTERMEDIATE_LOSS = "logits distillation loss", "intermediate distillation loss"
_INTERMEDIATE_KINDS = ("cosine", "mse")
# Model-shaping concerns a teacher model config may override (Megatron's argument names are their fields).
_TEACHER_GROUPS = ("model", "moe", "mamba", "linear_attention")


@dataclasses.dataclass
class DistillationConfig(Freezable):
    """Knowledge distillation from a frozen teacher (the flags of Megatron's ModelOpt integration)."""

    export_kd_teacher_load: str | None = None
    """Checkpoint folder of the teacher model; setting it turns distillation on (the student is the model the
    other flags describe, trained on the distillation loss of --export-kd-cfg)."""

    export_kd_teacher_model_config: str | None = None
    """YAML file of the teacher's model flags that differ from the student's (Megatron's argument names, e.g.
    ``num_layers: 24``); default: ``model_config.yaml`` in --export-kd-teacher-load, else the student's model."""

    export_kd_teacher_ckpt_format: str | None = flag_field(None, choices=("torch", "torch_dist", "torch_dcp"))
    """Format of the teacher's checkpoint when it differs from --ckpt-format (default: the one it has)."""

    export_kd_cfg: str | None = None
    """Distillation YAML (ModelOpt's fields: logit_layers, intermediate_layer_pairs, skip_lm_loss, kd_loss_scale,
    kd_loss_alpha, logit_kl_temperature); default: KL divergence of the logits alone, temperature 1."""

    @property
    def enabled(self) -> bool:
        return self.export_kd_teacher_load is not None

    def validate(self) -> None:
        """The distillation flags' own checks (files exist); raises ``ValueError``."""
        given = {
            "--export-kd-teacher-model-config": self.export_kd_teacher_model_config,
            "--export-kd-teacher-ckpt-format": self.export_kd_teacher_ckpt_format,
            "--export-kd-cfg": self.export_kd_cfg,
        }
        if not self.enabled:
            extra = [flag for flag, value in given.items() if value is not None]
            require(
                not extra,
                f"{', '.join(extra)} configure distillation, which --export-kd-teacher-load turns on; "
                "give the teacher's checkpoint folder or drop them.",
            )
            return
        require(
            os.path.isdir(self.export_kd_teacher_load),
            f"--export-kd-teacher-load {self.export_kd_teacher_load} is not a folder; give the teacher's checkpoint "
            "folder (the one its --save wrote).",
        )
        for flag in ("--export-kd-teacher-model-config", "--export-kd-cfg"):
            path = given[flag]
            require(path is None or os.path.isfile(path), f"{flag} {path} does not exist; give a YAML file.")
        require(
            self.export_kd_teacher_ckpt_format != "torch_dcp",
            "--export-kd-teacher-ckpt-format torch_dcp is not supported: teachers load from torch_dist or torch "
            "checkpoints.",
        )


@dataclasses.dataclass(frozen=True)
class KDSettings:
    """The distillation YAML (``--export-kd-cfg``), validated."""

    logit_layers: tuple[str, str] = ("output_layer", "output_layer")
    intermediate_layer_pairs: tuple[tuple[str, str, str], ...] = ()
    """(student module, teacher module, ``cosine`` or ``mse``)."""
    kd_loss_alpha: float | None = None
    """``(1 - alpha) * lm + alpha * kd``; None: the older ``skip_lm_loss`` / ``kd_loss_scale`` rule."""
    skip_lm_loss: bool = True
    kd_loss_scale: float = 1.0
    logit_kl_temperature: float = 1.0

    @property
    def skips_lm_loss(self) -> bool:
        return self.kd_loss_alpha == 1.0 if self.kd_loss_alpha is not None else self.skip_lm_loss

    @classmethod
    def from_file(cls, path: str | None) -> KDSettings:
        """Reads and checks ``path`` (None: logits only, temperature 1, lm loss skipped)."""
        if path is None:
            return cls()
        where = f"--export-kd-cfg {path}"
        yaml = _yaml(where)
        try:
            with open(path) as f:
                raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{where} is not valid YAML: {e}") from e
        raw = {} if raw is None else raw
        require(isinstance(raw, dict), f"{where} must be a YAML mapping of distillation fields.")
        known = {"logit_layers", "intermediate_layer_pairs", "kd_loss_alpha", "skip_lm_loss", "kd_loss_scale",
                 "logit_kl_temperature"}  # fmt: skip
        topk = [k for k in ("logit_kl_topk", "logit_kl_top_p", "logit_kl_top_p_min_k") if raw.get(k) is not None]
        require(not topk, f"{where}: {', '.join(topk)} (top-k logit distillation) is not supported yet; drop it.")
        unknown = sorted(set(raw) - known - {"logit_kl_topk", "logit_kl_top_p", "logit_kl_top_p_min_k"})
        require(not unknown, f"{where}: unknown field(s) {unknown}; the fields are {sorted(known)}.")
        require(
            raw.get("kd_loss_alpha") is None or ("skip_lm_loss" not in raw and "kd_loss_scale" not in raw),
            f"{where}: kd_loss_alpha replaces skip_lm_loss and kd_loss_scale (ModelOpt's newer and older "
            "spellings); give one of them.",
        )
        logits = raw.get("logit_layers", cls.logit_layers)
        require(
            isinstance(logits, (list, tuple)) and len(logits) == 2 and all(isinstance(n, str) for n in logits),
            f"{where}: logit_layers must be [student module, teacher module], got {logits!r}.",
        )
        pairs = []
        for entry in raw.get("intermediate_layer_pairs") or []:
            ok = isinstance(entry, (list, tuple)) and len(entry) in (2, 3) and all(isinstance(n, str) for n in entry)
            require(
                ok, f"{where}: each intermediate_layer_pairs entry is [student, teacher(, cosine|mse)], got {entry!r}."
            )
            kind = entry[2] if len(entry) == 3 else "cosine"
            require(kind in _INTERMEDIATE_KINDS, f"{where}: unknown intermediate loss {kind!r}; use cosine or mse.")
            pairs.append((entry[0], entry[1], kind))
        alpha = raw.get("kd_loss_alpha")
        if alpha is not None:
            require(0.0 <= float(alpha) <= 1.0, f"{where}: kd_loss_alpha must be in [0, 1], got {alpha}.")
            alpha = float(alpha)
        temperature = float(raw.get("logit_kl_temperature", 1.0))
        require(temperature > 0, f"{where}: logit_kl_temperature must be > 0, got {temperature}.")
        return cls(
            logit_layers=(logits[0], logits[1]),
            intermediate_layer_pairs=tuple(pairs),
            kd_loss_alpha=alpha,
            skip_lm_loss=bool(raw.get("skip_lm_loss", True)),
            kd_loss_scale=float(raw.get("kd_loss_scale", 1.0)),
            logit_kl_temperature=temperature,
        )


def _yaml(what: str):
    """PyYAML, imported only when a YAML file is read (it is no install requirement of training)."""
    try:
        import yaml
    except ImportError as e:
        raise ValueError(f"{what} is YAML, which needs PyYAML: pip install pyyaml.") from e
    return yaml


def teacher_model_config_path(distill) -> str | None:
    """``--export-kd-teacher-model-config``, else the teacher folder's ``model_config.yaml`` if present."""
    if distill.export_kd_teacher_model_config is not None:
        return distill.export_kd_teacher_model_config
    default = os.path.join(distill.export_kd_teacher_load, "model_config.yaml")
    return default if os.path.isfile(default) else None


def teacher_run_config(given, world_size: int):
    """The teacher's resolved ``RunConfig``: the student's flags as given (``parse_args``'s
    unresolved config) with the teacher's model config applied, loading the teacher folder
    weights only. Raises ``ValueError`` naming the file for an unknown or misplaced field."""
    cfg = copy.deepcopy(given)
    distill = cfg.distill
    path = teacher_model_config_path(distill)
    overrides = {}
    if path is not None:
        with open(path) as f:
            overrides = _yaml(f"teacher model config {path}").safe_load(f) or {}
        require(isinstance(overrides, dict), f"teacher model config {path} must be a YAML mapping of model flags.")
    for name, value in overrides.items():
        groups = [g for g in _TEACHER_GROUPS if name in {f.name for f in dataclasses.fields(getattr(cfg, g))}]
        require(
            groups,
            f"teacher model config {path}: {name!r} is not a model flag here (Megatron's argument names, e.g. "
            "num_layers, hidden_size, ffn_hidden_size, num_attention_heads).",
        )
        setattr(getattr(cfg, groups[0]), name, value)
    if "kv_channels" not in overrides and ("hidden_size" in overrides or "num_attention_heads" in overrides):
        cfg.model.kv_channels = None  # derived again from the teacher's sizes, as Megatron does
    c = cfg.checkpoint
    c.load, c.save, c.pretrained_checkpoint = distill.export_kd_teacher_load, None, None
    c.finetune, c.no_load_optim, c.no_load_rng = True, True, True
    c.ckpt_step = c.override_ckpt_iteration = None  # the student's: the teacher loads its folder's latest
    c.use_checkpoint_args = c.load_main_params_from_ckpt = False  # the student's; the teacher has no optimizer
    fmt = distill.export_kd_teacher_ckpt_format
    c.ckpt_format, c.auto_detect_ckpt_format = (fmt, False) if fmt else (c.ckpt_format, True)
    cfg.distill = type(distill)()  # the teacher distils nothing
    return cfg.resolve(world_size)


class _Wrapped(torch.nn.Module):
    """The teacher as the loaders expect a model: ``.module`` and ``finish_param_sync``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def finish_param_sync(self) -> None:
        pass

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)


def load_teacher(model_provider: Callable, teacher_cfg, vocab_size: int, pg, device) -> torch.nn.Module:
    """Builds the teacher (without touching the student's random streams) and loads its weights."""
    from megatron.training import checkpointing, dist_checkpointing
    from megatron.training.train_state import TrainState

    cfg = copy.deepcopy(teacher_cfg)
    cfg.model.vocab_size = vocab_size  # the student's tokenizer, hence its padded vocabulary
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        teacher = model_provider(cfg, vocab_size, pg, device)
    wrapped = _Wrapped(teacher)
    c = cfg.checkpoint
    if not checkpointing.has_checkpoint(c.load):
        raise ValueError(f"--export-kd-teacher-load {c.load} holds no checkpoint (no tracker file, no iter_* folder).")
    found = dist_checkpointing.detect_format(c.load) or c.ckpt_format
    if c.auto_detect_ckpt_format:
        c.ckpt_format = found
    if found != c.ckpt_format:
        raise ValueError(
            f"--export-kd-teacher-load {c.load} is a {found} checkpoint but --export-kd-teacher-ckpt-format is "
            f"{c.ckpt_format}; pass --export-kd-teacher-ckpt-format {found} or drop it."
        )
    if found == "torch_dist":
        iteration, release = checkpointing.read_tracker(os.path.abspath(c.load))
        iteration_dir = os.path.join(os.path.abspath(c.load), checkpointing.iteration_dir_name(iteration, release))
        dist_checkpointing.load_model_weights(wrapped, cfg, pg, iteration_dir)
    else:
        state = {checkpointing.MODEL: wrapped, checkpointing.TRAIN_STATE: TrainState()}
        checkpointing.load_checkpoint(state, cfg, pg)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group; the gradient is summed too, since every rank's loss reads the sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _log_softmax(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """``log_softmax`` over the last dimension, whose shards lie on the ranks of ``tp_group``."""
    if tp_group is None:
        return logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    top = logits.amax(dim=-1, keepdim=True).detach()  # a shift for stability only
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    total = _AllReduceSum.apply(torch.exp(logits - top).sum(dim=-1, keepdim=True), tp_group)
    return logits - top - torch.log(total)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> float32; float32 and float64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def logits_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float, tp_group=None) -> torch.Tensor:
    """``[s, b, v(/tp)] x 2 -> [s, b]``: this rank's vocabulary shard's part of ``KL(teacher || student)``."""
    log_p = _log_softmax(_wide(student) / temperature, tp_group)
    log_q = _log_softmax(_wide(teacher.detach()) / temperature, tp_group)
    return (log_q.exp() * (log_q - log_p)).sum(dim=-1)


def hidden_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """``[s, b, h] x 2 -> [s, b]``: ``1 - cos`` (``cosine``) or the mean squared difference (``mse``)."""
    teacher = teacher.detach()
    if kind == "cosine":
        return 1.0 - F.cosine_similarity(_wide(student), _wide(teacher), dim=-1)
    return (_wide(student) - _wide(teacher)).pow(2).mean(dim=-1)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


class Distiller:
    """Runs the teacher beside the student and turns ``forward_step`` into the distillation loss.

    Args:
        settings: The distillation YAML.
        student: The student model (unwrapped: module names as in the YAML).
        teacher: The frozen teacher (``load_teacher``).
        pg: Process groups (the vocabulary and, with sequence parallelism, the sequence
            are split over TP).
        per_token_loss: ``--calculate-per-token-loss``: reported values are token sums, as the loss.
    """

    def __init__(self, settings: KDSettings, student, teacher, pg, *, per_token_loss: bool = False):
        self.settings = settings
        self.teacher = teacher
        self.tp_group = pg.tp if getattr(pg, "tp_size", 1) > 1 else None
        self.tp_rank = getattr(pg, "tp_rank", 0)
        self.per_token_loss = per_token_loss
        self._seen: dict[tuple[str, str], Any] = {}
        pairs = [settings.logit_layers] + [p[:2] for p in settings.intermediate_layer_pairs]
        for side, model in (("student", student), ("teacher", teacher)):
            names = dict(model.named_modules())
            for pair in pairs:
                name = pair[0] if side == "student" else pair[1]
                if name not in names:
                    close = sorted(n for n in names if n.split(".")[-1] == name.split(".")[-1])[:4]
                    raise ValueError(
                        f"--export-kd-cfg: the {side} has no module {name!r}"
                        + (f" (modules of that name: {close})" if close else "")
                        + "; name modules as in the model's parameter names (e.g. decoder.final_layernorm)."
                    )
                names[name].register_forward_hook(self._keeper(side, name))

    def _keeper(self, side: str, name: str):
        def hook(module, args, output):
            self._seen[(side, name)] = _first(output)

        return hook

    def wrap(self, forward_step: Callable) -> Callable:
        """``forward_step`` with the teacher run first and the distillation loss as the objective."""

        def distill_step(batch, model):
            self._seen.clear()
            with torch.no_grad():
                self.teacher(batch["tokens"], batch["position_ids"], batch["labels"], **mask_kwargs(batch))
            lm, metrics = forward_step(batch, model)
            try:
                return self._losses(lm, metrics, batch["loss_mask"], training=model.training)
            finally:
                self._seen.clear()  # no activation outlives the step

        return distill_step

    def _masked_mean(self, per_token: torch.Tensor, mask: torch.Tensor, *, tp_partial: bool) -> torch.Tensor:
        """Mean of ``[s(/tp), b]`` over the loss tokens; ``tp_partial``: each TP rank holds a part of
        the value (a vocabulary or sequence shard), summed for the value, its own for the gradient."""
        per_token = per_token.t()  # [b, s(/tp)]
        if per_token.shape[1] != mask.shape[1]:  # sequence parallel: this rank's rows of the sequence
            width = per_token.shape[1]
            mask = mask[:, self.tp_rank * width : (self.tp_rank + 1) * width]
        local = (per_token * mask).sum()
        if tp_partial and self.tp_group is not None:
            total = local.detach().clone()
            dist.all_reduce(total, group=self.tp_group)
            local = local + (total - local.detach())  # the value summed, the gradient this rank's
        return local / self._tokens

    def _losses(self, lm: torch.Tensor, metrics: dict, loss_mask: torch.Tensor, *, training: bool):
        s = self.settings
        mask = loss_mask.float()
        self._tokens = mask.sum().clamp(min=1.0)  # every TP rank holds the whole mask
        student, teacher = self._seen[("student", s.logit_layers[0])], self._seen[("teacher", s.logit_layers[1])]
        kl = logits_kl(student, teacher, s.logit_kl_temperature, self.tp_group)
        logits_loss = self._masked_mean(kl, mask, tp_partial=True)
        inter = []
        for student_name, teacher_name, kind in s.intermediate_layer_pairs:
            per_token = hidden_loss(self._seen[("student", student_name)], self._seen[("teacher", teacher_name)], kind)
            inter.append(self._masked_mean(per_token, mask, tp_partial=per_token.shape[0] != mask.shape[1]))
        kd, intermediate = balance(s, lm, logits_loss, inter)
        skipped = s.skips_lm_loss and training
        reported_lm = torch.zeros_like(lm) if skipped else lm.detach()
        objective = kd if training else lm
        report = {LM_LOSS: reported_lm, TOTAL_LOSS: kd.detach(), LOGITS_LOSS: logits_loss.detach(),
                  INTERMEDIATE_LOSS: intermediate.detach()}  # fmt: skip
        if self.per_token_loss:  # token sums, as the schedule makes of the loss
            report = {k: v * metrics[NUM_TOKENS] for k, v in report.items()}
        return objective, {**metrics, **report}


def balance(s: KDSettings, lm: torch.Tensor, logits_loss: torch.Tensor, inter: list[torch.Tensor]):
    """ModelOpt's loss balancer: ``(objective, unscaled mean of the intermediate losses)``; no host sync.

    The intermediate mean is rescaled to the logits loss (detached factor, 0 when it is 0) and added
    to it; that distillation loss is the objective when the lm loss is skipped, else it is combined
    with ``lm`` by ``kd_loss_alpha`` or, in the older spelling, rescaled to ``lm`` (detached ratio,
    when both are positive) and added times ``kd_loss_scale``.
    """
    if inter:
        intermediate = sum(inter) / len(inter)
        denom = intermediate.detach()
        scale = torch.where(denom > 0, logits_loss.detach() / denom.clamp(min=torch.finfo(denom.dtype).tiny), 0.0)
        kd = logits_loss + intermediate * scale
    else:
        intermediate = torch.zeros_like(logits_loss)
        kd = logits_loss
    if s.skips_lm_loss:
        return kd, intermediate
    if s.kd_loss_alpha is not None:
        return (1.0 - s.kd_loss_alpha) * lm + s.kd_loss_alpha * kd, intermediate
    both = (kd.detach() > 0) & (lm.detach() > 0)
    ratio = torch.where(both, lm.detach() / kd.detach().clamp(min=torch.finfo(kd.dtype).tiny), 1.0)
    return lm + kd * ratio * s.kd_loss_scale, intermediate


def build(cfg, teacher_cfg, model_provider: Callable, student: torch.nn.Module, pg, device) -> Distiller:
    """The run's ``Distiller``: the teacher built and loaded, the YAML read (``Trainer`` calls it)."""
    settings = KDSettings.from_file(cfg.distill.export_kd_cfg)
    teacher = load_teacher(model_provider, teacher_cfg, cfg.model.vocab_size, pg, device)
    per_token = cfg.training.calculate_per_token_loss
    return Distiller(settings, student, teacher, pg, per_token_loss=per_token)

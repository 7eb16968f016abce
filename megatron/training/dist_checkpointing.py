"""``--ckpt-format torch_dist``: sharded checkpoints through ``torch.distributed.checkpoint``.

Layout under ``--save DIR`` (folder and tracker names as the torch format and Megatron)::

    DIR/latest_checkpointed_iteration.txt      "100"
    DIR/iter_0000100/.metadata                 DCP metadata (every key, its shape and shards)
    DIR/iter_0000100/__<rank>_0.distcp         the tensors each rank wrote
    DIR/iter_0000100/common.pt                 iteration, consumed samples, scheduler, RNG, config

What is unusual:
- Keys are layout-free: ``model.<parameter name>`` with the model's global names, so a
  later parallel layout can reshard (DCP stores the global shape of every tensor and
  replicated tensors once). The optimizer state is keyed by parameter name too:
  ``optimizer.state.<parameter name>.<moment>`` (``exp_avg``, ``exp_avg_sq``, ``step``)
  and ``optimizer.main_params.<parameter name>`` (fp32 copies of bf16/fp16 weights), so
  a model whose parameters come in another order loads the right state into each.
  Checkpoints of the older positional layout (``optimizer.optimizer.state.<index>``)
  still load.
- Atomic like the torch format: DCP writes into ``iter_X.tmp-<pid>``; rank 0 renames it
  and then replaces the tracker, after every rank's files are written.
- ``--async-save``: tensors are copied to the CPU at save time (training may then
  change them), and a background thread writes them and installs the folder and
  tracker. Its collectives run on a gloo group of their own, so they never interleave
  with training's. One save is in flight at most: the next save, the next load and the
  end of training wait for it.
- Loading copies into the existing parameter and optimizer tensors (DCP loads in place),
  so CUDA graphs captured later read the loaded values. ``--dist-ckpt-strictness``
  decides what unexpected or missing keys do.
"""

import os
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron.training import checkpointing as ckpt
from megatron.training.logging_utils import print_rank_0
from megatron.training.save_lock import remove_leftovers
from megatron.training.train_state import get_rng_state, set_rng_state

COMMON_FILENAME = "common.pt"
METADATA_FILENAME = ".metadata"


def is_torch_dist_checkpoint(iteration_dir: str) -> bool:
    """True when ``iteration_dir`` holds a torch_dist (DCP) checkpoint."""
    return os.path.isfile(os.path.join(iteration_dir, METADATA_FILENAME))


def _distributed(trainer) -> bool:
    return trainer.pg.world_size > 1 and dist.is_available() and dist.is_initialized()


_POSITIONAL_PREFIX = "optimizer.optimizer.state."
"""Keys of the older layout, whose optimizer state is keyed by position."""


def _tensor_state(trainer, *, with_optimizer: bool, positional: bool = False) -> dict[str, Any]:
    state = {"model": trainer.model.state_dict()}
    if with_optimizer:
        opt = trainer.optimizer
        if (
            not opt.optimizer.state
            and hasattr(opt, "_allocate_adam_state")
            and trainer.cfg.optimizer.optimizer == "adam"
        ):
            opt._allocate_adam_state()  # a template for in-place loading (a fresh optimizer has no state yet)
        state["optimizer"] = opt.state_dict() if positional else _named_optimizer_state(trainer)
    return state


def _param_names(trainer) -> dict[int, str]:
    """id(main param) -> the model's name of its parameter."""
    names = {id(p): n for n, p in trainer.model.module.named_parameters()}
    opt = trainer.optimizer
    return {id(main): names[id(param)] for param, main in zip(opt.model_params, opt.main_params)}


def _named_optimizer_state(trainer) -> dict[str, Any]:
    """The optimizer's state with every per-parameter entry under the parameter's name.

    The tensors are the optimizer's own (no copies), so DCP loads into them in place.
    """
    opt = trainer.optimizer
    inner = opt.optimizer
    names = _param_names(trainer)
    state, groups = {}, []
    for group in inner.param_groups:
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(m)] for m in group["params"]]}
        )
        for main in group["params"]:
            if inner.state.get(main):
                state[names[id(main)]] = dict(inner.state[main])
    by_param = {id(param): main for param, main in zip(opt.model_params, opt.main_params)}
    lowp = {names[id(by_param[id(p)])]: m.detach() for p, m in zip(opt._lowp_model, opt._lowp_main)}
    return {
        "state": state,
        "param_groups": groups,
        "main_params": lowp,
        "grad_scaler": None if opt.grad_scaler is None else opt.grad_scaler.state_dict(),
    }


@torch.no_grad()
def _finish_named_load(trainer, loaded: dict[str, Any]) -> None:
    """After DCP loaded ``_named_optimizer_state``'s tensors in place: the rest of the optimizer."""
    opt = trainer.optimizer
    impl_keys = ("fused", "foreach", "capturable", "differentiable", "params")
    saved_groups = loaded.get("param_groups") or []
    if len(saved_groups) == len(opt.optimizer.param_groups):
        for group, saved in zip(opt.optimizer.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k not in impl_keys})
    opt._fused_lists = None
    for param, main in zip(opt._lowp_model, opt._lowp_main):
        param.copy_(main)  # main params were loaded in place
    if opt.grad_scaler is not None and loaded.get("grad_scaler") is not None:
        opt.grad_scaler.load_state_dict(loaded["grad_scaler"])


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class _AsyncSave:
    """The one save in flight: a thread that writes and installs it."""

    def __init__(self, thread: threading.Thread, iteration: int, errors: list):
        self.thread, self.iteration, self.errors = thread, iteration, errors


_ckpt_group = None  # gloo group for background-save collectives, made once on every rank
_pending: _AsyncSave | None = None


def _async_group(trainer):
    global _ckpt_group
    if _ckpt_group is None and _distributed(trainer):
        _ckpt_group = dist.new_group(backend="gloo")
    return _ckpt_group


def wait_for_pending_save() -> None:
    """Blocks until the in-flight ``--async-save`` (if any) is on disk on every rank; re-raises its error.

    Called by every rank at the same points (the next save or load, the end of training).
    """
    global _pending
    if _pending is None:
        return
    pending, _pending = _pending, None
    pending.thread.join()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # rank 0's thread installs the folder and tracker after the others' files
    if pending.errors:
        raise RuntimeError(f"async checkpoint save of iteration {pending.iteration} failed") from pending.errors[0]
    print_rank_0(f"  successfully saved checkpoint from iteration {pending.iteration:7d} (async)")


def save(trainer) -> None:
    """Saves ``trainer`` at its iteration in the torch_dist format (async with ``--async-save``)."""
    global _pending
    wait_for_pending_save()
    cfg = trainer.cfg
    save_dir = os.path.abspath(cfg.checkpoint.save)
    iteration = trainer.iteration
    start = time.perf_counter()
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch_dist format")
    final_dir = os.path.join(save_dir, ckpt.iteration_dir_name(iteration))
    tmp_name = [f"{ckpt.iteration_dir_name(iteration)}.tmp-{os.getpid()}"]
    if trainer.pg.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
    if _distributed(trainer):
        dist.broadcast_object_list(tmp_name, src=0)
    tmp_dir = os.path.join(save_dir, tmp_name[0])

    rng = get_rng_state(trainer.device.type == "cuda")
    rng_states = [rng]
    if trainer.pg.dp is not None:
        rng_states = [None] * trainer.pg.dp_size
        dist.all_gather_object(rng_states, rng, group=trainer.pg.dp)
    common = {
        "checkpoint_version": ckpt.CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_samples": trainer.consumed_samples,
        "opt_param_scheduler": trainer.scheduler.state_dict(),
        "rng_state": rng_states,
        "config": ckpt.config_to_dict(cfg),
    }
    tensors = _tensor_state(trainer, with_optimizer=True)
    is_rank0 = trainer.pg.rank == 0
    distributed = _distributed(trainer)

    def write(state, group):
        with warnings.catch_warnings():  # DCP warns that a world of one saves "in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=tmp_dir, process_group=group, no_dist=not distributed)
        if is_rank0:  # DCP's coordinator (rank 0) returns only after every rank's files are written
            ckpt._write_file(common, os.path.join(tmp_dir, COMMON_FILENAME))
            ckpt._install(save_dir, tmp_dir, final_dir)
            ckpt._write_tracker(save_dir, iteration)
            remove_leftovers(save_dir)

    trainer.last_checkpointed_iteration = iteration
    if cfg.checkpoint.async_save:
        group = _async_group(trainer)
        state = _to_cpu(tensors)  # training goes on changing the live tensors
        errors: list = []

        def run():
            try:
                write(state, group)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait_for_pending_save
                errors.append(e)

        thread = threading.Thread(target=run, name=f"async-save-{iteration}", daemon=False)
        thread.start()
        _pending = _AsyncSave(thread, iteration, errors)
        print_rank_0(f"  scheduled async save of iteration {iteration:7d} ({time.perf_counter() - start:.2f} s)")
        return
    write(tensors, None)
    if distributed:
        dist.barrier()  # nobody goes on before the tracker points at this save
    print_rank_0(
        f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir} "
        f"({time.perf_counter() - start:.2f} s)"
    )


def _check_keys(strictness: str, expected: set[str], found: set[str], path: str) -> None:
    """``--dist-ckpt-strictness``: unexpected = in the checkpoint only, missing = in the model only."""
    if strictness in ("assume_ok_unexpected", "ignore_all"):
        return
    unexpected, missing = sorted(found - expected), sorted(expected - found)
    check_missing = strictness.endswith("_all")
    problems = []
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if missing and check_missing:
        problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if not problems:
        return
    message = f"checkpoint {path}: " + "; ".join(problems)
    if strictness.startswith("raise"):
        raise ValueError(message + ". Pass --dist-ckpt-strictness log_all to load what matches.")
    print_rank_0("WARNING: " + message)


def _flat_keys(state: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            keys |= _flat_keys(v, name + ".")
        elif isinstance(v, torch.Tensor):
            keys.add(name)
    return keys


def _read_common(path: str) -> dict[str, Any]:
    try:
        common = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
        raise ValueError(f"checkpoint file {path} cannot be read ({type(e).__name__}: {e}).") from e
    version = common.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version > ckpt.CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint {path} has format version {version!r}; this trainer reads up to "
                         f"{ckpt.CHECKPOINT_VERSION}. Update the trainer.")  # fmt: skip
    return common


_SCHEDULE_FIELDS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def restore_scheduler(trainer, saved: dict[str, Any]) -> None:
    """Restores the LR schedule's position, and its shape as the scheduler flags say.

    ``--use-checkpoint-opt_param-scheduler``: lr, min lr, warm-up and decay come from the
    checkpoint. ``--override-opt_param-scheduler``: from this run's flags. Neither: the
    flags, with a warning naming what differs (Megatron refuses to start instead).
    """
    sched, opt = trainer.scheduler, trainer.cfg.optimizer
    if opt.use_checkpoint_opt_param_scheduler:
        for name in _SCHEDULE_FIELDS:
            if name in saved:
                setattr(sched, name, saved[name])
    elif not opt.override_opt_param_scheduler:
        diffs = [f"{n}: checkpoint {saved[n]!r}, flags {getattr(sched, n)!r}" for n in _SCHEDULE_FIELDS
                 if n in saved and saved[n] != getattr(sched, n)]  # fmt: skip
        if diffs:
            print_rank_0(
                "WARNING: the LR schedule of the flags differs from the checkpoint's (" + "; ".join(diffs) + "); "
                "using the flags. Pass --use-checkpoint-opt_param-scheduler to keep the checkpoint's."
            )
    sched.load_state_dict(saved)


def detect_format(load_dir: str) -> str | None:
    """The format of the checkpoint ``load_dir``'s tracker points at (None: no readable checkpoint)."""
    load_dir = os.path.abspath(load_dir)
    if not os.path.isfile(ckpt.tracker_path(load_dir)):
        return None
    try:
        iteration, release = ckpt.read_tracker(load_dir)
    except ValueError:
        return None  # the loader names the corrupt tracker
    iteration_dir = os.path.join(load_dir, ckpt.iteration_dir_name(iteration, release))
    return "torch_dist" if is_torch_dist_checkpoint(iteration_dir) else "torch"


def maybe_load(trainer) -> int | None:
    """``--load`` for torch_dist checkpoints, and the format check for both formats.

    Returns:
        The iteration training continues from, or None when the torch format's loader
        should go on (a torch checkpoint, or no checkpoint at all).

    Raises:
        ValueError: The checkpoint's format is not --ckpt-format's (without
            --auto-detect-ckpt-format), or the checkpoint does not fit.
    """
    c = trainer.cfg.checkpoint
    load_dir = os.path.abspath(c.load)
    if not os.path.isfile(ckpt.tracker_path(load_dir)):
        return None  # no checkpoint: the torch loader reports it (or starts fresh)
    iteration, release = ckpt.read_tracker(load_dir)
    iteration_dir = os.path.join(load_dir, ckpt.iteration_dir_name(iteration, release))
    found = "torch_dist" if is_torch_dist_checkpoint(iteration_dir) else "torch"
    if found != c.ckpt_format:  # with --auto-detect-ckpt-format, RunConfig.resolve() already chose it
        raise ValueError(
            f"--load {load_dir}: iteration {iteration} is a {found} checkpoint but --ckpt-format is "
            f"{c.ckpt_format}; pass --ckpt-format {found} or --auto-detect-ckpt-format."
        )
    if c.auto_detect_ckpt_format:
        print_rank_0(f"> --auto-detect-ckpt-format: loading (and saving) in {found} format")
    if found == "torch":
        return None
    return load(trainer, iteration_dir, iteration, release)


@torch.no_grad()
def load(trainer, iteration_dir: str, iteration: int, release: bool) -> int:
    """Loads a torch_dist checkpoint folder into ``trainer`` (same options as the torch format)."""
    wait_for_pending_save()
    c = trainer.cfg.checkpoint
    print_rank_0(f"loading checkpoint from {iteration_dir} (torch_dist)")
    common = _read_common(os.path.join(iteration_dir, COMMON_FILENAME))
    ckpt.check_config(common.get("config", {}), trainer.cfg, iteration_dir)
    weights_only = c.finetune or release
    with_optimizer = not weights_only and not c.no_load_optim
    reader = dcp.FileSystemReader(iteration_dir)
    found = set(reader.read_metadata().state_dict_metadata)
    positional = any(k.startswith(_POSITIONAL_PREFIX) for k in found)
    state = _tensor_state(trainer, with_optimizer=with_optimizer, positional=positional)
    expected = _flat_keys(state)
    _check_keys(c.dist_ckpt_strictness, expected, found, iteration_dir)
    missing = sorted(expected - found)
    tolerate = c.dist_ckpt_strictness in ("log_all", "return_all", "ignore_all")
    if missing and not tolerate:
        raise ValueError(
            f"checkpoint {iteration_dir} lacks {missing[:8]}: it was saved for another model or optimizer; "
            "pass the saving run's flags, --no-load-optim for weights only, or --dist-ckpt-strictness log_all "
            "to keep this run's values where the checkpoint has none."
        )
    planner = dcp.DefaultLoadPlanner(allow_partial_load=bool(missing))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=not _distributed(trainer))

    if weights_only:
        trainer.iteration, trainer.consumed_samples = 0, 0
    else:
        trainer.iteration = int(common["iteration"])
        trainer.consumed_samples = int(common["consumed_samples"])
    if with_optimizer:
        if positional:
            trainer.optimizer.load_state_dict(state["optimizer"])
        else:
            _finish_named_load(trainer, state["optimizer"])
        restore_scheduler(trainer, common["opt_param_scheduler"])
    else:
        trainer.optimizer.reload_model_params()  # fp32 main params from the loaded weights
        trainer.scheduler.num_steps = trainer.iteration
        trainer.scheduler.step(0)
    if not weights_only and not c.no_load_rng:
        states = common["rng_state"]
        chosen = states[trainer.pg.dp_rank] if len(states) == trainer.pg.dp_size else states[0]
        set_rng_state(chosen, include_cuda=trainer.device.type == "cuda")
    trainer.last_checkpointed_iteration = None if weights_only else trainer.iteration
    print_rank_0(
        f"  successfully loaded checkpoint from {iteration_dir} at iteration {iteration}"
        + (" (weights only: starting at iteration 0)" if weights_only else "")
    )
    return trainer.iteration

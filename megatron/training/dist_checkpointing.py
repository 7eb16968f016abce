"""``--ckpt-format torch_dist``: sharded checkpoints through ``torch.distributed.checkpoint``.

Layout under ``--save DIR`` (folder and tracker names as the torch format and Megatron)::

    DIR/latest_checkpointed_iteration.txt      "100"
    DIR/iter_0000100/.metadata                 DCP metadata (every key, its shape and shards)
    DIR/iter_0000100/__<rank>_0.distcp         the tensors each rank wrote
    DIR/iter_0000100/common.pt                 iteration, consumed samples, scheduler, RNG, config

What is unusual:
- Keys are layout-free (``sharded_state.py``): ``model.<name>`` and
  ``optimizer.state.<exp_avg|exp_avg_sq|step|fp32_param>.<name>`` with the name of the
  one-process model (layers by global layer number), each tensor at its full shape.
  Every rank writes the rectangles of the full tensors it owns (TP blocks, the
  distributed optimizer's flat ranges cut into rectangles; replicas once) and reads
  what it holds, so a checkpoint saved at one TP x PP (x VPP) x EP x DP layout, with or
  without ``--use-distributed-optimizer``, loads at any other. The check of the saving
  run's flags therefore leaves out the parallel sizes.
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

from megatron.training import checkpoint_config, sharded_state
from megatron.training import checkpointing as ckpt
from megatron.training.finite_state import refuse_non_finite
from megatron.training.logging_utils import print_rank_0
from megatron.training.save_lock import remove_leftovers
from megatron.training.train_state import get_rng_state, set_rng_state

COMMON_FILENAME = "common.pt"
METADATA_FILENAME = ".metadata"


def is_torch_dist_checkpoint(iteration_dir: str) -> bool:
    """True when ``iteration_dir`` holds a torch_dist (DCP) checkpoint."""
    return os.path.isfile(os.path.join(iteration_dir, METADATA_FILENAME))


def _distributed(pg) -> bool:
    return pg.world_size > 1 and dist.is_available() and dist.is_initialized()


def unwrapped_model(model):
    """The unwrapped model (or a list of its virtual-pipeline chunks) whose parameter names the keys use."""
    if isinstance(model, (list, tuple)):
        return [getattr(m, "module", m) for m in model]
    model = getattr(model, "module", model)
    return list(model) if isinstance(model, torch.nn.ModuleList) else model  # virtual-pipeline chunks


def _entries(
    model, optimizer, pg, *, with_optimizer: bool, main_params_only: bool = False
) -> list[sharded_state.Entry]:
    """The model's entries (and the optimizer's, or its fp32 params alone) of this rank."""
    chunks = unwrapped_model(model)
    for m in model if isinstance(model, (list, tuple)) else [model]:
        m.finish_param_sync()  # a parameter gather in flight would race the read
    entries = sharded_state.model_entries(chunks, pg)
    if with_optimizer or main_params_only:
        optimizer = sharded_state.optimizer_entries(optimizer, chunks, pg)
        entries += optimizer if with_optimizer else [e for e in optimizer if e.key.startswith(_FP32_PREFIX)]
    return entries


def _written_copies(entries: list[sharded_state.Entry]) -> list[sharded_state.Entry]:
    """The entries this rank writes, with CPU copies of their chunks (training may change the live tensors)."""
    out = []
    for e in entries:
        if e.write:
            chunks = [sharded_state.Chunk(c.offsets, c.sizes, c.view.detach().to("cpu", copy=True)) for c in e.chunks]
            out.append(sharded_state.Entry(e.key, e.full_shape, chunks, True))
    return out


def _check_finite(trainer, entries: list[sharded_state.Entry], save_dir: str) -> None:
    """Refuses (on every rank) to save non-finite state, as the torch format does."""
    written = {e.key + str(i): c.view for e in entries if e.write for i, c in enumerate(e.chunks)}
    refuse_non_finite({"state": written}, trainer.pg, trainer.iteration, ckpt.kept_message(save_dir))


class _AsyncSave:
    """The one save in flight: a thread that writes and installs it."""

    def __init__(self, thread: threading.Thread, iteration: int, errors: list):
        self.thread, self.iteration, self.errors = thread, iteration, errors


_ckpt_group = None  # gloo group for background-save collectives, made once on every rank
_pending: _AsyncSave | None = None


def _async_group(trainer):
    global _ckpt_group
    if _ckpt_group is None and _distributed(trainer.pg):
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


def _gathered_rng_states(trainer) -> list:
    """Every data-parallel rank's RNG state, in DP-rank order (each rank resumes its own)."""
    rng = get_rng_state(trainer.device.type == "cuda")
    if trainer.pg.dp is None:
        return [rng]
    states = [None] * trainer.pg.dp_size
    dist.all_gather_object(states, rng, group=trainer.pg.dp)
    return states


def save(trainer, save_dir: str | None = None) -> None:
    """Saves ``trainer`` at its iteration in the torch_dist format (async with ``--async-save``) into
    ``save_dir`` (default ``--save``)."""
    global _pending
    wait_for_pending_save()
    cfg = trainer.cfg
    save_dir = os.path.abspath(save_dir or cfg.checkpoint.save)
    iteration = trainer.iteration
    start = time.perf_counter()
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch_dist format")
    final_dir = os.path.join(save_dir, ckpt.iteration_dir_name(iteration))
    tmp_name = [f"{ckpt.iteration_dir_name(iteration)}.tmp-{os.getpid()}"]
    if trainer.pg.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
    if _distributed(trainer.pg):
        dist.broadcast_object_list(tmp_name, src=0)
    tmp_dir = os.path.join(save_dir, tmp_name[0])

    c = cfg.checkpoint
    common = {
        "checkpoint_version": ckpt.CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_samples": trainer.consumed_samples,
        "consumed_valid_samples": trainer.consumed_valid_samples,
        "skipped_train_samples": trainer.state.skipped_train_samples,
    }
    if not c.no_save_optim:
        common["opt_param_scheduler"] = trainer.scheduler.state_dict()
    if not c.no_save_rng:
        common["rng_state"] = _gathered_rng_states(trainer)
    common["config"] = checkpoint_config.config_to_dict(cfg)
    entries = _entries(trainer.model, trainer.optimizer, trainer.pg, with_optimizer=not c.no_save_optim)
    _check_finite(trainer, entries, save_dir)
    if not c.no_save_optim:
        common["optimizer"] = {"grad_scaler": _grad_scaler_state(trainer.optimizer)}
    is_rank0 = trainer.pg.rank == 0
    distributed = _distributed(trainer.pg)

    def write(entries, group):
        planner = sharded_state.ChunkSavePlanner(entries)
        with warnings.catch_warnings():  # DCP warns that a world of one saves "in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({}, checkpoint_id=tmp_dir, planner=planner, process_group=group, no_dist=not distributed)
        if is_rank0:  # DCP's coordinator (rank 0) returns only after every rank's files are written
            ckpt._write_file(common, os.path.join(tmp_dir, COMMON_FILENAME))
            ckpt._install(save_dir, tmp_dir, final_dir)
            ckpt._write_tracker(save_dir, iteration)
            remove_leftovers(save_dir)

    trainer.last_checkpointed_iteration = iteration
    if cfg.checkpoint.async_save:
        group = _async_group(trainer)
        copies = _written_copies(entries)  # training goes on changing the live tensors
        errors: list = []

        def run():
            try:
                write(copies, group)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait_for_pending_save
                errors.append(e)

        thread = threading.Thread(target=run, name=f"async-save-{iteration}", daemon=False)
        thread.start()
        _pending = _AsyncSave(thread, iteration, errors)
        print_rank_0(f"  scheduled async save of iteration {iteration:7d} ({time.perf_counter() - start:.2f} s)")
        return
    write(entries, None)
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


_FP32_PREFIX = f"{sharded_state.OPTIMIZER_PREFIX}{sharded_state.FP32_PARAM}."


def _grad_scaler_state(optimizer):
    scaler = getattr(optimizer, "grad_scaler", None)
    return None if scaler is None else scaler.state_dict()


def _all_keys(pg, keys: set[str]) -> set[str]:
    """The union of every rank's keys (pipeline stages hold different ones)."""
    if not _distributed(pg):
        return keys
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    return set().union(*map(set, gathered))


def _check_shapes(entries: list[sharded_state.Entry], metadata, path: str) -> None:
    for e in entries:
        md = metadata.state_dict_metadata.get(e.key)
        if md is not None and tuple(md.size) != tuple(e.full_shape):
            raise ValueError(
                f"checkpoint {path}: {e.key} has shape {tuple(md.size)}, this model's is {tuple(e.full_shape)}. "
                "Pass the model flags of the saving run (with TP the padded vocabulary follows "
                "--make-vocab-size-divisible-by x --tensor-model-parallel-size)."
            )


def read_common(path: str) -> dict[str, Any]:
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


def detect_format(load_dir: str, ckpt_step: int | None = None) -> str | None:
    """The format of the checkpoint ``load_dir``'s tracker (or ``--ckpt-step``) points at (None: no
    readable checkpoint)."""
    load_dir = os.path.abspath(load_dir)
    if not os.path.isfile(ckpt.tracker_path(load_dir)) and ckpt_step is None:
        return None
    try:
        iteration, release = ckpt.iteration_to_load(load_dir, ckpt_step)
    except ValueError:
        return None  # the loader names the corrupt tracker
    iteration_dir = os.path.join(load_dir, ckpt.iteration_dir_name(iteration, release))
    return "torch_dist" if is_torch_dist_checkpoint(iteration_dir) else "torch"


def maybe_load(trainer, load_dir: str | None = None) -> int | None:
    """``--load`` for torch_dist checkpoints, and the format check for both formats.

    Returns:
        The iteration training continues from, or None when the torch format's loader
        should go on (a torch checkpoint, or no checkpoint at all).

    Raises:
        ValueError: The checkpoint's format is not --ckpt-format's (without
            --auto-detect-ckpt-format), or the checkpoint does not fit.
    """
    c = trainer.cfg.checkpoint
    load_dir = os.path.abspath(load_dir or c.load)
    if not os.path.isfile(ckpt.tracker_path(load_dir)) and c.ckpt_step is None:
        return None  # no checkpoint: the torch loader reports it (or starts fresh)
    iteration, release = ckpt.iteration_to_load(load_dir, c.ckpt_step)
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


def _read(entries, reader, metadata, prefixes, c, pg, iteration_dir: str) -> list[sharded_state.Entry]:
    """Reads ``entries`` (this run's tensors) from a torch_dist checkpoint, in place; returns them in the
    stored form. ``prefixes``: the checkpoint keys the strictness check compares (None: all)."""
    found = set(metadata.state_dict_metadata)
    entries, step_copies = sharded_state.entries_in_stored_form(entries, metadata)
    expected = {e.key for e in entries}
    relevant = found if prefixes is None else {k for k in found if k.startswith(prefixes)}
    _check_keys(c.dist_ckpt_strictness, _all_keys(pg, expected), relevant, iteration_dir)
    missing = sorted(expected - found)
    tolerate = c.dist_ckpt_strictness in ("log_all", "return_all", "ignore_all")
    if missing and not tolerate:
        raise ValueError(
            f"checkpoint {iteration_dir} lacks {missing[:8]}: it was saved for another model or optimizer; "
            "pass the saving run's flags, --no-load-optim for weights only, or --dist-ckpt-strictness log_all "
            "to keep this run's values where the checkpoint has none."
        )
    present = [e for e in entries if e.key in found]
    _check_shapes(present, metadata, iteration_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            {}, storage_reader=reader, planner=sharded_state.ChunkLoadPlanner(present), no_dist=not _distributed(pg)
        )
    with torch.no_grad():
        for destination, source in step_copies:
            destination.copy_(source)
    return entries


@torch.no_grad()
def load_model_weights(model, cfg, pg, iteration_dir: str) -> None:
    """The weights alone of a torch_dist checkpoint folder into ``model`` (a distillation teacher): no
    optimizer, schedule, counters or RNG; the model shape is checked against ``cfg`` first."""
    wait_for_pending_save()
    print_rank_0(f"loading the weights of {iteration_dir} (torch_dist)")
    common = read_common(os.path.join(iteration_dir, COMMON_FILENAME))
    saved_config = dict(common.get("config", {}))
    saved_config.pop("parallel", None)  # layout-free: any TP x PP x DP reads it
    checkpoint_config.check_config(saved_config, cfg, iteration_dir)
    reader = dcp.FileSystemReader(iteration_dir)
    entries = _entries(model, None, pg, with_optimizer=False)
    _read(entries, reader, reader.read_metadata(), (sharded_state.MODEL_PREFIX,), cfg.checkpoint, pg, iteration_dir)


@torch.no_grad()
def load(trainer, iteration_dir: str, iteration: int, release: bool) -> int:
    """Loads a torch_dist checkpoint folder into ``trainer`` (same options as the torch format)."""
    wait_for_pending_save()
    c = trainer.cfg.checkpoint
    print_rank_0(f"loading checkpoint from {iteration_dir} (torch_dist)")
    common = read_common(os.path.join(iteration_dir, COMMON_FILENAME))
    saved_config = dict(common.get("config", {}))
    saved_config.pop("parallel", None)  # layout-free: any TP x PP x DP reads it
    checkpoint_config.check_config(saved_config, trainer.cfg, iteration_dir)
    weights_only = c.finetune or release
    with_optimizer = not weights_only and not c.no_load_optim
    main_params_only = c.load_main_params_from_ckpt  # --no-load-optim: the fp32 params alone
    if not weights_only:
        ckpt.require_saved(common, iteration_dir, c, ["opt_param_scheduler"])
    reader = dcp.FileSystemReader(iteration_dir)
    metadata = reader.read_metadata()
    found = set(metadata.state_dict_metadata)
    if with_optimizer:
        if any(k.startswith("optimizer.optimizer.") for k in found):
            raise ValueError(
                f"checkpoint {iteration_dir} keys its optimizer state by position (an older version of this "
                "trainer); load it with --no-load-optim (weights only), or with the trainer that saved it."
            )
        trainer.optimizer.allocate_state(trainer.optimizer.state_names())  # DCP reads in place
    if main_params_only and not any(k.startswith(_FP32_PREFIX) for k in found):
        raise ValueError(
            f"checkpoint {iteration_dir} holds no fp32 main params (saved with --no-save-optim, or in fp32) for "
            "--load-main-params-from-ckpt; drop the flag."
        )
    entries = _entries(
        trainer.model, trainer.optimizer, trainer.pg, with_optimizer=with_optimizer, main_params_only=main_params_only
    )
    kept = (sharded_state.MODEL_PREFIX, _FP32_PREFIX) if main_params_only else (sharded_state.MODEL_PREFIX,)
    entries = _read(entries, reader, metadata, None if with_optimizer else kept, c, trainer.pg, iteration_dir)

    if weights_only:
        trainer.iteration, trainer.consumed_samples, trainer.consumed_valid_samples = 0, 0, 0
    else:
        trainer.iteration = int(common["iteration"])
        trainer.consumed_samples = int(common["consumed_samples"])
        trainer.consumed_valid_samples = int(common.get("consumed_valid_samples", 0))  # older saves: 0
        trainer.state.skipped_train_samples = int(common.get("skipped_train_samples", 0))
    if with_optimizer:
        if not any(e.key in found for e in entries if e.key.startswith(_FP32_PREFIX)):
            trainer.optimizer.reload_model_params()  # no fp32 copies saved (a tolerated fp32 checkpoint)
        trainer.optimizer.after_state_load()  # fp32 main params into the model params
        scaler = getattr(trainer.optimizer, "grad_scaler", None)
        saved_scaler = common.get("optimizer", {}).get("grad_scaler")
        if scaler is not None and saved_scaler is not None:
            scaler.load_state_dict(saved_scaler)
        restore_scheduler(trainer, common["opt_param_scheduler"])
    elif main_params_only:
        trainer.optimizer.after_state_load()  # the loaded fp32 main params into the model params
    else:
        trainer.optimizer.reload_model_params()  # fp32 main params from the loaded weights
        # The LR schedule stays at the loaded iteration (in samples when the batch changes).
        trainer.scheduler.num_steps = trainer.consumed_samples if trainer.batches.varies else trainer.iteration
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

"""Checkpoints in Megatron's per-rank ``torch`` layout, written atomically.

Layout under ``--save DIR`` (what Megatron's ``--ckpt-format torch`` writes)::

    DIR/latest_checkpointed_iteration.txt                 "100"
    DIR/iter_0000100/mp_rank_00/model_optim_rng.pt        TP rank 00, PP = 1
    DIR/iter_0000100/mp_rank_00_000/model_optim_rng.pt    TP rank 00, PP rank 000 (PP > 1)

One file per model-parallel rank, written by data-parallel rank 0 of that slice. It
holds only plain Python values and tensors, so it loads with
``torch.load(weights_only=True)``: model state dict, optimizer state, LR-scheduler
state, RNG states (one entry per data-parallel rank, as Megatron), iteration,
consumed samples, the run config as a plain dict (dtypes as strings, no dataclasses)
and a format version.

What is unusual:
- Atomic saves. Files go to ``DIR/iter_X.tmp-<pid>/`` and are fsynced; the folder is
  then renamed to ``DIR/iter_X`` and only after that the tracker is replaced (temp file
  + ``os.replace``). A process killed at any point leaves the previous checkpoint and a
  tracker that points at it. Re-saving an existing ``iter_X`` renames the old folder
  aside first; a loader that finds ``iter_X`` missing falls back to that copy.
- ``--load DIR`` with no checkpoint is an error naming DIR, except when ``--load`` and
  ``--save`` are the same folder (Megatron's auto-resume idiom): a first run starts
  from scratch.
- The model config is compared with the checkpoint's before any tensor is touched, and
  a mismatch names the file and every differing field.
- Loading never replaces parameter or ``main_grad`` storage (``copy_`` into the
  existing tensors), so CUDA graphs captured afterwards read the loaded weights.
- ``--no-load-optim`` keeps the LR schedule at the loaded iteration (Megatron restarts
  it from step 0); ``--finetune`` starts from iteration 0 with fresh optimizer state.
"""

import dataclasses
import enum
import glob
import os
import random
import shutil
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron.training.logging_utils import print_rank_0

CHECKPOINT_VERSION = 1
"""Format version written into every file; loading a newer one is refused."""

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"

# Model fields that decide parameter shapes or how the weights are used. A checkpoint
# saved with other values cannot be loaded (or would silently compute something else).
MODEL_CHECK_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "position_embedding_type",
    "normalization",
    "gated_linear_unit",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
)
PARALLEL_CHECK_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")

# Flags spelled differently from their field, for error messages.
_FLAG_NAMES = {
    "gated_linear_unit": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "vocab_size": "the tokenizer / --vocab-size / --make-vocab-size-divisible-by",
    "num_query_groups": "--num-query-groups / --group-query-attention",
}


# ---------------------------------------------------------------------- paths


def tracker_path(checkpoints_dir: str) -> str:
    """``DIR/latest_checkpointed_iteration.txt``."""
    return os.path.join(checkpoints_dir, TRACKER_FILENAME)


def iteration_dir_name(iteration: int, release: bool = False) -> str:
    """``iter_0000100`` (7 digits, as Megatron), or ``release``."""
    return "release" if release else f"iter_{iteration:07d}"


def get_checkpoint_name(
    checkpoints_dir: str,
    iteration: int,
    *,
    tp_rank: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
    release: bool = False,
) -> str:
    """Path of one model-parallel rank's file.

    Returns:
        ``DIR/iter_XXXXXXX/mp_rank_{tp:02d}/model_optim_rng.pt`` for PP = 1, and
        ``.../mp_rank_{tp:02d}_{pp:03d}/...`` when ``pp_size > 1``.
    """
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(checkpoints_dir, iteration_dir_name(iteration, release), rank_dir, CHECKPOINT_FILENAME)


def _rank_file(trainer, checkpoints_dir: str, iteration: int, release: bool = False) -> str:
    pg = trainer.pg
    tp_rank = getattr(pg, "tp_rank", 0)
    pp_rank = getattr(pg, "pp_rank", 0)
    return get_checkpoint_name(
        checkpoints_dir, iteration, tp_rank=tp_rank, pp_rank=pp_rank, pp_size=pg.pp_size, release=release
    )


# ---------------------------------------------------------------------- plain config


def _plain(value: Any) -> Any:
    """Config value -> str/int/float/bool/None/list/dict (what weights_only can load)."""
    if isinstance(value, enum.Enum):  # first: IntEnum/StrEnum are ints/strs too
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value)(value) if value is not None else None  # plain builtin, not a subclass
    if isinstance(value, torch.dtype):
        return str(value)  # "torch.bfloat16"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return config_to_dict(value)
    return str(value)


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass (e.g. ``RunConfig``) as nested plain dicts, one per concern."""
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def check_config(saved: dict[str, Any], cfg, path: str) -> None:
    """Raises ``ValueError`` if the checkpoint's model shape differs from this run's.

    Args:
        saved: The checkpoint's ``config`` entry (``config_to_dict`` of the saving run).
        cfg: This run's ``RunConfig`` (validated, vocab size set).
        path: The checkpoint file, for the message.
    """
    current = config_to_dict(cfg)
    diffs = []
    checks = [("model", n) for n in MODEL_CHECK_FIELDS] + [("parallel", n) for n in PARALLEL_CHECK_FIELDS]
    if cfg.model.position_embedding_type == "learned_absolute":
        checks.append(("model", "max_position_embeddings"))  # the size of the position table
    for concern, name in checks:
        if name not in saved.get(concern, {}):
            continue  # a field the saving version did not have
        old, new = saved[concern][name], current[concern][name]
        if old != new:
            flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
            diffs.append(f"{name}={old!r}, this run has {new!r} ({flag})")
    if diffs:
        raise ValueError(
            f"checkpoint {path} was saved with " + "; ".join(diffs) + ". Pass the model flags of the run that "
            "saved it, or point --load at a checkpoint of this model."
        )


# ---------------------------------------------------------------------- RNG


def get_rng_state(include_cuda: bool) -> dict[str, Any]:
    """Python, numpy, torch CPU (and the current CUDA device's) generator states, as plain values."""
    version, internal, gauss = random.getstate()
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "random_rng_state": [version, list(internal), gauss],
        "np_rng_state": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),  # uint32 values fit in int64
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if include_cuda else None,
    }
    return state


def set_rng_state(state: dict[str, Any], include_cuda: bool) -> None:
    """Restores what ``get_rng_state`` returned."""
    version, internal, gauss = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["np_rng_state"]
    np.random.set_state(
        (
            np_state["algorithm"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_rng_state"])
    if include_cuda and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])


# ---------------------------------------------------------------------- file helpers


def _fsync_dir(path: str) -> None:
    """Makes a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(state: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(os.path.dirname(path))


def _write_tracker(checkpoints_dir: str, iteration: int) -> None:
    final = tracker_path(checkpoints_dir)
    tmp = f"{final}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(checkpoints_dir)


def _install(checkpoints_dir: str, tmp_dir: str, final_dir: str) -> None:
    """Renames the written ``tmp_dir`` to ``final_dir``, moving an existing one aside first."""
    old = None
    if os.path.exists(final_dir):
        old = f"{final_dir}.old-{os.getpid()}"
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(checkpoints_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(checkpoints_dir: str) -> None:
    """Deletes folders of saves that were killed midway (the tracker never points at them)."""
    mine = str(os.getpid())
    for path in glob.glob(os.path.join(checkpoints_dir, "iter_*.tmp-*")) + glob.glob(
        os.path.join(checkpoints_dir, "iter_*.old-*")
    ):
        if path.rsplit("-", 1)[-1] != mine and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def _distributed(trainer) -> bool:
    return trainer.pg.world_size > 1 and dist.is_available() and dist.is_initialized()


def _barrier(trainer) -> None:
    if _distributed(trainer):
        dist.barrier()


# ---------------------------------------------------------------------- save


def save_checkpoint(trainer) -> str:
    """Saves the trainer's state at ``trainer.iteration`` into ``--save``. Call on every rank.

    Data-parallel rank 0 of each model-parallel slice writes its file into a temporary
    folder named by global rank 0; rank 0 then renames the folder into place and
    updates the tracker. All ranks wait for that before returning.

    Returns:
        The path of this rank's checkpoint file (written by its DP rank 0).
    """
    cfg = trainer.cfg
    if cfg.checkpoint.ckpt_format == "torch_dist":  # sharded format: dist_checkpointing.py
        from megatron.training import dist_checkpointing

        return dist_checkpointing.save(trainer)
    save_dir = os.path.abspath(cfg.checkpoint.save)
    iteration = trainer.iteration
    start = time.perf_counter()
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch format")

    final_dir = os.path.join(save_dir, iteration_dir_name(iteration))
    tmp_name = [f"{iteration_dir_name(iteration)}.tmp-{os.getpid()}"]
    if trainer.pg.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
    if _distributed(trainer):
        dist.broadcast_object_list(tmp_name, src=0)  # every writer uses rank 0's folder
    tmp_dir = os.path.join(save_dir, tmp_name[0])

    include_cuda = trainer.device.type == "cuda"
    rng = get_rng_state(include_cuda)
    rng_states = [rng]
    if trainer.pg.dp is not None:
        rng_states = [None] * trainer.pg.dp_size
        dist.all_gather_object(rng_states, rng, group=trainer.pg.dp)

    path = os.path.join(tmp_dir, os.path.relpath(_rank_file(trainer, save_dir, iteration), final_dir))
    if trainer.pg.dp_rank == 0:
        state = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "consumed_samples": trainer.consumed_samples,
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "opt_param_scheduler": trainer.scheduler.state_dict(),
            "rng_state": rng_states,
            "config": config_to_dict(cfg),
        }
        _write_file(state, path)
    _barrier(trainer)  # every rank's file is on disk

    if trainer.pg.rank == 0:
        _install(save_dir, tmp_dir, final_dir)
        _write_tracker(save_dir, iteration)
        _remove_leftovers(save_dir)
    _barrier(trainer)  # nobody goes on (or exits) before the tracker points at this save
    trainer.last_checkpointed_iteration = iteration
    print_rank_0(
        f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir} "
        f"({time.perf_counter() - start:.2f} s)"
    )
    return _rank_file(trainer, save_dir, iteration)


# ---------------------------------------------------------------------- load


def read_tracker(checkpoints_dir: str) -> tuple[int, bool]:
    """Reads ``latest_checkpointed_iteration.txt``.

    Returns:
        ``(iteration, release)``; ``release`` is True for Megatron's ``release`` marker
        (iteration 0, weights only).

    Raises:
        ValueError: The tracker is missing, empty or not an iteration number.
    """
    path = tracker_path(checkpoints_dir)
    if not os.path.isfile(path):
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(checkpoints_dir, "iter_???????")))
        hint = f" It holds {', '.join(found)}: write the iteration to load (e.g. 5) into {path}." if found else ""
        raise ValueError(f"--load {checkpoints_dir}: tracker file {path} is missing.{hint}")
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise ValueError(
            f"tracker file {path} is corrupt: it holds {text[:40]!r}, expected an iteration number or 'release'. "
            "Write the iteration of a complete iter_XXXXXXX folder into it."
        )
    return iteration, False


def find_checkpoint(trainer, checkpoints_dir: str) -> tuple[str, int, bool] | None:
    """This rank's checkpoint file under ``checkpoints_dir``.

    Returns:
        ``(path, iteration, release)``, or None when the folder holds no checkpoint and
        is also the ``--save`` folder (a first run that will save there).

    Raises:
        ValueError: No checkpoint (folder missing or empty), corrupt tracker, or the
            tracker points at a folder or file that does not exist.
    """
    save = trainer.cfg.checkpoint.save
    resume_idiom = save is not None and os.path.abspath(save) == os.path.abspath(checkpoints_dir)
    has_tracker = os.path.isfile(tracker_path(checkpoints_dir))
    has_iters = bool(glob.glob(os.path.join(checkpoints_dir, "iter_???????")))
    if not has_tracker and not has_iters:
        if resume_idiom:
            return None
        what = "does not exist" if not os.path.isdir(checkpoints_dir) else "holds no checkpoint"
        raise ValueError(
            f"--load {checkpoints_dir} {what} (no {TRACKER_FILENAME}, no iter_* folders). Point --load at a "
            "folder written by --save, or drop --load to train from scratch."
        )
    iteration, release = read_tracker(checkpoints_dir)
    path = _rank_file(trainer, checkpoints_dir, iteration, release)
    if not os.path.isfile(path):
        # A save that re-wrote this iteration may have been killed between its two renames.
        rel = os.path.relpath(path, os.path.join(checkpoints_dir, iteration_dir_name(iteration, release)))
        aside = sorted(glob.glob(os.path.join(checkpoints_dir, iteration_dir_name(iteration, release) + ".old-*", rel)))
        if not aside:
            raise ValueError(
                f"tracker {tracker_path(checkpoints_dir)} points at iteration {iteration}, but {path} does not exist. "
                "Fix the tracker to name a complete iter_XXXXXXX folder."
            )
        path = aside[-1]
    return path, iteration, release


def _load_file(path: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
        raise ValueError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); it is truncated or corrupt."
        ) from e
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"checkpoint {path} is not a model_optim_rng.pt written by this trainer (no 'model' entry).")
    version = state.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version > CHECKPOINT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format version {version!r}; this trainer reads up to {CHECKPOINT_VERSION}. "
            "Update the trainer."
        )
    return state


@torch.no_grad()
def load_checkpoint(trainer) -> int:
    """Loads ``--load`` into the trainer (model, optimizer, scheduler, RNG, counters).

    Honours ``--no-load-optim``, ``--no-load-rng`` and ``--finetune``. Parameters and
    their ``main_grad`` keep their storage.

    Returns:
        The iteration training continues from (0 for --finetune or a fresh start).

    Raises:
        ValueError: No or unreadable checkpoint, or one saved for another model shape.
    """
    from megatron.training import dist_checkpointing  # torch_dist loads, and the format check

    loaded = dist_checkpointing.maybe_load(trainer)
    if loaded is not None:
        return loaded
    ckpt = trainer.cfg.checkpoint
    load_dir = os.path.abspath(ckpt.load)
    found = find_checkpoint(trainer, load_dir)
    if found is None:
        print_rank_0(f"> no checkpoint in {load_dir} (also the --save folder): training from scratch")
        return 0
    path, iteration, release = found
    print_rank_0(f"loading checkpoint from {load_dir} at iteration {iteration}")
    state = _load_file(path)
    check_config(state.get("config", {}), trainer.cfg, path)

    try:
        trainer.model.load_state_dict(state["model"], strict=True)  # copies into the existing tensors
    except RuntimeError as e:
        raise ValueError(f"checkpoint {path}: model weights do not fit this model: {e}") from e

    weights_only = ckpt.finetune or release
    if weights_only:
        trainer.iteration, trainer.consumed_samples = 0, 0
    else:
        trainer.iteration = int(state["iteration"])
        trainer.consumed_samples = int(state["consumed_samples"])

    if not weights_only and not ckpt.no_load_optim:
        trainer.optimizer.load_state_dict(state["optimizer"])
        dist_checkpointing.restore_scheduler(trainer, state["opt_param_scheduler"])
    else:
        trainer.optimizer.reload_model_params()  # fp32 main params from the loaded weights
        trainer.scheduler.num_steps = trainer.iteration
        trainer.scheduler.step(0)

    if not weights_only and not ckpt.no_load_rng:
        states: list[dict[str, Any]] = state["rng_state"]
        dp_rank = trainer.pg.dp_rank
        # Same DP size: each rank its own state; otherwise rank 0's, as Megatron does.
        chosen = states[dp_rank] if len(states) == trainer.pg.dp_size else states[0]
        set_rng_state(chosen, include_cuda=trainer.device.type == "cuda")

    trainer.last_checkpointed_iteration = None if weights_only else trainer.iteration
    print_rank_0(
        f"  successfully loaded checkpoint from {load_dir} at iteration {iteration}"
        + (" (weights only: starting at iteration 0)" if weights_only else "")
    )
    return trainer.iteration

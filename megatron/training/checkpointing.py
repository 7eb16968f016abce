"""Checkpoints in Megatron's per-rank ``torch`` layout, written atomically.

Layout under ``--save DIR`` (what Megatron's ``--ckpt-format torch`` writes)::

    DIR/latest_checkpointed_iteration.txt                 "100"
    DIR/iter_0000100/mp_rank_00/model_optim_rng.pt        TP rank 00, PP = 1
    DIR/iter_0000100/mp_rank_00_000/model_optim_rng.pt    TP rank 00, PP rank 000 (PP > 1)
    DIR/iter_0000100/mp_rank_00_000_001/...               ... EP rank 001 (EP > 1; no PP part at PP = 1)

One file per model-parallel rank, written by data-parallel rank 0 of that slice (with
EP > 1: expert-data-parallel rank 0 of each EP rank; every file holds the dense weights
and its EP rank's experts, as Megatron). A checkpoint saved at another EP size is
merged by global expert index at load (``torch_experts.py``). It
holds only plain Python values and tensors, so it loads with
``torch.load(weights_only=True)``: model state dict, optimizer state, LR-scheduler
state, RNG states (one entry per data-parallel rank, as Megatron), iteration,
consumed samples, the run config as a plain dict (dtypes as strings, no dataclasses)
and a format version.

The caller hands over a mapping of ``Stateful`` objects (``state_dict`` /
``load_state_dict``): ``model``, ``optimizer``, ``opt_param_scheduler`` and a
``TrainState`` under ``train_state``. Each object's state dict is stored under its
key, except the train state's, whose entries (iteration, consumed samples, counters,
RNG) sit at the top level of the file, where Megatron keeps them.

What is unusual:
- Atomic saves. Files go to ``DIR/iter_X.tmp-<pid>/`` and are fsynced; the folder is
  then renamed to ``DIR/iter_X`` and only after that the tracker is replaced (temp file
  + ``os.replace``). A process killed at any point leaves the previous checkpoint and a
  tracker that points at it. Re-saving an existing ``iter_X`` renames the old folder
  aside first; a loader that finds ``iter_X`` missing falls back to that copy.
- ``--load DIR`` with no checkpoint starts from scratch with Megatron's warning (the
  first run of ``--load X --save Y`` and of the auto-resume idiom ``--load X --save X``),
  except with ``--exit-on-missing-checkpoint`` and where ``--save`` holds checkpoints a
  run from scratch would save over: then an error names both folders.
- The model config is compared with the checkpoint's before any tensor is touched, and
  a mismatch names the file and every differing field.
- Loading never replaces parameter or ``main_grad`` storage (``copy_`` into the
  existing tensors), so CUDA graphs captured afterwards read the loaded weights.
- One run per ``--save`` folder: ``save_lock.SaveLock`` holds ``DIR/save.lock`` for
  the whole run; temporary folders of killed saves are removed only while holding it.
- A save that fails (full disk, I/O error) removes its temporary folder at once and
  says why ("no space left on DIR"); the tracker keeps pointing at the previous save.
- ``--no-load-optim`` keeps the LR schedule at the loaded iteration (Megatron restarts
  it from step 0); ``--finetune`` starts from iteration 0 with fresh optimizer state.
"""

import glob
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from megatron.core.config_utils import require
from megatron.training.checkpoint_config import check_config, check_expert_form, config_to_dict
from megatron.training.finite_state import refuse_non_finite
from megatron.training.logging_utils import print_rank_0
from megatron.training.save_lock import os_error_text, remove_leftovers
from megatron.training.train_state import TrainState

CHECKPOINT_VERSION = 1
"""Format version written into every file; loading a newer one is refused."""

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"

MODEL, OPTIMIZER, SCHEDULER, TRAIN_STATE = "model", "optimizer", "opt_param_scheduler", "train_state"
"""Keys of the mapping given to ``save_checkpoint`` / ``load_checkpoint`` (and of the file)."""
MAIN_PARAMS = "main_params"
"""In ``LoadedCheckpoint.loaded``: the optimizer's fp32 main params alone (--load-main-params-from-ckpt)."""

# Entries of the file that belong to the train state (top level, as Megatron).
_TRAIN_STATE_KEYS = (
    "iteration",
    "consumed_samples",
    "consumed_valid_samples",
    "skipped_train_samples",
    "skipped_iterations",
    "nan_iterations",
)


@runtime_checkable
class Stateful(Protocol):
    """What checkpointing saves and loads: torch's ``state_dict`` protocol."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LoadedCheckpoint(NamedTuple):
    """What ``load_checkpoint`` did.

    Attributes:
        path: The file read.
        iteration: The iteration training continues from (0 for weights only).
        loaded: Keys of the mapping whose state was loaded (``model`` always).
        weights_only: True for ``--finetune`` and Megatron's ``release`` checkpoints.
    """

    path: str
    iteration: int
    loaded: frozenset
    weights_only: bool


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
    ep_rank: int = 0,
    ep_size: int = 1,
    release: bool = False,
) -> str:
    """Path of one model-parallel rank's file.

    Returns:
        ``DIR/iter_XXXXXXX/mp_rank_{tp:02d}/model_optim_rng.pt`` for PP = 1, and
        ``.../mp_rank_{tp:02d}_{pp:03d}/...`` when ``pp_size > 1``, with ``_{ep:03d}``
        appended when ``ep_size > 1``.
    """
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    if ep_size > 1:
        rank_dir += f"_{ep_rank:03d}"
    return os.path.join(checkpoints_dir, iteration_dir_name(iteration, release), rank_dir, CHECKPOINT_FILENAME)


def _rank_file(pg, checkpoints_dir: str, iteration: int, release: bool = False) -> str:
    tp_rank = getattr(pg, "tp_rank", 0)
    pp_rank = getattr(pg, "pp_rank", 0)
    ep_size = getattr(pg, "ep_size", 1)
    ep_rank = pg.ep_rank if ep_size > 1 else 0
    return get_checkpoint_name(
        checkpoints_dir, iteration, tp_rank=tp_rank, pp_rank=pp_rank, pp_size=pg.pp_size, ep_rank=ep_rank,
        ep_size=ep_size, release=release,
    )  # fmt: skip


def _writes_file(pg) -> bool:
    """One writer per file: DP rank 0 of the model-parallel slice, with EP > 1 expert-DP rank 0."""
    return pg.expt_dp_rank == 0 if getattr(pg, "ep_size", 1) > 1 else pg.dp_rank == 0


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


def _distributed(pg) -> bool:
    return pg.world_size > 1 and dist.is_available() and dist.is_initialized()


def _barrier(pg) -> None:
    if _distributed(pg):
        dist.barrier()


def _train_state(state: Mapping[str, Stateful]) -> TrainState:
    train_state = state.get(TRAIN_STATE)
    assert isinstance(train_state, TrainState), f"the checkpoint mapping needs a TrainState under {TRAIN_STATE!r}"
    for key, obj in state.items():
        assert isinstance(obj, Stateful), f"{key!r} has no state_dict/load_state_dict"
    return train_state


# ---------------------------------------------------------------------- save


def kept_message(save_dir: str) -> str:
    """What a failed or refused save leaves in place, for its message."""
    tracker = tracker_path(save_dir)
    if os.path.isfile(tracker):
        return f"{tracker} still points at iteration {read_tracker(save_dir)[0]}"
    return "no earlier checkpoint exists"


def _failed_rank(pg, failed_here: bool) -> int | None:
    """The lowest rank whose write failed (None: none did); a collective over all ranks."""
    if not _distributed(pg):
        return pg.rank if failed_here else None
    flag = torch.tensor([pg.rank if failed_here else pg.world_size], dtype=torch.int64, device=pg.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    lowest = int(flag.item())
    return None if lowest == pg.world_size else lowest


def save_checkpoint(state: Mapping[str, Stateful], cfg, pg, save_dir: str | None = None) -> str:
    """Saves ``state`` at its train state's iteration into ``--save``. Call on every rank.

    Args:
        state: ``Stateful`` objects by key (``model``, ``optimizer``,
            ``opt_param_scheduler``, ``train_state``; see the module docstring).
        cfg: The run's ``RunConfig`` (``--save``; written into the file as plain values).
        pg: This rank's process groups.
        save_dir: The folder to save into instead of ``--save`` (non-persistent checkpoints).

    Data-parallel rank 0 of each model-parallel slice writes its file into a temporary
    folder named by global rank 0; rank 0 then renames the folder into place and
    updates the tracker. All ranks wait for that before returning.

    Returns:
        The path of this rank's checkpoint file (written by its DP rank 0).
    """
    train_state = _train_state(state)
    save_dir = os.path.abspath(save_dir or cfg.checkpoint.save)
    iteration = train_state.iteration
    start = time.perf_counter()
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch format")

    final_dir = os.path.join(save_dir, iteration_dir_name(iteration))
    tmp_name = [f"{iteration_dir_name(iteration)}.tmp-{os.getpid()}"]
    if pg.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
    if _distributed(pg):
        dist.broadcast_object_list(tmp_name, src=0)  # every writer uses rank 0's folder
    tmp_dir = os.path.join(save_dir, tmp_name[0])

    train = train_state.state_dict()
    rng = train.pop("rng_state")
    rng_states = [rng]
    if pg.dp is not None and not cfg.checkpoint.no_save_rng:
        rng_states = [None] * pg.dp_size
        dist.all_gather_object(rng_states, rng, group=pg.dp)

    path = os.path.join(tmp_dir, os.path.relpath(_rank_file(pg, save_dir, iteration), final_dir))
    skipped = {TRAIN_STATE} | ({OPTIMIZER, SCHEDULER} if cfg.checkpoint.no_save_optim else set())
    others = {key: obj.state_dict() for key, obj in state.items() if key not in skipped}
    refuse_non_finite(others, pg, iteration, kept_message(save_dir))
    error = None
    if _writes_file(pg):
        # Megatron's order: version, counters, model, optimizer, scheduler, RNG, args.
        contents = {"checkpoint_version": CHECKPOINT_VERSION}
        contents.update({k: train[k] for k in ("iteration", "consumed_samples")})
        contents.update(others)
        if not cfg.checkpoint.no_save_rng:
            contents["rng_state"] = rng_states
        contents["config"] = config_to_dict(cfg)
        contents.update({k: v for k, v in train.items() if k not in contents})
        try:
            _write_file(contents, path)
        except Exception as e:  # noqa: BLE001 - any failed write must reach the other ranks
            shutil.rmtree(tmp_dir, ignore_errors=True)  # at once: a full disk must not fill up further
            where = f" on rank {pg.rank}" if pg.world_size > 1 else ""
            error = RuntimeError(
                f"saving iteration {iteration} failed{where}: {os_error_text(e, save_dir)}. The partial "
                f"save was removed and {kept_message(save_dir)}. Free space or point --save at another folder."
            )
            error.__cause__ = e
    # Every rank's file is on disk, or every rank learns which rank failed (no one waits
    # in a barrier for a writer that gave up).
    failed = _failed_rank(pg, error is not None)
    if error is not None:
        raise error
    if failed is not None:
        if pg.rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise RuntimeError(
            f"saving iteration {iteration} failed on rank {failed} (its log says why); the partial save was "
            f"removed and {kept_message(save_dir)}."
        )

    if pg.rank == 0:
        _install(save_dir, tmp_dir, final_dir)
        _write_tracker(save_dir, iteration)
        remove_leftovers(save_dir)
    _barrier(pg)  # nobody goes on (or exits) before the tracker points at this save
    print_rank_0(
        f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir} "
        f"({time.perf_counter() - start:.2f} s)"
    )
    return _rank_file(pg, save_dir, iteration)


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


def iteration_to_load(checkpoints_dir: str, ckpt_step: int | None) -> tuple[int, bool]:
    """``(iteration, release)`` of the checkpoint to load: ``--ckpt-step``'s, else the tracker's.

    Raises:
        ValueError: ``--ckpt-step``'s folder is missing (the message lists the saved iterations),
            or the tracker is missing or corrupt.
    """
    if ckpt_step is None:
        return read_tracker(checkpoints_dir)
    if not os.path.isdir(os.path.join(checkpoints_dir, iteration_dir_name(ckpt_step))):
        found = sorted(int(os.path.basename(p)[5:]) for p in glob.glob(os.path.join(checkpoints_dir, "iter_???????")))
        raise ValueError(
            f"--ckpt-step {ckpt_step}: {checkpoints_dir} holds no {iteration_dir_name(ckpt_step)} folder "
            f"(saved iterations: {', '.join(map(str, found)) or 'none'}); pick one of them or drop --ckpt-step."
        )
    return ckpt_step, False


def has_checkpoint(checkpoints_dir: str) -> bool:
    """Whether ``checkpoints_dir`` holds a checkpoint (a tracker file or an ``iter_*`` folder)."""
    return os.path.isfile(tracker_path(checkpoints_dir)) or bool(
        glob.glob(os.path.join(checkpoints_dir, "iter_???????"))
    )


def find_checkpoint(cfg, pg, checkpoints_dir: str) -> tuple[str, int, bool] | None:
    """This rank's checkpoint file under ``checkpoints_dir``.

    Returns:
        ``(path, iteration, release)``, or None when the folder holds no checkpoint: the
        run starts from scratch, as Megatron's does (its warning printed).

    Raises:
        ValueError: No checkpoint with --exit-on-missing-checkpoint, or where the --save
            folder holds checkpoints a run from scratch would save over; a corrupt tracker,
            or one that points at a folder or file that does not exist.
    """
    if os.path.isfile(checkpoints_dir):
        parent = os.path.dirname(os.path.dirname(os.path.dirname(checkpoints_dir)))
        raise ValueError(
            f"--load {checkpoints_dir} is a file; --load takes the folder that --save wrote (the one holding "
            f"{TRACKER_FILENAME}), e.g. --load {parent}."
        )
    if not has_checkpoint(checkpoints_dir):
        what = "does not exist" if not os.path.isdir(checkpoints_dir) else "holds no checkpoint"
        what = f"--load {checkpoints_dir} {what} (no {TRACKER_FILENAME}, no iter_* folders)"
        require(
            not cfg.checkpoint.exit_on_missing_checkpoint,
            f"{what}, and --exit-on-missing-checkpoint asks for one. Point --load at a folder written by --save, "
            "or drop --exit-on-missing-checkpoint to train from scratch.",
        )
        save = cfg.checkpoint.save
        require(
            save is None or not has_checkpoint(save),
            f"{what}, but --save {save} holds checkpoints, which a run from scratch would save over. To resume "
            f"from them pass --load {save}; to start from scratch, give --save a new folder.",
        )
        print_rank_0(f"WARNING: could not find the metadata file {tracker_path(checkpoints_dir)}")
        print_rank_0("    will not load any checkpoints and will start from random")
        return None
    iteration, release = iteration_to_load(checkpoints_dir, cfg.checkpoint.ckpt_step)
    path = _rank_file(pg, checkpoints_dir, iteration, release)
    other_ep = _other_ep_files(pg, checkpoints_dir, iteration, release)
    if not os.path.isfile(path) and other_ep:
        path = other_ep[0]  # saved at another EP size: load_checkpoint merges the EP files
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


def _other_ep_files(pg, checkpoints_dir: str, iteration: int, release: bool) -> list[str]:
    """This TP/PP rank's files of a checkpoint saved at another EP size (EP-rank order), or []."""
    from megatron.training import torch_experts

    where = dict(tp_rank=getattr(pg, "tp_rank", 0), pp_rank=getattr(pg, "pp_rank", 0), pp_size=pg.pp_size)
    rank_dir = os.path.dirname(get_checkpoint_name(checkpoints_dir, iteration, release=release, **where))
    saved = torch_experts.saved_ep_size(os.path.dirname(rank_dir), os.path.basename(rank_dir))
    if saved is None or saved == getattr(pg, "ep_size", 1):
        return []
    return [
        get_checkpoint_name(checkpoints_dir, iteration, ep_rank=e, ep_size=saved, release=release, **where)
        for e in range(saved)
    ]


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


def require_saved(contents: Mapping[str, Any], path: str, ckpt, optimizer_keys: Sequence[str]) -> None:
    """Raises one ``ValueError`` naming every piece a resume needs that the checkpoint lacks because
    ``--no-save-optim`` / ``--no-save-rng`` left it out, and the load flags that do without it.

    Args:
        contents: The checkpoint's top-level entries.
        path: The checkpoint, for the message.
        ckpt: The ``CheckpointConfig`` (``--no-load-optim`` and ``--no-load-rng`` want less).
        optimizer_keys: The entries ``--no-save-optim`` drops in this format.
    """
    wanted = {} if ckpt.no_load_rng else {"rng_state": ("--no-save-rng", "--no-load-rng")}
    if not ckpt.no_load_optim:
        wanted.update(dict.fromkeys(optimizer_keys, ("--no-save-optim", "--no-load-optim")))
    missing = {key: flags for key, flags in wanted.items() if key not in contents}
    if missing:
        saved = sorted({save for save, _ in missing.values()})
        load = sorted({load for _, load in missing.values()})
        raise ValueError(
            f"checkpoint {path} holds no {', '.join(missing)} (saved with {' '.join(saved)}); "
            f"load it with {' '.join(load)}."
        )


@torch.no_grad()
def load_checkpoint(state: Mapping[str, Stateful], cfg, pg, load_dir: str | None = None) -> LoadedCheckpoint | None:
    """Loads ``load_dir`` (default ``--load``) into the ``Stateful`` objects of ``state`` (keys as for saving).

    Honours ``--no-load-optim`` (only ``model`` and ``train_state`` are loaded),
    ``--no-load-rng`` and ``--finetune`` (``model`` alone; the train state is reset to
    iteration 0). The caller does what a skipped optimizer needs (fp32 main params from
    the loaded weights, the LR schedule at the loaded iteration). The model's
    ``load_state_dict`` must copy into the existing tensors (``nn.Module``'s does), so
    parameters and their ``main_grad`` keep their storage.

    Returns:
        What was loaded, or None when there is nothing to load (auto-resume, first run).

    Raises:
        ValueError: No or unreadable checkpoint, or one saved for another model shape.
    """
    train_state = _train_state(state)
    ckpt = cfg.checkpoint
    load_dir = os.path.abspath(load_dir or ckpt.load)
    found = find_checkpoint(cfg, pg, load_dir)
    if found is None:
        return None
    path, iteration, release = found
    print_rank_0(f"loading checkpoint from {load_dir} at iteration {iteration}")
    contents = _load_file(path)
    check_config(contents.get("config", {}), cfg, path)
    check_expert_form(contents.get("config", {}), cfg, path)
    other_ep = _other_ep_files(pg, load_dir, iteration, release)
    if other_ep:
        from megatron.training import torch_experts

        files = [contents] + [_load_file(p) for p in other_ep[1:]]
        contents = torch_experts.merge(files, state[MODEL], cfg.moe.num_moe_experts, pg)

    try:
        state[MODEL].load_state_dict(contents[MODEL], strict=True)  # copies into the existing tensors
    except RuntimeError as e:
        raise ValueError(f"checkpoint {path}: model weights do not fit this model: {e}") from e
    loaded = {MODEL}

    weights_only = ckpt.finetune or release
    if not weights_only:
        require_saved(contents, path, ckpt, [k for k in state if k not in (MODEL, TRAIN_STATE)])
    if weights_only:
        train_state.iteration, train_state.consumed_samples, train_state.consumed_valid_samples = 0, 0, 0
    else:
        train = {k: contents[k] for k in _TRAIN_STATE_KEYS if k in contents}
        if not ckpt.no_load_rng:
            states: list[dict[str, Any]] = contents["rng_state"]
            # Same DP size: each rank its own state; otherwise rank 0's, as Megatron does.
            train["rng_state"] = states[pg.dp_rank] if len(states) == pg.dp_size else states[0]
        train_state.load_state_dict(train)
        loaded.add(TRAIN_STATE)
        if not ckpt.no_load_optim:
            for key, obj in state.items():
                if key not in (MODEL, TRAIN_STATE):
                    obj.load_state_dict(contents[key])
                    loaded.add(key)
    if ckpt.load_main_params_from_ckpt and OPTIMIZER in state:
        if "main_params" not in contents.get(OPTIMIZER, {}):
            raise ValueError(
                f"checkpoint {path} holds no optimizer state (saved with --no-save-optim), so no fp32 main params "
                "for --load-main-params-from-ckpt; drop the flag."
            )
        state[OPTIMIZER].load_main_params(contents[OPTIMIZER]["main_params"], path)
        loaded.add(MAIN_PARAMS)

    print_rank_0(
        f"  successfully loaded checkpoint from {load_dir} at iteration {iteration}"
        + (" (weights only: starting at iteration 0)" if weights_only else "")
    )
    return LoadedCheckpoint(path, train_state.iteration, frozenset(loaded), bool(weights_only))

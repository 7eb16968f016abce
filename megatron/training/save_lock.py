"""One run per ``--save`` folder: the save lock, the folder check and leftover cleanup.

``SaveLock`` holds ``DIR/save.lock`` (host and pid of the holder) for the whole run; a
second run refuses to start and names the holder. A lock whose holder is provably gone
(same host, pid not running) is removed; so are temporary folders of killed saves, and
only while holding the lock (``remove_leftovers``). ``os_error_text`` turns a failed
write into "no space left on DIR" or the OS's own words.
"""

import errno
import glob
import json
import os
import shutil
import socket
import time
from typing import Any

from megatron.training.logging_utils import print_rank_0

LOCK_FILENAME = "save.lock"

_HELD_LOCKS: dict[str, "SaveLock"] = {}  # absolute --save folder -> the lock this process holds


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _read_holder(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: held by someone unknown
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unknown run (the lock file cannot be read)"
    since = holder.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"host {holder.get('host')!r}, pid {holder.get('pid')}{when}"


def check_save_dir(save_dir: str) -> str:
    """Makes sure ``--save`` is a folder this process can write to (created if missing).

    Returns:
        The absolute path.

    Raises:
        ValueError: It is a file, or it cannot be created or written.
    """
    path = os.path.abspath(save_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--save {save_dir} is a file, not a folder; point --save at a folder (created if missing).")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--save {save_dir} cannot be created ({e.strerror}); pass a folder you can write to.") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--save {save_dir} is not writable; pass a folder you can write to.")
    return path


class SaveLock:
    """``DIR/save.lock``: one run at a time saves into a ``--save`` folder.

    The file holds the holder's host and pid as JSON, created with ``O_EXCL`` so two
    runs cannot both take it. A lock left by a process that no longer runs on this host
    is removed; one from another host is trusted (its process cannot be checked from
    here), and the error says which file to delete once that run is known to be gone.
    Taking it again in the same process is allowed (tests build several trainers).
    """

    def __init__(self, save_dir: str):
        self.save_dir = os.path.abspath(save_dir)
        self.path = os.path.join(self.save_dir, LOCK_FILENAME)
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self.held = False

    def _mine(self, holder: dict[str, Any] | None) -> bool:
        return bool(holder) and holder.get("host") == self.holder["host"] and holder.get("pid") == self.holder["pid"]

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise ValueError(
                f"--save {self.save_dir}: cannot create {self.path} ({os_error_text(e, self.save_dir)})."
            ) from e
        try:
            os.write(fd, json.dumps(self.holder).encode("utf-8"))
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            os.remove(self.path)
            raise ValueError(
                f"--save {self.save_dir}: cannot write {self.path} ({os_error_text(e, self.save_dir)})."
            ) from e
        os.close(fd)
        return True

    def _remove_stale(self, holder: dict[str, Any]) -> None:
        """Removes the lock of a dead process, unless another run replaced it meanwhile."""
        aside = f"{self.path}.stale-{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else removed it first
        if _read_holder(aside) != holder:  # a live run took the lock between our read and rename
            try:
                os.link(aside, self.path)  # put it back, unless yet another run holds it now
            except FileExistsError:
                pass
        os.remove(aside)
        print_rank_0(f"> removed the stale lock {self.path} of {_describe(holder)} (that process has ended)")

    def acquire(self) -> "SaveLock":
        """Takes the lock.

        Raises:
            ValueError: Another run holds it (the message names host and pid), or the
                folder cannot be written.
        """
        check_save_dir(self.save_dir)
        for _ in range(5):
            if self._create():
                break
            holder = _read_holder(self.path)
            if holder is None:
                continue  # released in the meantime
            if self._mine(holder):
                break
            stale = (
                holder.get("host") == self.holder["host"]
                and isinstance(holder.get("pid"), int)
                and not _pid_running(holder["pid"])
            )
            if not stale:
                raise ValueError(
                    f"--save {self.save_dir} is in use by another run ({_describe(holder)}): two runs saving into "
                    "one folder destroy each other's checkpoints. Stop that run or pick another --save folder; if "
                    f"that run is gone (e.g. its machine crashed), delete {self.path}."
                )
            self._remove_stale(holder)
        else:
            raise ValueError(f"--save {self.save_dir}: could not take {self.path}; another run keeps replacing it.")
        self.held = True
        _HELD_LOCKS[self.save_dir] = self
        return self

    def release(self) -> None:
        """Removes the lock file if this process holds it. Safe to call twice."""
        if not self.held:
            return
        self.held = False
        _HELD_LOCKS.pop(self.save_dir, None)
        if self._mine(_read_holder(self.path)):
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "SaveLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def os_error_text(e: BaseException, folder: str) -> str:
    """'no space left on DIR' for a full disk, else the OS's own words."""
    chain, seen = e, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"no space left on {folder}"
        if isinstance(chain, OSError) and chain.strerror:
            return f"{chain.strerror}: {chain.filename or folder}"
        chain = chain.__cause__ or chain.__context__
    try:
        st = os.statvfs(folder)
        if st.f_bavail == 0:
            return f"no space left on {folder}"
    except OSError:
        pass
    return f"{type(e).__name__}: {e}"


def remove_leftovers(checkpoints_dir: str) -> None:
    """Deletes folders of saves that were killed midway (the tracker never points at them).

    Only while this process holds the folder's ``SaveLock``: then any other writer has
    ended (it held the lock before us and released it, or was found dead).
    """
    if checkpoints_dir not in _HELD_LOCKS:
        return
    mine = str(os.getpid())
    for path in glob.glob(os.path.join(checkpoints_dir, "iter_*.tmp-*")) + glob.glob(
        os.path.join(checkpoints_dir, "iter_*.old-*")
    ):
        if path.rsplit("-", 1)[-1] != mine and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)

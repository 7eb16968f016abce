"""On-disk cache of dataset index arrays (.npy), written atomically.

Building a GPT dataset's document/sample/shuffle indices (or a blend's indices) is
deterministic given a description (data prefix, split, sequence length, seed, sample
count, ...). The arrays are saved under ``<cache dir>/<md5 of description>-<Class>-<split>-<name>.npy``
next to a ``description.txt`` a person can read.

Unusual here:
- Every file is written to a temporary name and renamed into place, the description
  last, so a crash or a second rank writing at the same time can never leave a partial
  file that a later run would load: ranks may build concurrently without a barrier.
- A miss that finds cached indices of the same dataset (``identity`` fields equal)
  built from other data files (the ``files`` field) warns that they are rebuilt and
  names what changed, so re-preprocessed data is never silently paired with old indices.
- Where the cache lives: ``--data-cache-path`` when given (an unwritable one is a user
  error); otherwise ``<data folder>/cache/<Class>_indices``, falling back to a folder
  under the system temp dir when the data folder is read-only.
"""

import glob
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

TMP_CACHE_ROOT = os.path.join(tempfile.gettempdir(), "megatron_index_cache")


def description_hash(description: dict) -> tuple[str, str]:
    """Returns (canonical JSON text, its md5 hex digest)."""
    text = json.dumps(description, sort_keys=True, indent=2)
    return text, hashlib.md5(text.encode("utf-8")).hexdigest()


def _atomic_write(path: str, write: Callable) -> None:
    # pid + random: unique even for ranks on different hosts writing to a shared file system.
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class CachedIndices:
    """Loads index arrays from the cache, or builds and saves them.

    Args:
        description: What the arrays depend on (JSON-serialisable); its hash names the files.
        prefix: File-name prefix after the hash, e.g. ``"GPTDataset-train"``.
        names: Array names, e.g. ``("document_index", "sample_index", "shuffle_index")``.
        explicit_dir: ``--data-cache-path`` (None: use default_dir).
        default_dir: Folder next to the data, or None for no default (mock data).
        identity: Description fields that name the dataset itself; a cached description
            that agrees on them but differs elsewhere is reported as outdated on a miss.

    Attributes:
        cache_hit: True when the arrays were loaded from disk.
        directory: Folder the arrays were loaded from or saved to (None: not cached).
    """

    def __init__(
        self,
        description: dict,
        prefix: str,
        names: Sequence[str],
        explicit_dir: str | None,
        default_dir: str | None,
        identity: Sequence[str] = (),
    ):
        self.description = description
        self.identity = tuple(identity)
        self.description_text, self.key = description_hash(description)
        self.prefix = prefix
        self.names = tuple(names)
        self.explicit_dir = explicit_dir
        if explicit_dir is not None:
            self.candidates = [explicit_dir]
        elif default_dir is not None:
            self.candidates = [default_dir, os.path.join(TMP_CACHE_ROOT, os.path.basename(default_dir))]
        else:
            self.candidates = []
        self.cache_hit = False
        self.directory: str | None = None

    def path(self, directory: str, name: str) -> str:
        suffix = "txt" if name == "description" else "npy"
        return os.path.join(directory, f"{self.key}-{self.prefix}-{name}.{suffix}")

    def _try_load(self, directory: str) -> dict[str, np.ndarray] | None:
        paths = [self.path(directory, n) for n in (*self.names, "description")]
        if not all(os.path.isfile(p) for p in paths):
            return None
        try:
            return {n: np.load(self.path(directory, n), mmap_mode="r", allow_pickle=False) for n in self.names}
        except (OSError, ValueError, EOFError) as e:
            logger.warning("ignoring unreadable index cache in %s (%s); rebuilding", directory, e)
            return None

    def _save(self, directory: str, arrays: dict[str, np.ndarray]) -> None:
        os.makedirs(directory, exist_ok=True)
        for name in self.names:
            _atomic_write(self.path(directory, name), lambda f, a=arrays[name]: np.save(f, a, allow_pickle=False))
        text = self.description_text.encode("utf-8")
        _atomic_write(self.path(directory, "description"), lambda f: f.write(text))

    def _report_outdated(self) -> None:
        """Warns when the only cached indices of this dataset were built from other data files."""
        if not self.identity:
            return
        new_files = self.description.get("files") or {}
        stale = None
        for directory in self.candidates:
            for path in sorted(glob.glob(os.path.join(glob.escape(directory), f"*-{self.prefix}-description.txt"))):
                try:
                    with open(path, encoding="utf-8") as f:
                        old = json.load(f)
                except (OSError, ValueError):
                    continue
                if not isinstance(old, dict) or any(old.get(k) != self.description.get(k) for k in self.identity):
                    continue
                old_files = old.get("files") or {}
                changed = sorted(k for k in set(old_files) | set(new_files) if old_files.get(k) != new_files.get(k))
                if not changed:
                    return  # indices of these files for other settings (sample count, seed, ...): not a rebuild
                stale = stale or (path, changed)
        if stale is not None:
            logger.warning(
                "rebuilding %s indices for %s: its data files changed since %s was cached (%s differ)",
                self.prefix,
                self.description.get("path_prefix"),
                stale[0],
                ", ".join(stale[1]),
            )

    def get(self, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Returns the arrays, from the first cache folder holding them or from ``build()``."""
        for directory in self.candidates:
            arrays = self._try_load(directory)
            if arrays is not None:
                self.cache_hit, self.directory = True, directory
                logger.info("loaded %s indices from %s", self.prefix, directory)
                return arrays
        self._report_outdated()
        arrays = build()
        for directory in self.candidates:
            try:
                self._save(directory, arrays)
            except OSError as e:
                if self.explicit_dir is not None:
                    raise ValueError(
                        f"--data-cache-path {self.explicit_dir} is not writable ({e.strerror}); "
                        "pass a folder you can write to."
                    ) from e
                logger.warning("cannot write index cache to %s (%s); trying the next location", directory, e.strerror)
                continue
            self.directory = directory
            logger.info("saved %s indices to %s", self.prefix, directory)
            break
        return arrays

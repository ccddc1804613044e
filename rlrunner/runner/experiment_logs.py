"""The logs of an experiment kept on a store (s3://, gs://, ...): written in a local folder, uploaded whole.

    logs = ExperimentLogs("s3://bucket/runs/exp", storage_options, "~/.cache/rlrunner", "exp")
    logs.restore()                      # on (re)start: the store's logs replace the local ones
    MetricsLogger(logs.local_dir, start_step, tensorboard)   # truncation and purge_step act on what was restored
    logs.upload()                       # at every checkpoint commit and at the end

An object store has no append, so `metrics.jsonl`, `recovery.jsonl` and the TensorBoard event files are written
in `local_dir` and each changed file is uploaded as a whole object. When the log folder is local, `local_dir` is
that folder and restore/upload do nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Any, Mapping

from rlrunner.errors import first_line
from rlrunner.runner.metrics import METRICS_FILE
from rlrunner.runner.recovery import RECOVERY_FILE
from rlrunner.storage import join, open_storage
from rlrunner.trackers.state import TRACKERS_FILE

logger = logging.getLogger(__name__)

TENSORBOARD_PREFIX = "events.out.tfevents."  # SummaryWriter's event files, one per writer


def is_log_file(name: str) -> bool:
    """Whether a file of the log folder is one of the logs (not a checkpoint, a lock or a temporary file)."""
    return name in (METRICS_FILE, RECOVERY_FILE, TRACKERS_FILE) or name.startswith(TENSORBOARD_PREFIX)


class ExperimentLogs:
    def __init__(
        self, log_url: str, storage_options: Mapping[str, Any] | None, local_cache_dir: str, experiment_name: str
    ):
        self.storage = open_storage(log_url, storage_options)
        self.url = self.storage.url  # normalized: an absolute path for a local folder
        self.remote = not self.storage.is_local
        if self.remote:
            # The URL's hash keeps two experiments of the same name (other buckets, other prefixes) apart.
            digest = hashlib.sha256(self.url.encode()).hexdigest()[:12]
            safe_name = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment_name) or "experiment"
            self.local_dir = os.path.join(os.path.abspath(os.path.expanduser(local_cache_dir)), f"{safe_name}-{digest}")
        else:
            self.local_dir = self.url
        self._uploaded: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) as last uploaded or restored

    def __repr__(self) -> str:
        return f"ExperimentLogs({self.url!r}, local_dir={self.local_dir!r})"

    def restore(self) -> list[str]:
        """Make `local_dir` hold the store's logs (the store is the truth after a restart on another machine):
        download each, and remove local log files the store does not have. Returns the names downloaded.

        Raises OSError (naming the URL) when the store cannot be read: going on would later overwrite its logs.
        """
        if not self.remote:
            return []
        os.makedirs(self.local_dir, exist_ok=True)
        names = [name for name in self.storage.list(self.url) if is_log_file(name)]
        for name in os.listdir(self.local_dir):
            if is_log_file(name) and name not in names:
                os.unlink(os.path.join(self.local_dir, name))  # a stale cache from an earlier run on this machine
        self._uploaded.clear()
        for name in names:
            local = os.path.join(self.local_dir, name)
            self.storage.get_file(join(self.url, name), local)
            self._uploaded[name] = _stamp(local)
        if names:
            logger.info("restored %d log files from %s into %s", len(names), self.url, self.local_dir)
        return names

    def upload(self) -> list[str]:
        """Upload every log file that changed since the last upload, each as one whole object. Returns the names
        uploaded. A failure is a warning: the file stays marked as changed and the next call tries again."""
        if not self.remote or not os.path.isdir(self.local_dir):
            return []
        done, pending = [], []
        for name in sorted(os.listdir(self.local_dir)):
            local = os.path.join(self.local_dir, name)
            if not is_log_file(name) or not os.path.isfile(local):
                continue
            stamp = _stamp(local)
            if self._uploaded.get(name) == stamp:
                continue
            pending.append((name, local, stamp))
        for index, (name, local, stamp) in enumerate(pending):
            try:
                self.storage.put_file(local, join(self.url, name))
            except Exception as exc:  # the run goes on; these files are uploaded again at the next call
                # A store that refuses one file refuses the rest: stop, so an unreachable endpoint costs one timeout.
                left = len(pending) - index - 1
                logger.warning(
                    "could not upload %s to %s (%s)%s; will retry at the next upload",
                    name,
                    self.url,
                    first_line(exc) or type(exc).__name__,
                    f", nor {left} more log files" if left else "",
                )
                break
            self._uploaded[name] = stamp
            done.append(name)
        return done


def _stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns

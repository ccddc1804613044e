"""What every tracker is (`Tracker`) and what they share: the metric values they accept and config redaction."""

from __future__ import annotations

import numbers
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REDACTED = "<redacted>"

# a key is secret when one of its words (split at non-alphanumerics and camelCase) ends in one of these:
# api_key, apiKey, aws_secret_access_key, session_token, hf_token, db_password; not max_new_tokens, tokenizer
_SECRET_ENDINGS = ("key", "secret", "token", "password", "passwd", "credential", "credentials")
_SECRET_SUBTREES = ("storage_options",)  # redacted whole: fsspec options may carry store credentials
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@]+@")


class Tracker(ABC):
    """One experiment tracker. Made once per driver; `open` starts or continues its run.

    `last_step()` is the newest step the tracker's store holds for the run (or will hold: steps sent by this
    process), -1 if none: the session sends only later steps, so no step is recorded twice.
    """

    name = "tracker"

    def __init__(self, cfg: Mapping[str, Any] | None, log_dir: Path, run_name: str, config: dict[str, Any]):
        self.cfg = dict(cfg or {})
        self.log_dir = Path(log_dir)
        self.run_name = run_name
        self.config = config  # the run's config, already redacted

    @abstractmethod
    def open(self, continue_state: dict[str, Any] | None) -> dict[str, Any]:
        """Start a run, or continue the one `continue_state` (this tracker's entry in trackers.json) names;
        returns the entry to keep for a later continue ({} for none)."""

    @abstractmethod
    def last_step(self) -> int:
        """The newest step the run holds (-1 if none)."""

    @abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics (numeric values only, see `numeric_metrics`)."""

    @abstractmethod
    def close(self, status: str) -> None:
        """End the run: status is "finished", "stopped" (on request; it will be resumed) or "failed"."""

    def begin_attempt(self, start_step: int) -> None:
        """An attempt starts after `start_step` (its first logged step is start_step + 1, or 0 at the start)."""

    def end_attempt(self) -> None:
        """An attempt ended; the run stays open for the next attempt of this driver."""


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """The values a tracker records: ints and floats (NaN and inf too), bools as 0.0/1.0; others are left out."""
    out: dict[str, int | float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, numbers.Integral):
            out[key] = int(value)
        elif isinstance(value, numbers.Real):
            out[key] = float(value)
    return out


def is_secret_key(name: str) -> bool:
    """True for a config key whose value may be a credential (see `_SECRET_ENDINGS`)."""
    return any(word.lower().endswith(_SECRET_ENDINGS) for word in _WORDS.findall(str(name)))


def redact_uri(text: str) -> str:
    """`text` with the user:password part of any URL in it replaced (http://u:p@host -> http://<redacted>@host)."""
    return _USERINFO.sub(rf"\1{REDACTED}@", text)


def redact(config: Any) -> Any:
    """A copy of a nested config (dicts, lists) safe to send to a tracker: values of secret-named keys and of any
    `storage_options` become "<redacted>", and URL credentials in strings are removed."""
    if isinstance(config, Mapping):
        return {
            key: REDACTED if key in _SECRET_SUBTREES or is_secret_key(key) else redact(value)
            for key, value in config.items()
        }
    if isinstance(config, (list, tuple)):
        return [redact(value) for value in config]
    if isinstance(config, str):
        return redact_uri(config)
    return config

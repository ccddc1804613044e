"""Does every node see the same checkpoint storage as the driver? A probe written by the driver, read by every worker.

Each worker that reads the driver's probe writes one of its own, which the driver must see in turn. On a local
disk this catches a checkpoint folder that is not shared between nodes; on a remote store (s3://, gs://, ...) a
node that cannot reach it: a missing package, an unreachable endpoint, missing or wrong credentials.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Sequence

from rlrunner.cluster.node import node_ip
from rlrunner.errors import StorageNotSharedError, first_line
from rlrunner.storage import Storage, join, open_storage

logger = logging.getLogger(__name__)

_REMOTE_ADVICE = (
    "every node that hosts a worker needs the store's fsspec package, network access to its endpoint and "
    "credentials (runner.storage_options, or the provider's variables and files on that node)"
)


def _cause(exc: BaseException) -> str:
    """The first line of why a storage call failed (storage errors are OSErrors whose strerror keeps the backend's
    words)."""
    return first_line(exc) or type(exc).__name__


def _probe_name(token: str) -> str:
    return f".probe-{token}"


def answer_probe(storage: Storage, url: str, token: str, node: str) -> str | None:
    """Worker side: None when `node` reads the driver's probe under `url` (and leaves its own there), else why not."""
    probe = join(url, _probe_name(token))
    try:
        seen = storage.read_bytes(probe)
    except Exception as exc:  # any backend error is an answer, not a crash of the worker
        return f"node {node} cannot read {probe} ({_cause(exc)})"
    if seen != token.encode():
        return f"node {node} reads other content in {probe}"
    own = join(url, f"{_probe_name(token)}-{node}-{os.getpid()}")
    try:
        storage.write_bytes(own, token.encode())
    except Exception as exc:
        return f"node {node} cannot write {own} ({_cause(exc)})"
    return None


def answer_probe_at(storage_url: str, storage_options: dict[str, Any], url: str, token: str, node: str) -> str | None:
    """`answer_probe` on a storage this process opens itself, so that a node lacking the store's package (or
    anything else `open_storage` needs) answers with the cause instead of failing the call."""
    try:
        storage = open_storage(storage_url, storage_options)
    except Exception as exc:
        return f"node {node} cannot open {storage_url} ({_cause(exc)})"
    return answer_probe(storage, url, token, node)


def check_shared_folder(storage: Storage, url: str, groups: Sequence) -> None:
    """Driver side: raise StorageNotSharedError unless every worker of `groups` reads and writes `url` (a folder on
    `storage`) as the driver does. Workers answer through their `probe_storage` method."""
    token = uuid.uuid4().hex
    probe = join(url, _probe_name(token))
    if storage.is_local:
        storage.makedirs(url)
        storage.write_bytes(probe, token.encode())  # a local folder the driver cannot write: its OSError as is
    else:
        try:
            storage.write_bytes(probe, token.encode())
        except Exception as exc:
            raise StorageNotSharedError(
                _remote_message(url, f"the driver on node {node_ip()} cannot write {probe} ({_cause(exc)})")
            ) from None
    try:
        args = (storage.url, storage.storage_options, url, token)
        problems = [p for group in groups for p in group.call_all("probe_storage", *args) if p]
        expected = sum(group.num_workers for group in groups)
        seen = len([name for name in storage.list(url) if name.startswith(f"{_probe_name(token)}-")])
        if not problems and seen != expected:
            problems.append(f"the driver sees {seen} of the {expected} probe files the workers wrote")
        if problems:
            if storage.is_local:
                raise StorageNotSharedError(
                    f"the checkpoint folder {url} is not the same folder on every node: {problems[0]}; "
                    "put runner.output_dir on storage that every node mounts at the same path"
                )
            raise StorageNotSharedError(_remote_message(url, problems[0]))
    finally:
        _remove_probes(storage, url, token)


def _remote_message(url: str, problem: str) -> str:
    return f"the checkpoint storage {url} is not reachable from every node: {problem}; {_REMOTE_ADVICE}"


def _remove_probes(storage: Storage, url: str, token: str) -> None:
    """Delete the driver's and the workers' probes; a failure here only leaves small files behind."""
    try:
        for name in storage.list(url):
            if name.startswith(_probe_name(token)):
                storage.delete(join(url, name))
    except Exception as exc:
        logger.warning("could not remove the storage probes %s* under %s (%s)", _probe_name(token), url, _cause(exc))

"""Shared fixtures: one local Ray instance for the whole session, and small fast run configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

# Ray's log monitor (one per node: the suite's Rays and its drivers' inherit this) looks for new worker log files
# every 0.1 s below this many files, every 0.5 s above: a suite's Ray gathers hundreds, so half a second from the start
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# Ray starts idle Python workers ahead of demand (a node's CPU count when it starts and when the first driver
# connects, more as tasks queue); the suite's actors each need a worker of their job's runtime env (the fork server's
# `py_executable`), so those are started and never used: a fifth of a short module's CPU
os.environ.setdefault("RAY_enable_worker_prestart", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Nothing of ours uses torch.compile, but vLLM compiles a helper of its sampler (the ranks of the sampled tokens, a
# count of integers) in each rollout worker: dynamo, inductor and a hash of triton's files, a third of a vLLM test's
# CPU. The suite runs it eagerly: the same integers
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _compile_own_sources() -> None:
    """Our sources compiled to bytecode once, for every process of the suite. Where PYTHONDONTWRITEBYTECODE is set (it
    is on this project's machines), Python reads `__pycache__` but never writes it: without this, each Ray worker,
    driver, rank and tool process compiled the rlrunner modules it imports again (0.3-0.6 s of CPU each). A source
    changed since is compiled again (its pyc records the source's time and size); user files the tests write are not
    touched."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for folder in ("rlrunner", "tests", "toolkits"):
        compileall.compile_dir(root / folder, quiet=1)


_compile_own_sources()


def _local_storage():
    from rlrunner.storage import open_storage

    return open_storage("/")


# Any local path or file:// URL is a URL on this one LocalStorage (tests that look at local checkpoints use it).
LOCAL = _local_storage()

# `model.*` settings of a one-layer model for tests that build models directly (no config loading).
TINY_MODEL_CFG = {
    "path": None,
    "dtype": "float32",
    "attn_implementation": "sdpa",
    "override_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
}

# A model small enough that a GRPO step takes well under a second on one CPU core.
# The tests' runs train on two actor ranks (sharded state and checkpoints, collectives, a rank to lose beside one that
# survives: what a one-rank run never exercises; the default job has one) and generate with one rollout worker (a
# process less to start): every run a test builds, in this process or on a command line, takes this layout.
TEST_LAYOUT = ["actor.num_workers=2", "rollout.num_workers=1"]

TINY_MODEL = [
    "+model.override_config.hidden_size=32",
    "+model.override_config.intermediate_size=64",
    "+model.override_config.num_hidden_layers=2",
    "+model.override_config.num_attention_heads=2",
    "+model.override_config.num_key_value_heads=1",
]


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """An experiment folder on a local disk, and on S3 (moto): the checkpoint handler tests
    (tests/checkpoint_fakes.py)."""
    from rlrunner.storage import open_storage

    from checkpoint_fakes import Store

    if request.param == "local":
        storage = open_storage(str(tmp_path))
        return Store(storage, storage.join(storage.url, "exp"))
    url, options = request.getfixturevalue("s3_store")
    return Store(open_storage(url, options), url + "/exp")


@pytest.fixture(scope="module")
def megatron_models():
    """The shared tiny test models of the Megatron-layout tests, by shape name (tests/megatron_models.py)."""
    from megatron_models import SHAPES, build_test_model

    return {name: build_test_model(overrides)[0] for name, overrides in SHAPES.items()}


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray with more logical CPUs than cores, so that several small worker groups fit on 2 cores.

    Kept from one module to the next, with the worker processes its runs park (`cluster.reuse_workers`): the modules
    that use it run first (`pytest_collection_modifyitems`), and it is shut down before the first test of a module
    that does not (those start a Ray of their own, a multi-node cluster, or none).
    """
    import ray

    global _kept
    if _kept != "ray_session":
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")
        _kept = "ray_session"
    yield ray


@pytest.fixture(scope="module")
def cluster():
    """The recovery tests' multi-node Ray cluster (tests/integration/recovery_helpers.py), with Ray connected to it.

    The head node (1 CPU) is this process's own `ray.init`, so runs park their worker groups for the next test as on
    a Ray a user starts (`cluster.reuse_workers`); a worker node with 2 CPUs (`cluster.actor_node`, which a test may
    replace) is joined to it. Kept from one module to the next like ray_session's Ray: the modules that use it run
    right after those.
    """
    global _kept, _kept_cluster
    if _kept != "cluster":
        _kept_cluster = _start_multi_node_cluster()
        _kept = "cluster"
    return _kept_cluster


def _start_multi_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, object_store_memory=150 * 1024**2, include_dashboard=False, logging_level="WARNING")
    nodes = Cluster()  # no head of its own: the nodes it adds join ray.init's
    nodes.head_node = ray._private.worker._global_node
    nodes.actor_node = nodes.add_node(num_cpus=2)  # where the actor group packs
    return nodes


_kept: str | None = None  # the shared Ray that is up: "ray_session" or "cluster" (the fixture's name)
_kept_cluster = None  # the cluster fixture's Cluster, while _kept == "cluster"
_worker_forks = None  # the fork server of the session's Ray workers, if it has integration tests
# the modules that use each shared Ray, in the order they run: all those of one, then those of the next, then the rest
_shared_modules: dict[str, set[str]] = {"ray_session": set(), "cluster": set()}


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def _run_order(item, slow_modules: set[str]) -> tuple[int, bool]:
    """The shared Rays' modules first (in `_shared_modules`' order), then the other modules with whole runs, then the
    rest: under xdist the longest groups start first and the many short ones fill the end."""
    shared = next((i for i, modules in enumerate(_shared_modules.values()) if _module(item) in modules), None)
    return len(_shared_modules) if shared is None else shared, _module(item) not in slow_modules


@pytest.hookimpl(tryfirst=True)  # before xdist's, which names each test's group from the marks set here
def pytest_collection_modifyitems(session, config, items) -> None:
    """The modules that use ray_session first, then those that use the cluster (each in their order), so that each
    set shares one Ray and its parked workers, then the other modules of slow tests, then the rest. Under xdist each
    set is one group, run whole by one worker (so its Ray and parked workers are started once), and every other
    module is a group of its own (its module-scoped fixtures built once); the groups start in this order
    (`--no-loadscope-reorder` in pyproject.toml: xdist would otherwise start those of the most tests first, and a
    module of one long test last)."""
    for fixture, modules in _shared_modules.items():
        modules.update(_module(item) for item in items if fixture in item.fixturenames)
    slow_modules = {_module(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _run_order(item, slow_modules))
    if config.pluginmanager.hasplugin("xdist"):  # `-n 2 --dist loadgroup` (pyproject.toml): what runs in one worker
        for item in items:
            shared = next((fixture for fixture, modules in _shared_modules.items() if _module(item) in modules), None)
            item.add_marker(pytest.mark.xdist_group(shared or _module(item)))


def _shut_down_kept_ray() -> None:
    global _kept, _kept_cluster
    import ray

    if _kept_cluster is not None:  # its worker nodes before the head (or their agents outlive them)
        for node in list(_kept_cluster.worker_nodes):
            _kept_cluster.remove_node(node)
        _kept_cluster = None
    ray.shutdown()
    _kept = None


def pytest_runtest_setup(item) -> None:
    if _kept is not None and _module(item) not in _shared_modules[_kept]:
        _shut_down_kept_ray()


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """In xdist's controller: every test a worker collected is named with its group (`@group`, from the marks
    `pytest_collection_modifyitems` sets). Where it is not (pytest 9.2 keeps node ids where pytest-xdist 3.8 does
    not write the suffix), every test would be scheduled alone: each worker would build the shared Rays and module
    fixtures again, and the suite take twice as long without failing; it stops at once instead."""
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid]
    if node.config.getvalue("dist") == "loadgroup" and ungrouped:
        pytest.exit(
            f"pytest-xdist does not group tests under pytest {pytest.__version__} ({ungrouped[0]} has no @group): "
            "install the test extras' pytest (pip install -e '.[test]'), or run with -n 0",
            returncode=4,
        )


def pytest_collection_finish(session) -> None:
    """Ray's workers forked from a preloaded server (tests/forked_ray_workers.py) when integration tests will run."""
    global _worker_forks
    if any("tests/integration/" in item.nodeid for item in session.items):
        from forked_ray_workers import serve_ray_workers

        _worker_forks = serve_ray_workers()


def pytest_sessionfinish(session) -> None:
    if _kept is not None:
        _shut_down_kept_ray()
    if _worker_forks is not None:
        from forked_ray_workers import stop

        ended = stop(_worker_forks)
        if ended is not None:  # not a failure (the workers started as Ray starts them), but the suite's time
            print(f"\nthe Ray worker fork server ended early (exit code {ended}): workers were started unforked")


def run_config(tmp_path: Path, *overrides: str):
    """A config for a short run writing under tmp_path (tiny model, small batch, no progress bar)."""
    from rlrunner.config import load_config

    base = [
        f"runner.output_dir={tmp_path}",
        "runner.experiment_name=test",
        "runner.max_steps=4",
        "runner.logger.progress_bar=false",
        "data.batch_size=4",
        "algorithm.group_size=4",
        "actor.micro_batch_size=4",
        "cluster.cpus_per_actor_worker=0.5",
        "cluster.cpus_per_rollout_worker=0.5",
        "cluster.placement_timeout_s=30",
        *TEST_LAYOUT,
        "data.synthetic.val_size=0",  # no validation set: tests that validate ask for one
        *TINY_MODEL,
    ]
    return load_config(base + list(overrides))


def actor_worker_kwargs(cfg) -> dict:
    """The keyword arguments of an actor worker class for `cfg` (a WorkerGroup built by hand in a test)."""
    from omegaconf import OmegaConf

    plain = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
    return {
        "model_cfg": plain(cfg.model),
        "actor_cfg": plain(cfg.actor),
        "algorithm_cfg": plain(cfg.algorithm),
        "init_seed": 1,
        "total_optimizer_steps": 10,
    }


class Inspect:
    """A Supervisor callback running test code once an attempt is ready to train and once it has trained to the end
    (its groups still up): how the tests look inside a run started the way users start one."""

    def __init__(self, on_start=None, on_end=None):
        self.on_start, self.on_end = on_start, on_end

    def on_train_start(self, trainer) -> None:
        if self.on_start is not None:
            self.on_start(trainer)

    def on_train_end(self, trainer) -> None:
        if self.on_end is not None:
            self.on_end(trainer)


def worker_pids(trainer) -> dict[str, list[int]]:
    """The process ids of an attempt's workers, by group name."""
    return {group.name: [host["pid"] for host in group.hosts] for group in trainer.groups()}


def error_line(capsys) -> str:
    """The one `rlrunner: error:` line the driver printed (and no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("rlrunner: error:")]
    assert len(lines) == 1, err
    return lines[0]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that equality is bit for bit (signed zeros, NaN payloads included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(ints[tensor.element_size()]) if tensor.is_floating_point() else tensor


def assert_bit_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert got[name].shape == expected[name].shape, name
        assert torch.equal(bits(got[name]), bits(expected[name])), f"{name} differs"


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics_lines(output_dir: Path) -> int:
    """The lines of the test experiment's metrics.jsonl (`run_config`'s experiment under `output_dir`)."""
    path = output_dir / "test" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def once(condition, action, timeout_s: float = 120) -> threading.Thread:
    """Run `action` in a thread as soon as `condition()` holds (polled every few ms)."""

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                action()
                return
            time.sleep(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# what a step's layout is, not what it computed: a run at other sizes logs other values
LAYOUT_METRICS = {"actor/dp_size", "rollout/num_workers", "actor/micro_batches"}


def without_time(records: list[dict]) -> list[dict]:
    """The metrics that must match between runs of the same numbers: without timings and the steps' layout."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in LAYOUT_METRICS} for r in records]


REPO = Path(__file__).resolve().parent.parent


def load_toolkit(name: str):
    """A script of toolkits/ckpt_convertor/ imported as a module (its main() called in-process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "toolkits" / "ckpt_convertor" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def repo_root() -> Path:
    return REPO


def repo_env() -> dict:
    """This process's environment with the repository first on PYTHONPATH: what a subprocess running our code needs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def subprocess_env() -> dict:
    return repo_env()


def run_toolkit(name: str, *args: str) -> None:
    """A script of toolkits/ckpt_convertor/ run as a user runs it, in a Python process of its own; fails the test if it
    exits with an error."""
    script = REPO / "toolkits" / "ckpt_convertor" / f"{name}.py"
    subprocess.run([sys.executable, str(script), *args], check=True, env=repo_env(), capture_output=True)


# -- an S3 API on 127.0.0.1 (moto), for the storage tests ---------------------------------------------

S3_BUCKET = "rlrunner-test"


@pytest.fixture(scope="session")
def moto_endpoint():
    """One moto S3 server on 127.0.0.1 (a free port) for the session, with the test bucket; stopped afterwards."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no request log lines
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=S3_BUCKET)
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_store(moto_endpoint, monkeypatch, request):
    """(an `s3://bucket/prefix` URL unique to the test, storage_options for it); also sets the AWS_* variables."""
    import uuid

    for name, value in {
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")  # never route the local endpoint through a proxy
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"},
    }
    return f"s3://{S3_BUCKET}/{request.node.name.split('[')[0]}-{uuid.uuid4().hex[:8]}", options

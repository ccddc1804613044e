"""The storage probe with real Ray workers: a local folder shared by every node, and an S3 store (moto) that
every node must reach; a node without credentials, or an endpoint that is not there, is named with its cause."""

from __future__ import annotations

import os
import re
import sys

import pytest
from ports import free_port
from ray import cloudpickle

from rlrunner.cluster.shared_storage import answer_probe, check_shared_folder
from rlrunner.cluster.worker import Worker
from rlrunner.cluster.worker_group import WorkerGroup
from rlrunner.errors import StorageNotSharedError
from rlrunner.storage import join, open_storage

# Ray workers cannot import this test module by name: ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Where botocore looks for credentials besides the storage options; IMDS is turned off so nothing leaves 127.0.0.1.
_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
)


class NodeWorker(Worker):
    """A worker whose "node" has credentials in its environment (as AWS_* variables or an instance profile give),
    except rank `without_credentials`, which has none."""

    def __init__(self, rank: int, world_size: int, without_credentials: int = -1):
        super().__init__(rank, world_size)
        for name in _CREDENTIAL_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(
            AWS_EC2_METADATA_DISABLED="true",
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            AWS_CONFIG_FILE=os.devnull,
            NO_PROXY="127.0.0.1",
        )
        if rank != without_credentials:
            os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")


@pytest.fixture(scope="module")
def workers(ray_session):
    """Two workers; the second one's node has no credentials of its own (it reaches a store only through options
    that carry them)."""
    group = WorkerGroup("probe", NodeWorker, 2, worker_kwargs={"without_credentials": 1}, cpus_per_worker=0.25)
    yield group
    group.shutdown()


def node() -> str:
    import ray

    return ray.util.get_node_ip_address()


def test_a_shared_local_folder_passes_and_keeps_nothing(workers, tmp_path):
    folder = str(tmp_path / "checkpoints")
    check_shared_folder(open_storage(str(tmp_path)), folder, [workers])
    assert os.listdir(folder) == []


def test_a_node_that_cannot_see_the_local_probe_says_so(tmp_path):
    local = open_storage(str(tmp_path))
    assert answer_probe(local, str(tmp_path), "abc", "10.0.0.7") == (
        f"node 10.0.0.7 cannot read {tmp_path}/.probe-abc (No such file or directory)"
    )
    (tmp_path / ".probe-abc").write_text("other")
    assert (
        answer_probe(local, str(tmp_path), "abc", "10.0.0.7")
        == f"node 10.0.0.7 reads other content in {tmp_path}/.probe-abc"
    )
    (tmp_path / ".probe-abc").write_text("abc")
    assert answer_probe(local, str(tmp_path), "abc", "10.0.0.7") is None
    assert len(list(tmp_path.glob(".probe-abc-10.0.0.7-*"))) == 1


def test_every_node_reaches_the_store(workers, s3_store):
    url, options = s3_store
    storage = open_storage(url, options)
    storage.write_bytes(join(url, "checkpoints", "keep"), b"x")
    check_shared_folder(storage, join(url, "checkpoints"), [workers])
    assert storage.walk(url) == {"checkpoints/keep": 1}  # the probes are gone, nothing else touched


def test_a_node_without_credentials_is_named(workers, s3_store, moto_endpoint):
    url, _ = s3_store
    # no credentials in the options: each node uses its own (the driver's come from the s3_store variables)
    storage = open_storage(url, {"client_kwargs": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"}})
    with pytest.raises(StorageNotSharedError) as caught:
        check_shared_folder(storage, url, [workers])
    message = str(caught.value)
    assert re.fullmatch(
        rf"the checkpoint storage {url} is not reachable from every node: node {re.escape(node())} cannot read "
        rf"{url}/\.probe-[0-9a-f]+ \(NoCredentialsError: Unable to locate credentials\); "
        r"every node that hosts a worker "
        r"needs the store's fsspec package, network access to its endpoint and credentials .*",
        message,
    ), message
    assert "\n" not in message
    assert storage.walk(url) == {}  # the driver's and the other node's probes are removed


def test_an_unreachable_endpoint_is_named(workers, s3_store):
    url, options = s3_store
    options = {
        **options,
        "client_kwargs": {**options["client_kwargs"], "endpoint_url": f"http://127.0.0.1:{free_port()}"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},  # botocore would retry for seconds
    }
    with pytest.raises(StorageNotSharedError) as caught:
        check_shared_folder(open_storage(url, options), join(url, "checkpoints"), [workers])
    message = str(caught.value)
    assert re.match(
        rf"the checkpoint storage {url}/checkpoints is not reachable from every node: "
        rf"the driver on node {re.escape(node())} "
        rf"cannot write {url}/checkpoints/\.probe-[0-9a-f]+ "
        r"\(EndpointConnectionError: Could not connect to the endpoint URL",
        message,
    ), message
    assert "\n" not in message


def test_a_node_lacking_the_store_package_is_named(workers):
    """What a worker answers when it cannot even open the store (here: a protocol fsspec does not know)."""
    answer = workers.call_rank(0, "probe_storage", "nosuchproto://bucket/x", {}, "nosuchproto://bucket/x", "abc")
    assert re.fullmatch(
        rf"node {re.escape(node())} cannot open nosuchproto://bucket/x \(.*fsspec knows no protocol.*\)", answer
    ), answer

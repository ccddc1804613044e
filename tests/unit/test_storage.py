"""rlrunner.storage against a local folder and a real S3 API (moto on 127.0.0.1): the same behaviour on both."""

from __future__ import annotations

import gc
import io
import os
import pickle
import threading
import warnings
import zlib

import pytest
import torch

from rlrunner.errors import ConfigError
from rlrunner.storage import ChecksumWriter, FileRecord, basename, is_url, join, open_storage, parent

from conftest import assert_bit_equal


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """(Storage, root URL) on a local folder or under a fresh s3:// prefix."""
    if request.param == "local":
        root = str(tmp_path / "store")
        return open_storage(root), root
    url, options = request.getfixturevalue("s3_store")
    return open_storage(url, options), url


def test_write_read_exists_size(store):
    storage, root = store
    url = storage.join(root, "data", "data.pt")
    record = storage.write_bytes(url, b"hello world")
    assert record == FileRecord(11, f"{zlib.crc32(b'hello world'):08x}")
    assert storage.read_bytes(url) == b"hello world"
    assert storage.exists(url) and storage.size(url) == 11
    assert storage.write_bytes(url, b"replaced").size == 8 and storage.read_bytes(url) == b"replaced"
    missing = storage.join(root, "nothing", "here.bin")
    assert not storage.exists(missing)
    for call in (storage.read_bytes, storage.size, storage.checksum):
        with pytest.raises(FileNotFoundError, match="here.bin"):
            call(missing)
    with pytest.raises(IsADirectoryError):
        storage.size(storage.join(root, "data"))


def test_list_walk_and_sizes(store):
    storage, root = store
    for name, data in {"a": b"1", ".hidden": b"22", "sub/b": b"333", "sub/deep/c": b"4444"}.items():
        storage.write_bytes(storage.join(root, name), data)
    storage.write_bytes(root + "-sibling/x", b"not mine")  # a key prefix that starts like `root`
    storage.write_bytes(storage.join(root, "sub-x", "y"), b"")

    assert storage.list(root) == [".hidden", "a", "sub", "sub-x"]
    assert storage.list(root, dirs_only=True) == ["sub", "sub-x"]
    assert storage.list(storage.join(root, "sub")) == ["b", "deep"]
    assert storage.walk(root) == {".hidden": 2, "a": 1, "sub-x/y": 0, "sub/b": 3, "sub/deep/c": 4}
    assert storage.walk(storage.join(root, "sub")) == {"b": 3, "deep/c": 4}
    assert storage.is_dir(storage.join(root, "sub")) and not storage.is_dir(storage.join(root, "a"))
    assert storage.exists(storage.join(root, "sub"))
    # a missing folder, or a file, has no children
    assert storage.list(storage.join(root, "missing")) == [] and storage.walk(storage.join(root, "missing")) == {}
    assert storage.list(storage.join(root, "a")) == [] and storage.walk(storage.join(root, "a")) == {}


def test_delete_and_delete_tree(store):
    storage, root = store
    for name in ("keep", "sub/b", "sub/deep/c", "sub-x/y"):
        storage.write_bytes(storage.join(root, name), name.encode())
    storage.delete(storage.join(root, "keep"))
    assert not storage.exists(storage.join(root, "keep"))
    storage.delete(storage.join(root, "keep"))  # again: a missing file is fine
    storage.delete_tree(storage.join(root, "sub"))
    assert not storage.exists(storage.join(root, "sub"))
    assert storage.walk(root) == {"sub-x/y": 7}  # the neighbour whose name starts the same survives
    storage.delete_tree(storage.join(root, "sub"))  # again: fine
    storage.delete_tree(root)
    assert storage.walk(root) == {} and storage.list(root) == []


def test_open_write_counts_size_and_crc(store):
    storage, root = store
    url = storage.join(root, "actor", "__0_0.distcp")
    chunks = [b"x" * 1000, bytearray(b"y" * 10), memoryview(b"z" * 77), b""]
    with storage.open_write(url) as writer:
        for chunk in chunks:
            writer.write(chunk)
        assert writer.tell() == 1087
    whole = b"".join(bytes(c) for c in chunks)
    assert writer.record() == FileRecord.of(whole) == storage.checksum(url)
    with storage.open_read(url) as handle:
        handle.seek(1000)
        assert handle.read(10) == b"y" * 10


def test_torch_save_through_the_writer(store):
    storage, root = store
    url = storage.join(root, "data", "data.pt")
    state = {"step": 3, "rng": torch.arange(5)}
    with storage.open_write(url) as writer:
        torch.save(state, writer)
    assert writer.record() == FileRecord.of(storage.read_bytes(url))
    loaded = torch.load(io.BytesIO(storage.read_bytes(url)), weights_only=True)
    assert loaded["step"] == 3 and torch.equal(loaded["rng"], state["rng"])


def test_failed_write_leaves_nothing(store):
    storage, root = store
    url = storage.join(root, "partial.bin")
    storage.write_bytes(storage.join(root, "other"), b"o")
    with pytest.raises(RuntimeError, match="killed"):
        with storage.open_write(url) as writer:
            writer.write(b"x" * 1000)
            raise RuntimeError("killed halfway")
    del writer
    gc.collect()  # an unfinished s3fs file left to its finalizer would commit what it holds
    assert not storage.exists(url)
    assert storage.walk(root) == {"other": 1}  # no temporary file left either


def test_large_multipart_write_and_abort(s3_store):
    """An s3 upload of several parts: complete on success, aborted (no object) on error."""
    url, options = s3_store
    storage = open_storage(url, options)
    storage.fs.default_block_size = 5 << 20  # S3's smallest part, so 11 MB makes three parts
    data = os.urandom(11 << 20)
    with storage.open_write(storage.join(url, "big")) as writer:
        for start in range(0, len(data), 1 << 20):
            writer.write(data[start : start + (1 << 20)])
    assert writer.record() == FileRecord.of(data) == storage.checksum(storage.join(url, "big"))
    with pytest.raises(RuntimeError):
        with storage.open_write(storage.join(url, "aborted")) as writer:
            writer.write(data)  # two parts already uploaded
            raise RuntimeError("killed")
    del writer
    gc.collect()
    assert storage.list(url) == ["big"]


def test_write_if_absent_has_one_winner(store):
    storage, root = store
    assert storage.supports_exclusive_create
    url = storage.join(root, "lock", "owner")
    barrier = threading.Barrier(2)
    results = {}

    def contend(name: str) -> None:
        contender = pickle.loads(pickle.dumps(storage))  # its own connection, as another process would have
        barrier.wait()
        results[name] = contender.write_if_absent(url, name.encode())

    threads = [threading.Thread(target=contend, args=(name,)) for name in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [name for name, won in results.items() if won]
    assert len(winners) == 1, results
    assert storage.read_bytes(url) == winners[0].encode()
    assert storage.write_if_absent(url, b"late") is False
    assert storage.read_bytes(url) == winners[0].encode()
    assert storage.walk(storage.join(root, "lock")) == {"owner": len(winners[0])}  # no temporary file left


def test_put_and_get_file(store, tmp_path):
    storage, root = store
    source = tmp_path / "metrics.jsonl"
    source.write_bytes(b'{"step": 1}\n' * 100)
    url = storage.join(root, "logs", "metrics.jsonl")
    assert storage.put_file(str(source), url) == FileRecord.of(source.read_bytes())
    target = tmp_path / "back.jsonl"
    storage.get_file(url, str(target))
    assert target.read_bytes() == source.read_bytes()
    with pytest.raises(FileNotFoundError):
        storage.get_file(storage.join(root, "missing"), str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_rename_dir_only_where_atomic(store):
    storage, root = store
    storage.write_bytes(storage.join(root, ".tmp-global_step_5-ab", "actor", "f"), b"f")
    source, target = storage.join(root, ".tmp-global_step_5-ab"), storage.join(root, "global_step_5")
    if not storage.supports_rename:
        assert not storage.is_local
        with pytest.raises(NotImplementedError):
            storage.rename_dir(source, target)
        return
    assert storage.is_local
    storage.rename_dir(source, target)
    assert storage.walk(root) == {"global_step_5/actor/f": 1}
    storage.write_bytes(storage.join(root, "other", "g"), b"g")
    with pytest.raises(FileExistsError):
        storage.rename_dir(storage.join(root, "other"), target)
    with pytest.raises(FileNotFoundError):
        storage.rename_dir(storage.join(root, "gone"), storage.join(root, "gone2"))


def test_pickles_as_url_and_options(store):
    storage, root = store
    storage.write_bytes(storage.join(root, "f"), b"f")
    copy = pickle.loads(pickle.dumps(storage))
    assert type(copy) is type(storage) and copy.url == storage.url
    assert copy.read_bytes(storage.join(root, "f")) == b"f"


def test_listings_are_never_stale(s3_store):
    """Another writer (another node) adds and removes objects: every listing and lookup must see it at once."""
    import boto3

    url, options = s3_store
    reader = open_storage(url, options)
    assert reader.list(url) == [] and not reader.exists(join(url, "global_step_5"))
    bucket, prefix = url[len("s3://") :].split("/", 1)
    other = boto3.client("s3", endpoint_url=options["client_kwargs"]["endpoint_url"])
    other.put_object(Bucket=bucket, Key=f"{prefix}/global_step_5/manifest.json", Body=b"{}")
    assert reader.list(url) == ["global_step_5"] and reader.exists(join(url, "global_step_5", "manifest.json"))
    other.delete_object(Bucket=bucket, Key=f"{prefix}/global_step_5/manifest.json")
    assert reader.list(url) == [] and not reader.exists(join(url, "global_step_5", "manifest.json"))
    assert reader.walk(url) == {}
    assert open_storage(url, options).fs is not reader.fs  # no shared instance (and no shared cache)


def test_s3_storages_share_botocore_data_not_sessions(s3_store):
    """Each S3 storage has a botocore session of its own (its credentials and configuration) whose data files (the
    endpoints, the S3 API's model) come through the process's one loader, so they are parsed once."""
    url, options = s3_store
    first, second = open_storage(url, options), open_storage(url, options)
    first.write_bytes(join(url, "x"), b"x")
    assert second.read_bytes(join(url, "x")) == b"x"
    assert first.fs.session is not second.fs.session
    loader = first.fs.session.get_component("data_loader")
    assert second.fs.session.get_component("data_loader") is loader
    assert open_storage(url).fs.session.get_component("data_loader") is loader  # credentials from the environment


def test_s3_from_environment_only(s3_store):
    """With no storage_options, the endpoint and keys come from AWS_* variables (as on a real cluster)."""
    url, _ = s3_store
    storage = open_storage(url)
    storage.write_bytes(join(url, "x"), b"x")
    assert storage.list(url) == ["x"]


def test_file_urls_and_local_paths(tmp_path, monkeypatch):
    by_url = open_storage(f"file://{tmp_path}/run")
    assert by_url.is_local and by_url.url == f"{tmp_path}/run"
    by_url.write_bytes(f"file://{tmp_path}/run/a/b", b"ab")
    assert open_storage(tmp_path / "run").read_bytes(f"{tmp_path}/run/a/b") == b"ab"  # a Path is fine locally
    monkeypatch.setenv("HOME", str(tmp_path))
    assert open_storage("~/run").url == f"{tmp_path}/run"
    monkeypatch.chdir(tmp_path)
    assert open_storage("run").list("run") == ["a"]
    assert open_storage("file://localhost" + str(tmp_path)).url == str(tmp_path)


@pytest.mark.parametrize(
    "url, words",
    [
        ("gs://bucket/runs", "pip install gcsfs"),
        ("abfs://container/runs", "pip install adlfs"),
        ("madeup://bucket/runs", "no protocol 'madeup://'"),
        ("hdfs://namenode:8020/runs", "hdfs://"),  # pyarrow is there, but no Java/libhdfs
        ("s3:/bucket/runs", "write s3://bucket/runs"),  # what pathlib makes of s3://bucket/runs
        ("s3://", "no bucket"),
        ("file://relative/runs", "absolute path"),
        ("simplecache::s3://bucket/runs", "chained"),
        ("", "non-empty"),
    ],
)
def test_open_storage_config_errors(url, words):
    with pytest.raises(ConfigError) as raised:
        open_storage(url)
    message = str(raised.value)
    assert words in message and "\n" not in message


def test_urls_of_another_store_are_refused(s3_store):
    url, options = s3_store
    storage = open_storage(url, options)
    with pytest.raises(ValueError):
        storage.exists("gs://elsewhere/x")
    with pytest.raises(ValueError, match="bucket"):
        storage.delete_tree("s3://" + url[len("s3://") :].split("/")[0])
    with pytest.raises(ValueError):
        open_storage("/tmp").exists("s3://bucket/x")


def test_errors_name_the_url(s3_store):
    url, options = s3_store
    storage = open_storage(url, options)
    missing = "s3://no-such-bucket-here/x"
    with pytest.raises(FileNotFoundError) as raised:
        storage.read_bytes(missing)
    assert missing in str(raised.value)


def test_errors_keep_their_kind_and_errno():
    from rlrunner.storage.base import naming

    with pytest.raises(PermissionError) as raised, naming("s3://b/k"):
        raise PermissionError(13, "Access Denied")
    assert raised.value.errno == 13 and "s3://b/k" in str(raised.value) and "Access Denied" in str(raised.value)
    with pytest.raises(OSError) as raised, naming("s3://b/k"):
        raise KeyError("a library's own error")
    assert "s3://b/k" in str(raised.value) and "KeyError" in str(raised.value)


def test_url_helpers():
    assert is_url("s3://b/x") and is_url("gs://b") and not is_url("/data/x") and not is_url("file:///data/x")
    assert join("s3://b/", "run/", "/checkpoints", "global_step_5") == "s3://b/run/checkpoints/global_step_5"
    assert join("/data/", "a") == "/data/a" and join("s3://b") == "s3://b"
    with pytest.raises(ValueError):
        join("/data", "../etc")
    assert parent("s3://b/run/ckpt/") == "s3://b/run" and parent("s3://b") == "s3://b" and parent("/a") == "/"
    assert basename("s3://b/run/global_step_5/") == "global_step_5"


def test_checksum_writer_wraps_any_stream():
    buffer = io.BytesIO()
    writer = ChecksumWriter(buffer)
    assert writer.write(b"abc") == 3 and writer.write(memoryview(b"defg")) == 4
    assert buffer.getvalue() == b"abcdefg" and writer.record() == FileRecord.of(b"abcdefg")
    assert writer.record().as_dict() == {"size": 7, "crc32": f"{zlib.crc32(b'abcdefg'):08x}"}


def test_dcp_fsspec_writer_and_reader_on_s3(s3_store):
    """torch.distributed.checkpoint straight to S3 through its fsspec writer/reader, given the storage's options."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    url, options = s3_store
    storage = open_storage(url, options)
    actor = storage.join(url, "global_step_5", "actor")
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5), "step": 5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled ... single process"
        # sync_files=False: an S3 object is durable once its PUT returns (with True, DCP calls os.sync() per file)
        # no checkpoint_id=: DCP's reset(checkpoint_id) would rebuild the filesystem without the options
        dcp.save(state, storage_writer=FsspecWriter(actor, sync_files=False, **storage.storage_options), no_dist=True)
        assert sorted(storage.walk(actor)) == [".metadata", "__0_0.distcp"]
        loaded = {"w": torch.zeros(3, 4), "b": torch.zeros(5), "step": 0}
        dcp.load(loaded, storage_reader=FsspecReader(actor, **storage.storage_options), no_dist=True)
    assert loaded.keys() == state.keys() and loaded["step"] == 5
    assert_bit_equal({k: loaded[k] for k in ("w", "b")}, {k: state[k] for k in ("w", "b")})

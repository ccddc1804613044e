"""The suite's Ray worker processes, each forked from one server that imported torch and transformers' model code
once (as tests/spawned_ranks.py does for the ranks of a test's own process group).

A Ray worker spent about 3 s of CPU importing before its actor's constructor ran, and the suite starts about 250 of
them: most of its CPU. Ray starts a worker by running a Python on `default_worker.py`, and a runtime env's
`py_executable` names another command for that. Here it is this file run as a client without site packages
(`python -S`, a few milliseconds): it hands its argv, environment, working directory and standard streams to the
server, which forks a child that takes them on and runs `default_worker.py` as the raylet asked. The client stays
until the child ends and exits with its status; a signal it gets goes to the child, and a client that is killed takes
its child with it (the server sees its connection close). The child registers with the raylet under its own pid: the
one Ray kills, and the one a test's `os.getpid()` in the actor returns. It gets a session of its own, as Ray gives
its workers, and exits as an interpreter does (threads joined, atexit callbacks run).

Before it, Ray runs its `setup_worker.py` (a fresh interpreter importing Ray, 0.7 s of CPU) to exec that command; the
nodes the test process starts run tests/ray_setup_worker.py instead, which becomes the client itself.

The job config is set in the environment (`RAY_JOB_CONFIG_JSON_ENV_VAR`, what `ray job submit` gives a driver), so
every `ray.init` of the test process and of the drivers it starts merges it in. Until the server listens, and if it
goes, a client execs the worker Ray asked for.

The server imports no Ray (its native part keeps the auth token it first reads) and starts no thread before it forks,
so a child starts as clean as a fresh interpreter. What differs from a fresh worker, and what is done about it:
- libraries' import-time reads of the environment happened under the server's: torch's thread count is set again
  from the worker's OMP_NUM_THREADS (Ray sets it from the actor's CPUs), numpy's global seed is drawn again, and
  OpenBLAS keeps one thread;
- `sys.path` is rebuilt from the worker's PYTHONPATH;
- the string hash seed is the server's, shared by all children (a fresh interpreter draws its own);
- vLLM's modules were imported with Ray hidden: those that import it optionally hold none (its Ray executors' code;
  a rollout worker runs vLLM's engine in-process or with vLLM's own multiprocessing, which never use it);
- `/proc/<pid>/environ` and the command line show the server's (a test that finds processes by a marker in their
  environment, test_embedded_ray.py, finds the worker's client, which takes the worker along when killed).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys

# What a worker imports before its constructor runs (transformers' model code included); a name that fails to
# import is skipped by the server (the workers then import it themselves).
PRELOAD = [
    # not ray: a worker forked with Ray imported dies starting its core worker (Ray's native part keeps what it read
    # of the environment at import, which is the server's)
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
]
# Ray's own dependencies (its import in each worker, after the fork: 0.35 -> 0.24 s of CPU), and what its serialization
# context imports at a worker's first deserialization (pydantic's field types, starlette's State, pyarrow: 0.3 s of CPU
# a worker; pyarrow starts jemalloc's background thread unless the server's environment turns it off, below)
RAY_DEPENDENCIES = [
    "requests",
    "jsonschema",
    "urllib3",
    "google.protobuf.internal.builder",
    "google.protobuf.descriptor_pool",
    "google.protobuf.json_format",
    "google.protobuf.text_format",
    "pydantic",
    "pydantic.main",
    "pydantic.fields",
    "pydantic.v1.fields",
    "packaging.version",
    "starlette.datastructures",
    "pyarrow",
    "pyarrow.json",
    "yaml",
    "msgpack",
    "uvloop",
]
# what vLLM's engine imports besides vLLM itself (which imports Ray): 2 s of CPU in each rollout worker of a `vllm`
# run; absent without vLLM installed
VLLM_PRELOAD = ["torch._inductor.lowering", "openai", "fastapi", "aiohttp", "networkx"]
# vLLM's own engine, CPU worker and the model the tests run (~3 s of CPU in each of its rollout workers), imported
# with Ray hidden: vLLM imports it only for executors of its own, which a rollout worker does not use (its engine
# runs in-process or in processes of vLLM's multiprocessing executor), and those modules then hold no Ray. Its logging
# is set up at import: as the engine sets it up (rlrunner/rollout/vllm_engine.py)
VLLM_MODULES = [
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.qwen2",
]

_HEADER = struct.Struct("<Q")
SETUP_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_setup_worker.py")
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # ray._private.runtime_env.constants: its name is its value
_default_threads = 1  # torch's thread count with no OMP_NUM_THREADS, read by the server
_site_path: list[str] = []  # the server's sys.path without its script's folder and its PYTHONPATH


def client_command(socket_path: str) -> str:
    """The `py_executable` of a runtime env whose workers are forked by the server at `socket_path`."""
    return f"{sys.executable} -S {os.path.abspath(__file__)} --client {socket_path}"


def client_socket(py_executable: str) -> str | None:
    """The server's socket path if `py_executable` is `client_command`'s, else None."""
    prefix = client_command("")
    if not py_executable.startswith(prefix):
        return None
    return py_executable[len(prefix) :] or None


def serve_ray_workers() -> subprocess.Popen:
    """Start the fork server and have every Ray job begun from now on (this process's `ray.init`, and the drivers it
    starts, which inherit the environment) start its Python workers from it. Until the server listens (its imports
    take a few seconds), and if it goes, workers start as Ray starts them. Stop it with `stop`."""
    socket_path = f"/tmp/rlrunner-forks-{os.getpid()}.sock"  # short: a Unix socket's path must fit 107 bytes
    # no OMP_NUM_THREADS: the server reads torch's default thread count; OpenBLAS one thread: numpy starts no thread
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["JE_ARROW_MALLOC_CONF"] = "background_thread:false"  # pyarrow's jemalloc: no thread at import either
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", socket_path], env=env, start_new_session=True
    )
    # what `ray job submit` gives its driver: a job config whose runtime env every `ray.init` of the job merges in
    os.environ[JOB_CONFIG_ENV] = json.dumps({"runtime_env": {"py_executable": client_command(socket_path)}})
    # the nodes this process starts run tests/ray_setup_worker.py, not Ray's setup_worker.py (an absolute file name
    # is the whole path Ray joins it to)
    from ray._private import ray_constants

    server.setup_worker = ray_constants.SETUP_WORKER_FILENAME
    ray_constants.SETUP_WORKER_FILENAME = SETUP_WORKER
    server.socket_path = socket_path
    return server


def stop(server: subprocess.Popen) -> int | None:
    """Stop the fork server; jobs begun after this start their workers as Ray does. Returns the server's exit code
    if it had ended before (its workers were then started as Ray does, at the imports' cost)."""
    os.environ.pop(JOB_CONFIG_ENV, None)
    from ray._private import ray_constants

    ray_constants.SETUP_WORKER_FILENAME = server.setup_worker
    ended = server.poll()
    server.kill()
    server.wait()
    if os.path.exists(server.socket_path):
        os.unlink(server.socket_path)
    return ended


# -- the client: Ray's py_executable (stdlib only, run with -S) ---------------------------------------------------


def _send(conn: socket.socket, request: dict, fds: list[int]) -> None:
    message = _HEADER.pack(len(data := json.dumps(request).encode())) + data
    sent = socket.send_fds(conn, [message], fds)
    conn.sendall(message[sent:])  # what one sendmsg did not take (the server reads up to the header's size)


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def run_client(socket_path: str, argv: list[str]) -> None:
    """Have the server fork the worker `argv` asks for, and stand for it until it ends (never returns)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError:  # no server (not started yet, or gone): the worker Ray would have started
        os.execv(sys.executable, [sys.executable, *argv])
    _send(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2])
    (child,) = struct.unpack("<q", _recv_exact(conn, 8))

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    try:
        (status,) = struct.unpack("<q", _recv_exact(conn, 8))
    except EOFError:  # the server is gone
        os.kill(child, signal.SIGKILL)
        os._exit(1)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


# -- the server ------------------------------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    message, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
    (size,) = _HEADER.unpack(message[: _HEADER.size])
    data = message[_HEADER.size :]
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return json.loads(data), fds


def _run_child(request: dict, fds: list[int], listener: socket.socket, others: list[int]) -> None:
    """In the forked child: become the worker the raylet started (never returns)."""
    code = 1
    try:
        os.setsid()  # a process group of its own, as Ray gives its workers (Ray signals the group, not the server's)
        listener.close()
        for fd in others:
            os.close(fd)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _as_a_fresh_import()
        sys.argv = list(request["argv"])
        # the path a fresh `python default_worker.py` would have: its folder, its PYTHONPATH, then the site's
        sys.path[:] = [os.path.dirname(os.path.abspath(sys.argv[0])), *_pythonpath(), *_site_path]
        import runpy

        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as exit:
            if exit.code is None or isinstance(exit.code, int):
                code = exit.code or 0
            else:
                print(exit.code, file=sys.stderr)
        # the interpreter's own exit: non-daemon threads joined, then the atexit callbacks (Ray's among them)
        import atexit
        import threading

        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _pythonpath() -> list[str]:
    return [os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]


def _as_a_fresh_import() -> None:
    """What the preloaded libraries would have taken from the worker's environment and the OS had it imported them:
    torch's thread count (Ray sets OMP_NUM_THREADS from the actor's CPUs), and numpy's global seed (Python's
    `random` is reseeded by the fork itself)."""
    import numpy
    import torch  # noqa: F401 - preloaded

    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else _default_threads)
    numpy.random.seed()


def _serve(socket_path: str) -> None:
    import selectors
    import threading

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.modules["ray"] = None  # `import ray` raises ImportError (vLLM's optional imports of it give up)
    try:
        for name in [*PRELOAD, *RAY_DEPENDENCIES, *VLLM_PRELOAD, *VLLM_MODULES]:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the workers import it themselves, and fail there if they must
                pass
    finally:
        del sys.modules["ray"]
    global _default_threads, _site_path
    own = {os.path.abspath(sys.path[0]), *_pythonpath()}
    _site_path = [entry for entry in sys.path[1:] if os.path.abspath(entry) not in own]
    if "torch" in sys.modules:
        _default_threads = sys.modules["torch"].get_num_threads()
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, "threads before forking"
    # the preloaded libraries' objects out of the collector's reach: a worker's full collection (each `release`, and
    # Python's own as objects pile up) then walks only what the worker made, not ~600k objects (0.2-0.3 s each)
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    listener.bind(socket_path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, ("accept", None))
    children: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (client connection, pid)
    parent = os.getppid()
    while os.getppid() == parent:  # the test process gone (killed, say): so is the server
        for key, _ in selector.select(timeout=1.0):
            kind, data = key.data
            if kind == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _recv_request(conn)
                except (EOFError, OSError, ValueError):
                    conn.close()
                    continue
                others = [c.fileno() for c, _ in children.values()] + list(children)
                pid = os.fork()
                if pid == 0:
                    _run_child(request, fds, listener, others + [conn.fileno(), selector.fileno()])
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (conn, pid)
                selector.register(pidfd, selectors.EVENT_READ, ("exit", pidfd))
                selector.register(conn, selectors.EVENT_READ, ("client", pidfd))
                conn.sendall(struct.pack("<q", pid))
            elif kind == "exit":  # a child ended: its status to its client
                conn, pid = children.pop(data)
                _, status = os.waitpid(pid, 0)
                selector.unregister(data)
                os.close(data)
                if conn.fileno() in selector.get_map():
                    selector.unregister(conn)
                try:
                    conn.sendall(struct.pack("<q", status))
                except OSError:
                    pass
                conn.close()
            elif kind == "client":  # a client went (killed): its child goes too
                conn, pid = children.get(data, (None, 0))
                if conn is not key.fileobj:
                    # the child's exit, earlier in this batch, closed this client (and its pidfd's number may be a
                    # new child's by now): nothing left to do, and nobody else's child to touch
                    continue
                if not conn.recv(1):
                    selector.unregister(conn)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        run_client(sys.argv[2], sys.argv[3:])
    else:
        _serve(sys.argv[2])

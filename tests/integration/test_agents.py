"""Multi-turn, tool-using runs on real Ray: reproducible bit for bit, and every tool call made once.

The job: the tests' tiny model, every turn of which calls a tool (the parser reads any turn's text as a call to
`echo`), three turns a trajectory; the tool appends each call to a file, so that the calls made can be counted against
the calls the trajectories record. One uninterrupted reference run is compared with the same job stopped in the middle
of a tool call and resumed, and on two rollout workers killed while a trajectory waits on a tool and as one starts a
second turn: the same metrics and weights, bit for bit, and the tool called once per recorded call (plus the calls a
killed worker had under way, which recovery.jsonl names). Then the same at `algorithm.policy_lag=1`, with the worker
killed during a generation ahead.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray
from ray import cloudpickle
from recovery_helpers import recovery_events

from rlrunner.runner.supervisor import Supervisor
from rlrunner.tools.convert import load_model_weights

from conftest import Inspect, assert_bit_equal, read_metrics, run_config, without_time

pytestmark = pytest.mark.slow

TOOLS = '''
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def echo(text: str) -> str:
    """Echo a turn back, with its length.

    Args:
        text: the turn
    """
    with open(os.path.join(HERE, "calls.txt"), "a") as handle:  # every call made, counted
        handle.write(repr(text) + "\\n")
    if os.path.exists(os.path.join(HERE, "arm")) and not os.path.exists(os.path.join(HERE, "fired")):
        open(os.path.join(HERE, "fired"), "w").close()
        open(os.path.join(HERE, "waiting"), "w").close()  # the test acts while this call is under way
        time.sleep(2.0)
    return f"{len(text)}:{text[::-1]}"


def parse(text):
    """Every turn calls echo with its text."""
    return [{"name": "echo", "arguments": {"text": text}}] if text else []
'''

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info):
    trajectory = extra_info["trajectory"]
    made = [call for call in trajectory["tool_calls"] if call.get("made", True)]
    return {"score": float(solution_str.strip() == str(ground_truth)) + 0.1 * len(made),
            "turns": trajectory["turns"], "echoed": sum(call["output"].startswith(str(len(call["arguments"]["text"])))
                                                        for call in made)}
"""

STEPS = 6
JOB = [
    "data.synthetic.num_problems=26",
    f"runner.max_steps={STEPS}",
    "runner.save_interval=3",
    "rollout.max_new_tokens=3",
    "rollout.generation_batch_size=2",  # two chunks a step: one on each of two rollout workers
    "rollout.multi_turn.max_turns=3",
    "rollout.multi_turn.max_tool_output_tokens=8",
    "actor.optim.lr=0.01",
]
LAG1 = ["algorithm.policy_lag=1", "algorithm.rollout_correction.tis_cap=2.0"]


def job(folder: Path, *overrides: str):
    """The job's config writing under `folder`, with its tools, parser and reward written there."""
    user = folder / "user"
    user.mkdir(parents=True, exist_ok=True)
    (user / "tools.py").write_text(textwrap.dedent(TOOLS))
    (user / "reward.py").write_text(textwrap.dedent(REWARD))
    return run_config(
        folder,
        *JOB,
        f"rollout.multi_turn.tools={user / 'tools.py'}",
        f"rollout.multi_turn.parser={user / 'tools.py'}:parse",
        f"reward.function={user / 'reward.py'}",
        *overrides,
    )


def calls_made(folder: Path) -> int:
    path = folder / "user" / "calls.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def calls_recorded(metrics: list[dict]) -> int:
    """The tool calls the run's trajectories hold (16 trajectories a step)."""
    return round(sum(m["agent/tool_calls_mean"] * 16 for m in metrics))


def assert_same_run(folder: Path, reference: Path) -> None:
    metrics = read_metrics(folder / "test" / "metrics.jsonl")
    expected = read_metrics(reference / "test" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert without_time(metrics) == without_time(expected)
    final = f"checkpoints/global_step_{STEPS}"
    assert_bit_equal(load_model_weights(folder / "test" / final), load_model_weights(reference / "test" / final))


def _run(folder: Path, *overrides: str) -> Path:
    Supervisor(job(folder, *overrides)).run()
    return folder


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory) -> Path:
    return _run(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def reference_lag1(ray_session, tmp_path_factory) -> Path:
    return _run(tmp_path_factory.mktemp("reference_lag1"), *LAG1)


def test_the_reference_calls_its_tool_every_turn_and_its_reward_sees_the_trajectory(reference):
    metrics = read_metrics(reference / "test" / "metrics.jsonl")
    for step in metrics:
        # two calls a trajectory (the third turn's is not made: max_turns), never an error
        assert step["agent/turns_mean"] > 1 and step["agent/tool_calls_mean"] == step["agent/turns_mean"] - 1
        assert step["agent/tool_errors"] == 0 and step["agent/ended_max_turns"] > 0
        assert step["reward/turns"] == step["agent/turns_mean"]  # the reward function got the whole trajectory
        assert step["reward/echoed"] == step["agent/tool_calls_mean"]  # ... with every call's output
        assert step["rollout/response_length_mean"] > 3 * step["agent/turns_mean"] - 3  # tool results in the sequence
    assert calls_made(reference) == calls_recorded(metrics) > 0


def stop_during_a_tool_call(folder: Path, runner: Supervisor, after_step: int) -> None:
    """Arm the tool once `after_step` is logged; ask the run to stop while the call that finds it armed sleeps."""

    def watch() -> None:
        metrics = folder / "test" / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_step):
            time.sleep(0.005)
        (folder / "user" / "arm").write_text("")
        while not (folder / "user" / "waiting").exists():
            time.sleep(0.005)
        runner.ctx.stop.request("a test's stop")

    import threading

    threading.Thread(target=watch, daemon=True).start()


def test_a_run_stopped_in_a_tool_call_and_resumed_makes_each_call_once(reference, tmp_path):
    """The stop comes while step 4's generation waits on a tool: the generation is abandoned and the run stops with
    the checkpoint of step 3, but the calls it made (the one under way included: it is waited for) are recorded, so the
    resumed run replays them instead of calling again."""
    from rlrunner.errors import StoppedEarly

    runner = Supervisor(job(tmp_path))
    stop_during_a_tool_call(tmp_path, runner, after_step=3)
    with pytest.raises(StoppedEarly):
        runner.run()
    assert [m["step"] for m in read_metrics(tmp_path / "test" / "metrics.jsonl")] == [1, 2, 3]
    _run(tmp_path, "runner.resume_dir=auto")
    assert_same_run(tmp_path, reference)
    assert calls_made(tmp_path) == calls_made(reference)  # none twice
    assert recovery_events(tmp_path, "tool_call_repeated") == []


def die_at_generate(call: int):
    """Run inside a rollout worker: its engine's `call`-th generate SIGKILLs the worker first. Returns its pid."""

    def patch(worker) -> list[int]:
        original, calls = worker.engine.generate, []

        def generate(*args, **kwargs):
            calls.append(1)
            if len(calls) == call:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        worker.engine.generate = generate
        return [os.getpid()]

    return patch


def kill_on_start(patch) -> tuple[Inspect, list]:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    done: list = []

    def on_start(trainer) -> None:
        if not done:
            done.append(ray.get(trainer.rollout_group.workers[0].__ray_call__.remote(patch)))

    return Inspect(on_start=on_start), done


def kill_during_a_tool_call(folder: Path, runner: Supervisor, after_step: int) -> list[int]:
    """Arm the tool once `after_step` is logged; SIGKILL every rollout worker while the call that finds it armed
    sleeps (whichever worker made it)."""
    killed: list[int] = []

    def watch() -> None:
        metrics = folder / "test" / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_step):
            time.sleep(0.005)
        (folder / "user" / "arm").write_text("")
        while not (folder / "user" / "waiting").exists():
            time.sleep(0.005)
        killed.extend(host["pid"] for host in runner.trainer.rollout_group.hosts)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)

    import threading

    threading.Thread(target=watch, daemon=True).start()
    return killed


@pytest.mark.parametrize("lag", [0, 1], ids=["lag0_two_workers", "lag1"])
def test_a_rollout_worker_killed_in_a_second_turn_or_a_tool_call_costs_no_step_and_no_call(
    reference, reference_lag1, tmp_path, lag
):
    """A rollout worker is killed as it starts step 2's second turn, then the replacements while a trajectory waits on
    a tool after step 3. Each time the rollout group alone is replaced and the generation redone: the calls recorded
    are replayed, those under way when a worker died are made again (recovery.jsonl names each), and the run is the
    uninterrupted one-worker run, bit for bit. At lag 0 on two rollout workers (a step's two chunks, one each: the
    first worker's engine's 5th call is its step-2 chunk's second turn); at lag 1 on one (its 9th call: two chunks of
    three turns a step, taking their turns in order, the first of step 2's generated ahead, during step 1's update)."""
    workers = [] if lag else ["rollout.num_workers=2"]
    start, first_kill = kill_on_start(die_at_generate(9 if lag else 5))
    runner = Supervisor(job(tmp_path, *(LAG1 if lag else []), *workers), callbacks=[start])
    second_kill = kill_during_a_tool_call(tmp_path, runner, after_step=3)
    runner.run()
    assert first_kill and second_kill and first_kill[0][0] not in second_kill, "a rollout worker was not killed"
    repairs = recovery_events(tmp_path, "rollout_repaired")
    assert len(repairs) == 2 and all(r["lost_steps"] == 0 for r in repairs), repairs
    assert repairs[0]["step"] == 2 and repairs[0]["phase"] == ("generation ahead" if lag else "generation")
    assert recovery_events(tmp_path, "failure") == []
    # the calls under way (begun, not recorded) when a worker died: the one the second kill cut short, and any of the
    # other chunk's turn not recorded yet at the first (its calls run while this chunk generates). Each is made again;
    # it may or may not have reached its tool before the worker died
    repeated = recovery_events(tmp_path, "tool_call_repeated")
    assert any(event["step"] >= 4 for event in repeated), repeated
    expected = reference_lag1 if lag else reference
    assert_same_run(tmp_path, expected)
    assert calls_made(expected) < calls_made(tmp_path) <= calls_made(expected) + len(repeated)

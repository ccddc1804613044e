"""Weight sync from FSDP2 actor ranks to rollout workers: real gloo processes, and real Ray groups (the plan and the
protocol in threads: tests/unit/test_weight_sync_plan.py)."""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from spawned_ranks import forked_context

from rlrunner.backends.fsdp.weights import FSDPWeightSource, local_block
from rlrunner.rollout.hf import ModuleSink

from conftest import assert_bit_equal

# -- real processes, real gloo, real FSDP2 (no Ray) ------------------------------------------------

NUM_ACTORS, NUM_ROLLOUTS, TIMEOUT_S = 3, 2, 20.0


class Toy(torch.nn.Module):
    """Uneven and empty shards over 3 ranks, a tied weight, float and int buffers."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(7, 3)  # rows 3, 3, 1
        self.small = torch.nn.Linear(3, 4)  # weight rows 2, 2, 0; bias 2, 2, 0
        self.one = torch.nn.Parameter(torch.randn(1, 5))  # 1, 0, 0
        self.big = torch.nn.Parameter(torch.randn(9, 11) * 3)
        self.head = torch.nn.Linear(3, 7, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.randn(3))
        self.register_buffer("count", torch.tensor([2, 3]))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _child(role: str, index: int, port: int, out_dir: str, dtype_name: str) -> None:
    try:
        _child_body(role, index, port, Path(out_dir), getattr(torch, dtype_name))
    except BaseException:
        (Path(out_dir) / f"{role}{index}.error").write_text(traceback.format_exc())
        raise


def _child_body(role: str, index: int, port: int, out: Path, dtype: torch.dtype) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from rlrunner.weight_sync.channels import connect_store
    from rlrunner.weight_sync.transport import WeightReceiver, WeightSender

    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, TIMEOUT_S)
    if role == "actor":
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("fsdp/", store),
            rank=index,
            world_size=NUM_ACTORS,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        model = fully_shard(Toy(seed=1))
        # FSDP2's chunk boundaries (rows), checked against the full tensors
        boundaries = {}
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            block = local_block(name, tensor)
            if block is not None:
                assert block.dim == 0 and torch.equal(full[block.start : block.stop], block.tensor), name
                boundaries[name] = (block.start, block.stop)
        sync = WeightSender(
            store, index, NUM_ACTORS, NUM_ROLLOUTS, FSDPWeightSource(model), torch.device("cpu"), TIMEOUT_S, "127.0.0.1"
        )
        results = {"boundaries": boundaries, "full": []}
        for step in range(2):
            full = {
                n: t.full_tensor() if hasattr(t, "full_tensor") else t.clone() for n, t in model.state_dict().items()
            }
            results["full"].append(full)
            results[f"stats{step}"] = sync.send(bucket_bytes=40)
            results[f"kept{step}"] = sum(b.numel() for channel in sync.channels for b in channel.buffers)
            with torch.no_grad():  # an 'update': every shard changes
                for param in model.parameters():
                    param.to_local().mul_(1.5).add_(0.01 * (index + 1))
                model.scale.add_(1)
        # a rollout worker is gone: the send must fail, not hang
        started = time.monotonic()
        try:
            sync.send(bucket_bytes=40)
            results["third"] = "sent"
        except Exception as exc:
            results["third"] = f"{type(exc).__name__}: {exc}"
        results["third_s"] = time.monotonic() - started
        torch.save(results, out / f"actor{index}.pt")
        dist.destroy_process_group()
    else:
        model = Toy(seed=100 + index).to(dtype)
        sync = WeightReceiver(
            store, index, NUM_ACTORS, NUM_ROLLOUTS, ModuleSink(model), torch.device("cpu"), TIMEOUT_S, "127.0.0.1"
        )
        results = {"states": [], "layout": [spec.name for spec in sync.layout]}  # plain: weights_only
        for _ in range(2):
            results["stats"] = sync.receive(bucket_bytes=40)
            results["kept"] = results.get("kept", 0) + sum(b.numel() for c in sync.channels for b in c.buffers)
            results["states"].append({n: t.clone() for n, t in model.state_dict().items()})
        if index == 0:
            torch.save(results, out / f"rollout{index}.pt")
            return  # leaves: the third sync must fail on the other members
        started = time.monotonic()
        try:
            sync.receive(bucket_bytes=40)
            results["third"] = "received"
        except Exception as exc:
            results["third"] = f"{type(exc).__name__}: {exc}"
        results["third_s"] = time.monotonic() - started
        torch.save(results, out / f"rollout{index}.pt")


def test_fsdp2_shards_to_rollouts_over_gloo_processes(tmp_path):
    from rlrunner.weight_sync.channels import serve_store

    dtype = "bfloat16"

    server = serve_store("127.0.0.1", TIMEOUT_S)
    ctx = forked_context()
    procs = [
        ctx.Process(target=_child, args=("actor", r, server.port, str(tmp_path), dtype)) for r in range(NUM_ACTORS)
    ]
    procs += [
        ctx.Process(target=_child, args=("rollout", i, server.port, str(tmp_path), dtype)) for i in range(NUM_ROLLOUTS)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 120
    for proc in procs:
        proc.join(max(1.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
    errors = {p.name: p.read_text() for p in tmp_path.glob("*.error")}
    assert not errors, errors
    assert not alive, "a process hung"

    actors = [torch.load(tmp_path / f"actor{r}.pt", weights_only=True) for r in range(NUM_ACTORS)]
    rollouts = [torch.load(tmp_path / f"rollout{i}.pt", weights_only=True) for i in range(NUM_ROLLOUTS)]
    # FSDP2 split 7 rows as 3, 3, 1, 4 rows as 2, 2, 0, and 1 row as 1, 0, 0: every kind of shard was sent
    assert [a["boundaries"].get("emb.weight") for a in actors] == [(0, 3), (3, 6), (6, 7)]
    assert [a["boundaries"].get("small.weight") for a in actors] == [(0, 2), (2, 4), None]
    assert [a["boundaries"].get("one") for a in actors] == [(0, 1), None, None]
    assert "emb.weight" in rollouts[0]["layout"] and "head.weight" not in rollouts[0]["layout"]  # tied: sent once
    for step in range(2):
        full = actors[0]["full"][step]
        expected = {n: t.to(getattr(torch, dtype)) if t.is_floating_point() else t for n, t in full.items()}
        for rollout in rollouts:
            assert_bit_equal(rollout["states"][step], expected)
    assert rollouts[0]["stats"]["buckets"] > NUM_ACTORS  # 40-byte buckets: pieces were split
    # an actor rank keeps no plain host buffer from one sync to the next (only pinned ones, for a GPU sharing gloo);
    # a rollout worker keeps its buckets' buffers: refilling them is faster than faulting in new ones
    assert [a[f"kept{step}"] for a in actors for step in range(2)] == [0] * (2 * NUM_ACTORS)
    assert all(r["kept"] > 0 for r in rollouts), [r["kept"] for r in rollouts]
    # the third sync, with rollout worker 0 gone: every remaining member failed within the timeout
    for member in [*actors, rollouts[1]]:
        assert member["third"] not in ("sent", "received"), member["third"]
        assert member["third_s"] < TIMEOUT_S + 5


# -- real Ray groups: FSDPActorWorker (FSDP2, 2 ranks) -> RolloutWorker (2 workers) ------------------------


def _update_shards(cfg, num_ranks: int) -> list[dict[str, torch.Tensor]]:
    """A small actor batch built and sharded the way Trainer.train_step does (synthetic samples)."""
    from rlrunner.algorithms.grpo import group_advantages
    from rlrunner.models.loading import build_tokenizer, token_ids
    from rlrunner.runner.batching import build_actor_batch, shard_actor_batch

    tokenizer = build_tokenizer(cfg.model)
    ids = token_ids(cfg.model, tokenizer)
    samples, rewards = [], []
    for i in range(cfg.data.batch_size * cfg.algorithm.group_size):
        response = tokenizer.encode(str(i % 7)) + [ids.eos[0]]
        samples.append(
            {
                "prompt_ids": tokenizer.encode(f"What is {i % 5}+2? "),
                "response_ids": response,
                "logprobs": [-1.0] * len(response),
            }
        )
        rewards.append(float(i % 2))
    advantages = group_advantages(torch.tensor(rewards), cfg.algorithm.group_size, cfg.algorithm.norm_adv_by_std)
    return shard_actor_batch(build_actor_batch(samples, advantages, ids.pad), num_ranks, 1)


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answered after {timeout_s:g}s")


def _rollout_state(worker) -> dict[str, torch.Tensor]:
    """Runs in a rollout worker: its model's state dict, on CPU."""
    return {name: tensor.detach().cpu().clone() for name, tensor in worker.engine.model.state_dict().items()}


def test_ray_groups_sync_bit_exact_and_fail_fast(ray_session, tmp_path):
    import ray
    from omegaconf import OmegaConf
    from ray import cloudpickle

    from rlrunner.backends.fsdp.worker import FSDPActorWorker
    from rlrunner.cluster.worker_group import WorkerGroup
    from rlrunner.rewards.scorer import RewardSettings
    from rlrunner.rollout.worker import RolloutWorker
    from rlrunner.weight_sync.driver import connect_weight_sync, sync_weights

    from conftest import actor_worker_kwargs, run_config

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this module by name
    cfg = run_config(tmp_path, "actor.num_workers=2")
    plain = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
    actor_kwargs = actor_worker_kwargs(cfg)
    groups = []
    try:
        actors = WorkerGroup(
            "actor",
            FSDPActorWorker,
            2,
            worker_kwargs=actor_kwargs,
            cpus_per_worker=0.5,
            distributed=True,
            call_timeout_s=60,
            wait=False,
        )
        groups.append(actors)
        rollouts = {}
        for dtype in ("float32", "bfloat16"):
            kwargs = {
                "model_cfg": {**plain(cfg.model), "dtype": dtype},
                "rollout_cfg": plain(cfg.rollout),
                "group_size": 2,
                "reward": RewardSettings.builtin("arithmetic"),
                "seed": 7,
            }
            rollouts[dtype] = WorkerGroup(
                f"rollout-{dtype}",
                RolloutWorker,
                2,
                worker_kwargs=kwargs,
                cpus_per_worker=0.25,
                call_timeout_s=60,
                wait=False,
            )
            groups.append(rollouts[dtype])
        for group in groups:
            group.wait_ready()
        actors.call_all("setup")

        def expected(dtype: str) -> dict[str, torch.Tensor]:
            full = actors.call_all("full_state_dict")[0]
            return {n: t.to(getattr(torch, dtype)) for n, t in full.items()}

        def rollout_states(group) -> list[dict[str, torch.Tensor]]:
            return group.get([w.__ray_call__.remote(_rollout_state) for w in group.workers])

        for dtype, group in rollouts.items():
            backends = connect_weight_sync(actors, group, timeout_s=30)
            assert backends == {"actor": ["gloo", "gloo"], "rollout": [["gloo", "gloo"]] * 2}
            stats = sync_weights(actors, group, bucket_bytes=64 << 10)  # several buckets per actor rank
            assert (
                stats["bytes"]
                == sum(t.numel() for t in expected(dtype).values())
                * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
            )
            for state in rollout_states(group):
                assert_bit_equal(state, expected(dtype))

        # after an update the (bfloat16) rollout gets the new weights, on the channels joined above
        actors.call_each("update", [(shard,) for shard in _update_shards(cfg, 2)])
        group = rollouts["bfloat16"]
        before = rollout_states(group)[0]
        sync_weights(actors, group, bucket_bytes=64 << 10)
        after = rollout_states(group)
        assert any(not torch.equal(before[n], after[0][n]) for n in before), (
            "no rollout weight changed after the update"
        )
        for state in after:
            assert_bit_equal(state, expected("bfloat16"))

        # a rollout worker killed before the sync: sync_weights raises promptly instead of hanging
        ray.kill(group.workers[1], no_restart=True)
        _wait_until_dead(group.workers[1])  # ray.kill returns before the process is gone
        started = time.monotonic()
        with pytest.raises(Exception) as error:
            sync_weights(actors, group, bucket_bytes=64 << 10, timeout_s=60)
        assert time.monotonic() - started < 30
        assert not isinstance(error.value, TimeoutError), error.value
    finally:
        for group in groups:
            group.shutdown()

"""Megatron-LM's per-rank files (`model_optim_rng.pt`: args, RNG, weights_only reading) and the HF <-> Megatron
converters (megatron-core's own reading of our files: tests/integration/test_megatron_core.py)."""

from __future__ import annotations

import argparse
import io
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rlrunner.backends.megatron import file_writes as mfw
from rlrunner.backends.megatron import files as mf
from rlrunner.backends.megatron.layout import hf_to_megatron
from rlrunner.backends.megatron.megatron_entries import rng_entry, rng_from_entry
from rlrunner.storage import open_storage
from rlrunner.utils.rng import capture_rng, restore_rng

from conftest import assert_bit_equal, load_toolkit
from megatron_models import GQA, SHAPES, TIED, save_hf_folder

# --- the per-rank files -----------------------------------------------------------------------------


def test_names_follow_megatron() -> None:
    assert mf.rank_file(50, 1) == "iter_0000050/mp_rank_01/model_optim_rng.pt"
    assert mf.iteration_dir(0) == "iter_0000000" and mf.rank_dir(12) == "mp_rank_12"
    assert mf.TRACKER_FILE == "latest_checkpointed_iteration.txt"


def test_args_record_dimensions_padding_and_parallel_sizes(megatron_models) -> None:
    args = mf.megatron_args(megatron_models["gqa"].config, tp=2, dp=2)
    assert isinstance(args, argparse.Namespace)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (2, 64, 128, 8)
    assert (args.num_query_groups, args.group_query_attention, args.kv_channels) == (4, True, 8)
    assert (args.vocab_size, args.padded_vocab_size, args.make_vocab_size_divisible_by) == (99, 256, 128)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (2, 1, 2)
    assert args.untie_embeddings_and_output_weights and args.add_qkv_bias and not args.add_bias_linear and args.swiglu
    assert (args.normalization, args.rotary_base, args.params_dtype) == ("RMSNorm", 10000, torch.float32)
    assert not mf.megatron_args(megatron_models["tied"].config, tp=1).untie_embeddings_and_output_weights


def _rank_file_round_trip(storage, root, model) -> None:
    args = mf.megatron_args(model.config, tp=2)
    shards = hf_to_megatron(model.state_dict(), model.config, 2)
    params = [torch.nn.Parameter(v.clone()) for v in shards[1].values() if v is not None]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    scheduler = {"max_lr": 1e-3, "num_steps": 1}
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    rng = [rng_entry(capture_rng(), 11, 1)]
    draws = (random.random(), np.random.rand(), torch.rand(1))
    records = mfw.write_rank_file(storage, root, 50, 1, shards[1], args, optimizer.state_dict(), scheduler, rng)
    name = "iter_0000050/mp_rank_01/model_optim_rng.pt"
    assert list(records) == [name]
    assert records[name] == storage.checksum(storage.join(root, name))  # size and CRC-32 computed while writing
    for mmap in (False, True):
        state = mf.read_rank_file(storage, storage.join(root, name), mmap=mmap)
        assert set(state) == {
            "args",
            "checkpoint_version",
            "iteration",
            "model",
            "optimizer",
            "opt_param_scheduler",
            "rng_state",
            "rerun_state_machine",
            "num_floating_point_operations_so_far",
        }
        assert (state["rerun_state_machine"], state["num_floating_point_operations_so_far"]) == (None, 0)
        assert (state["checkpoint_version"], state["iteration"], state["opt_param_scheduler"]) == (3.0, 50, scheduler)
        assert state["args"] == args
        assert list(state["model"]) == list(shards[1])
        assert [k for k, v in state["model"].items() if v is None] == [k for k, v in shards[1].items() if v is None]
        assert_bit_equal(
            {k: v for k, v in state["model"].items() if v is not None},
            {k: v for k, v in shards[1].items() if v is not None},
        )
        assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
        assert isinstance(state["rng_state"], list) and len(state["rng_state"]) == 1
        assert set(state["rng_state"][0]) >= {
            "random_rng_state",
            "np_rng_state",
            "torch_rng_state",
            "rng_tracker_states",
        }
        restore_rng(rng_from_entry(state["rng_state"][0]))
        assert (random.random(), np.random.rand(), torch.rand(1)) == draws


@pytest.fixture
def process_allows_nothing():
    """No class allowed by the process itself for the test (megatron-core, once imported, allows argparse.Namespace
    for good); what was allowed is allowed again afterwards."""
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed)


def test_rank_file_round_trip_local(tmp_path, megatron_models, process_allows_nothing) -> None:
    storage = open_storage(str(tmp_path))
    _rank_file_round_trip(storage, storage.url, megatron_models["gqa"])
    # the allow-list is exactly what the file needs: weights_only's own types plus argparse.Namespace
    path = tmp_path / "iter_0000050/mp_rank_01/model_optim_rng.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == ["argparse.Namespace"]
    assert [f"{c.__module__}.{c.__qualname__}" for c in mf.ALLOWED_GLOBALS] == ["argparse.Namespace"]
    with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace"):  # without the allow-list it is refused
        torch.load(path, weights_only=True)


def test_a_load_leaves_the_classes_the_process_allowed_itself_allowed(
    tmp_path, megatron_models, process_allows_nothing
) -> None:
    """megatron-core allows argparse.Namespace when imported: our load, which allows it for its own call, must not take
    it away (megatron-core's own torch.load of the file would then fail)."""
    storage = open_storage(str(tmp_path))
    _rank_file_round_trip(storage, storage.url, megatron_models["gqa"])
    path = tmp_path / "iter_0000050/mp_rank_01/model_optim_rng.pt"
    torch.serialization.add_safe_globals(list(mf.ALLOWED_GLOBALS))
    mf.load_file(str(path))
    assert set(mf.ALLOWED_GLOBALS) <= set(torch.serialization.get_safe_globals())
    assert torch.load(path, weights_only=True)["args"].tensor_model_parallel_size == 2
    torch.serialization.clear_safe_globals()
    mf.load_file(str(path))  # and one that did not is allowed for the call only
    assert not set(mf.ALLOWED_GLOBALS) & set(torch.serialization.get_safe_globals())


def test_rank_file_round_trip_on_s3(s3_store, megatron_models) -> None:
    url, options = s3_store
    storage = open_storage(url, options)
    _rank_file_round_trip(storage, storage.url, megatron_models["tied"])


class _Planted:
    """Unpickling it would create a file: proof that the load ran code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_file_holding_another_class_is_refused_and_not_run(tmp_path) -> None:
    from fractions import Fraction

    storage = open_storage(str(tmp_path))
    marker = tmp_path / "pwned"
    for name, payload in (("planted.pt", _Planted(str(marker))), ("fraction.pt", Fraction(1, 3))):
        with open(tmp_path / name, "wb") as handle:
            torch.save(
                {"args": argparse.Namespace(tensor_model_parallel_size=1), "model": {}, "extra": payload}, handle
            )
        for mmap in (False, True):
            with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
                mf.read_rank_file(storage, str(tmp_path / name), mmap=mmap)
    assert not marker.exists()


def test_save_refuses_what_the_reader_would_refuse(tmp_path, megatron_models) -> None:
    from fractions import Fraction

    storage = open_storage(str(tmp_path))
    args = mf.megatron_args(megatron_models["gqa"].config, tp=1)
    with pytest.raises(TypeError, match=r"\['opt_param_scheduler'\]\['ratio'\] holds a fractions.Fraction"):
        mfw.write_rank_file(storage, storage.url, 1, 0, {}, args, opt_param_scheduler={"ratio": Fraction(1, 2)})
    with pytest.raises(ValueError, match="tensor-parallel rank 1 is outside 0..0"):
        mfw.write_rank_file(storage, storage.url, 1, 1, {}, args)
    assert storage.walk(storage.url) == {}


def test_reading_checks_tracker_ranks_and_iteration(tmp_path, megatron_models) -> None:
    model = megatron_models["gqa"]
    storage = open_storage(str(tmp_path))
    root = storage.url
    records = mfw.write_model_checkpoint(storage, root, model.state_dict(), model.config, tp=2, iteration=3)
    assert sorted(records) == [
        "iter_0000003/mp_rank_00/model_optim_rng.pt",
        "iter_0000003/mp_rank_01/model_optim_rng.pt",
        "latest_checkpointed_iteration.txt",
    ]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    iteration, states = mf.read_rank_states(storage, root)
    assert iteration == 3 and [s["args"].tensor_model_parallel_size for s in states] == [2, 2]
    assert "optimizer" not in states[0] and "rng_state" not in states[0]  # model only
    assert mf.find_root(storage, root) == root
    # a global_step_N folder whose actor/ holds the checkpoint
    (tmp_path / "global_step_3").mkdir()
    (tmp_path / "iter_0000003").rename(tmp_path / "global_step_3" / "iter_0000003")
    with pytest.raises(FileNotFoundError, match="no iter_0000003/mp_rank_\\* folders under"):
        mf.read_rank_states(storage, root)
    (tmp_path / "global_step_3").rename(tmp_path / "actor")
    (tmp_path / "latest_checkpointed_iteration.txt").rename(tmp_path / "actor" / "latest_checkpointed_iteration.txt")
    actor = storage.join(root, "actor")
    assert mf.find_root(storage, root) == actor
    (tmp_path / "actor/iter_0000003/mp_rank_01").rename(tmp_path / "actor/iter_0000003/mp_rank_02")
    with pytest.raises(ValueError, match=r"has tensor-parallel ranks \[0, 2\], not 0..1"):
        mf.read_rank_states(storage, actor)
    (tmp_path / "actor/iter_0000003/mp_rank_02").rename(tmp_path / "actor/iter_0000003/mp_rank_01")
    (tmp_path / "actor/iter_0000003").rename(tmp_path / "actor/iter_0000004")
    (tmp_path / "actor/latest_checkpointed_iteration.txt").write_text("4\n")
    with pytest.raises(ValueError, match="holds iteration 3, its folder says 4"):
        mf.read_rank_states(storage, actor)
    (tmp_path / "actor/latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(ValueError, match="holds 'release', not an iteration number"):
        mf.read_rank_states(storage, actor)


# --- the converters ---------------------------------------------------------------------------------


def test_a_file_written_a_tensor_at_a_time_is_torch_save_s_own(tmp_path) -> None:
    """`deferred` stand-ins get their values as their bytes are due, in order, each from a buffer that is freed
    (its storage resized to 0, as a released weight unit's) before the next is asked for."""
    storage = open_storage(str(tmp_path))
    real = {"a.weight": torch.randn(700, 9), "b.bias": torch.randn(33), "c.weight": torch.randn(5, 4)}
    stand_ins = {key: torch.empty(t.shape, dtype=t.dtype) for key, t in real.items()}
    rng = [{"torch_rng_state": torch.arange(20, dtype=torch.uint8), "random_rng_state": (3, (1, 2), None)}]
    state = mf.rank_state(
        7, {**stand_ins, "a._extra_state": None}, argparse.Namespace(hidden_size=9), {"lr": 0.1}, {"num_steps": 7}, rng
    )
    asked: list[str] = []
    held: list[torch.Tensor] = []

    def value(key: str) -> torch.Tensor:
        if held:  # the previous value's memory goes away, as a released unit's does
            held.pop().untyped_storage().resize_(0)
        asked.append(key)
        buffer = real[key].clone()
        held.append(buffer)
        return buffer

    deferred = {id(t): (lambda key=key: value(key)) for key, t in stand_ins.items()}
    mfw.write_state_file(storage, str(tmp_path), "streamed.pt", state, deferred)
    assert asked == list(real)
    loaded = mf.load_file(str(tmp_path / "streamed.pt"), mmap=True)
    assert list(loaded["model"]) == list(state["model"]) and loaded["model"]["a._extra_state"] is None
    assert_bit_equal({k: v for k, v in loaded["model"].items() if v is not None}, real)
    assert torch.equal(loaded["rng_state"][0]["torch_rng_state"], rng[0]["torch_rng_state"])
    assert (
        loaded["iteration"] == 7
        and loaded["args"].hidden_size == 9
        and loaded["opt_param_scheduler"] == {"num_steps": 7}
    )
    plain = io.BytesIO()  # torch.save into a stream, as the streamed save's (the records' folder is then "archive")
    torch.save(
        mf.rank_state(
            7, {**real, "a._extra_state": None}, argparse.Namespace(hidden_size=9), {"lr": 0.1}, {"num_steps": 7}, rng
        ),
        plain,
    )
    assert (tmp_path / "streamed.pt").stat().st_size == len(plain.getvalue())  # the same records, in the same places
    # a value that does not fit its stand-in is refused, naming it
    bad = {id(stand_ins["b.bias"]): lambda: torch.zeros(34)}
    with pytest.raises(ValueError, match=r"\(34,\) given for a stand-in of torch.float32 \(33,\)"):
        mfw.write_state_file(storage, str(tmp_path), "bad.pt", mf.rank_state(7, stand_ins, argparse.Namespace()), bad)
    assert not (tmp_path / "bad.pt").exists()


def test_a_tensor_written_a_part_at_a_time_is_torch_save_s_own(tmp_path) -> None:
    """A stand-in's values may come as an iterable of flat parts (a tensor-parallel rank's moments, received from its
    data-parallel ranks a chunk at a time), each written before the next is asked for; the parts must fill it exactly,
    in its dtype."""
    storage = open_storage(str(tmp_path))
    real = {"exp_avg": torch.randn(1000), "exp_avg_sq": torch.randn(37)}
    stand_ins = {key: torch.empty(t.shape, dtype=t.dtype) for key, t in real.items()}
    state = {"format": "x", "step": 3, **stand_ins}
    asked: list[tuple[str, int]] = []

    def parts(key: str, size: int):
        for index, part in enumerate(real[key].split(size)):
            asked.append((key, index))
            yield part.clone()

    deferred = {
        id(stand_ins["exp_avg"]): lambda: parts("exp_avg", 300),
        id(stand_ins["exp_avg_sq"]): lambda: parts("exp_avg_sq", 5),
    }
    mfw.write_state_file(storage, str(tmp_path), "parts.pt", state, deferred)
    assert asked == [("exp_avg", i) for i in range(4)] + [("exp_avg_sq", i) for i in range(8)]
    loaded = mf.load_file(str(tmp_path / "parts.pt"))
    assert_bit_equal({key: loaded[key] for key in real}, real) and loaded["step"] == 3
    plain = io.BytesIO()
    torch.save({"format": "x", "step": 3, **real}, plain)
    assert (tmp_path / "parts.pt").stat().st_size == len(plain.getvalue())
    for given, message in (
        (lambda: iter([torch.zeros(1000), torch.zeros(1)]), "more than the 4000 bytes"),
        (lambda: iter([torch.zeros(999)]), "3996 bytes for a record of 4000"),
        (lambda: iter([torch.zeros(1000, dtype=torch.float64)]), "a part of torch.float64 given"),
    ):
        with pytest.raises(ValueError, match=message):
            mfw.write_state_file(storage, str(tmp_path), "bad.pt", state, {id(stand_ins["exp_avg"]): given})
        assert not (tmp_path / "bad.pt").exists()


def test_streamed_safetensors_file_is_what_safetensors_reads(tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    tool = load_toolkit("convert_megatron_to_hf")
    state = {
        "b.weight": torch.randn(3, 5).to(torch.bfloat16),
        "a.bias": torch.arange(7, dtype=torch.int64),
        "c.scale": torch.randn(()),
        "d.empty": torch.zeros(0, 4, dtype=torch.float16),
        "e.t": torch.randn(4, 6).t(),
    }
    record = tool.write_safetensors(open_storage(str(tmp_path)), str(tmp_path / "w.safetensors"), list(state.items()))
    assert record == open_storage(str(tmp_path)).checksum(str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert_bit_equal(dict(sorted(loaded.items())), dict(sorted(state.items())))  # safetensors stores the names sorted
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as reader:
        assert reader.metadata() == {"format": "pt"}  # what transformers checks before loading
    with pytest.raises(ValueError, match="x has dtype torch.complex64, which this writer does not store"):
        tool.write_safetensors(
            open_storage(str(tmp_path)),
            str(tmp_path / "bad.safetensors"),
            [("x", torch.zeros(2, dtype=torch.complex64))],
        )
    layout = [("a", torch.zeros(2, device="meta")), ("b", torch.zeros(3, device="meta"))]
    with pytest.raises(ValueError, match=r"expected b torch.float32 \(3,\) next, got c"):
        tool.write_safetensors(
            open_storage(str(tmp_path)),
            str(tmp_path / "bad.safetensors"),
            layout,
            iter([("a", torch.ones(2)), ("c", torch.ones(3))]),
        )
    assert not (tmp_path / "bad.safetensors").exists()  # a failed write leaves no file


def _assert_same_model(folder: Path, model) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = load_file(str(folder / "model.safetensors"))
    expected = {
        k: v for k, v in model.state_dict().items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }
    assert_bit_equal(
        dict(sorted(weights.items())), dict(sorted(expected.items()))
    )  # safetensors stores the names sorted
    reloaded = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor([tokenizer("12+30=42\n", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_converters_end_to_end_local(tmp_path, capsys) -> None:
    to_megatron, to_hf = load_toolkit("convert_hf_to_megatron"), load_toolkit("convert_megatron_to_hf")
    hf, model = save_hf_folder(tmp_path / "hf", TIED)
    actor = tmp_path / "global_step_0" / "actor"
    assert (
        to_megatron.main(["--hf_path", str(hf), "--output_path", str(actor), "--tensor_model_parallel_size", "4"]) == 0
    )
    files = sorted(str(p.relative_to(actor)) for p in actor.rglob("*") if p.is_file())
    assert [f for f in files if not f.startswith("huggingface/")] == [
        f"iter_0000000/mp_rank_0{r}/model_optim_rng.pt" for r in range(4)
    ] + ["latest_checkpointed_iteration.txt"]
    assert {"huggingface/config.json", "huggingface/tokenizer.json"} <= set(files)
    assert not any(f.endswith(".safetensors") for f in files)
    state = mf.load_file(str(actor / "iter_0000000/mp_rank_03/model_optim_rng.pt"))
    assert state["args"].padded_vocab_size == 512 and state["model"]["embedding.word_embeddings.weight"].shape == (
        128,
        32,
    )
    out = tmp_path / "exported"
    assert to_hf.main(["--ckpt_path", str(tmp_path / "global_step_0"), "--output_path", str(out)]) == 0
    _assert_same_model(out, model)
    capsys.readouterr()
    # refusals: one line each, exit code 2
    assert to_hf.main(["--ckpt_path", str(tmp_path / "global_step_0"), "--output_path", str(out)]) == 2
    assert (
        capsys.readouterr().err.strip() == f"convert_megatron_to_hf: error: {out} exists and is not an empty folder "
        "(stale weight files would mix with the new ones)"
    )
    assert (
        to_megatron.main(["--hf_path", str(hf), "--output_path", str(actor), "--tensor_model_parallel_size", "2"]) == 2
    )
    assert "already holds a Megatron checkpoint" in capsys.readouterr().err
    assert (
        to_megatron.main(
            ["--hf_path", str(hf), "--output_path", str(tmp_path / "x"), "--tensor_model_parallel_size", "8"]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        "convert_hf_to_megatron: error: cannot split num_attention_heads=4 over "
        "tensor_model_parallel_size=8: not divisible"
    )
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("shape", ["llama", "llama_tied"])
def test_a_llama_folder_converts_both_ways_bit_exact(tmp_path, shape) -> None:
    to_megatron, to_hf = load_toolkit("convert_hf_to_megatron"), load_toolkit("convert_megatron_to_hf")
    hf, model = save_hf_folder(tmp_path / "hf", SHAPES[shape])
    assert type(model).__name__ == "LlamaForCausalLM"
    actor = tmp_path / "global_step_0" / "actor"
    assert (
        to_megatron.main(["--hf_path", str(hf), "--output_path", str(actor), "--tensor_model_parallel_size", "2"]) == 0
    )
    state = mf.load_file(str(actor / "iter_0000000/mp_rank_01/model_optim_rng.pt"))
    assert not state["args"].add_qkv_bias and not any(key.endswith("linear_qkv.bias") for key in state["model"])
    assert state["args"].use_rope_scaling == (
        shape == "llama"
    )  # Llama 3.1's frequency scaling, as Megatron-LM names it
    out = tmp_path / "exported"
    assert to_hf.main(["--ckpt_path", str(tmp_path / "global_step_0"), "--output_path", str(out)]) == 0
    _assert_same_model(out, model)  # the weights bit for bit, and the same logits


def test_converters_end_to_end_on_s3(tmp_path, s3_store) -> None:
    import json

    url, options = s3_store
    to_megatron, to_hf = load_toolkit("convert_hf_to_megatron"), load_toolkit("convert_megatron_to_hf")
    hf, model = save_hf_folder(tmp_path / "hf", GQA)
    flags = ["--storage_options", json.dumps(options)]
    assert (
        to_megatron.main(["--hf_path", str(hf), "--output_path", url, "--tensor_model_parallel_size", "2", *flags]) == 0
    )
    storage = open_storage(url, options)
    assert storage.read_bytes(storage.join(url, "latest_checkpointed_iteration.txt")) == b"0"
    out = tmp_path / "exported"
    assert to_hf.main(["--ckpt_path", url, "--output_path", str(out), *flags]) == 0
    _assert_same_model(out, model)


# --- megatron-core reads our files (the `megatron` test extra) -------------------------------------------

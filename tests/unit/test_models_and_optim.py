"""Character tokenizer, model-folder checks, seeded model construction, special ids and the LR schedule."""

import json
import math
from pathlib import Path

import pytest
import torch

from rlrunner.backends.optim import LRSchedule
from rlrunner.errors import ConfigError
from rlrunner.models.loading import TokenIds, build_model, build_tokenizer, check_model_folder, token_ids
from rlrunner.models.tokenizer import build_char_tokenizer

from conftest import TINY_MODEL_CFG as TINY
from conftest import assert_bit_equal

TEXT = "Hello, World! 12+3=15\n  {x: [1, 2]} ~`|\\"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny_model")
    build_model(TINY, tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --- character tokenizer ---------------------------------------------------------------------------


def test_char_tokenizer_round_trip_and_ids(tokenizer) -> None:
    encoded = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(encoded) == len(TEXT)  # one token per character
    assert tokenizer.decode(encoded) == TEXT
    # ids: pad 0, eos 1, unk 2, then chr(32).. chr(126), then newline
    assert tokenizer("A", add_special_tokens=False)["input_ids"] == [3 + ord("A") - 32]
    assert tokenizer(" ~\n", add_special_tokens=False)["input_ids"] == [3, 3 + 126 - 32, 98]
    assert len(tokenizer) == 99
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [2]


def test_char_tokenizer_save_and_autotokenizer_reload(tmp_path: Path, tokenizer) -> None:
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (
        reloaded(TEXT, add_special_tokens=False)["input_ids"] == tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    )
    assert reloaded(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert reloaded.decode(reloaded(TEXT, add_special_tokens=False)["input_ids"]) == TEXT
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (0, 1)
    assert len(reloaded) == len(tokenizer)


# --- check_model_folder --------------------------------------------------------------------------------


def test_check_model_folder_accepts_saved_model(model_folder: Path) -> None:
    check_model_folder(str(model_folder))  # no error


def test_check_model_folder_missing(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError, match=r"does not exist: .*absent"):
        check_model_folder(str(missing))


def test_check_model_folder_file_not_dir(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        check_model_folder(str(path))


def test_check_model_folder_no_config(tmp_path: Path, model_folder: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes((model_folder / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="no config.json"):
        check_model_folder(str(tmp_path))


def test_check_model_folder_no_weights(tmp_path: Path, model_folder: Path, tokenizer) -> None:
    (tmp_path / "config.json").write_text((model_folder / "config.json").read_text())
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="no weights"):
        check_model_folder(str(tmp_path))


def test_check_model_folder_no_tokenizer(tmp_path: Path, tokenizer) -> None:
    build_model(TINY, tokenizer, seed=0).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="has no tokenizer"):
        check_model_folder(str(tmp_path))


def test_check_model_folder_tokenizer_config_alone_is_not_a_tokenizer(tmp_path: Path, tokenizer) -> None:
    build_model(TINY, tokenizer, seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="has no tokenizer"):
        check_model_folder(str(tmp_path))


def test_check_model_folder_unreadable_config(tmp_path: Path, model_folder: Path, tokenizer) -> None:
    (tmp_path / "config.json").write_text("{ not json")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="unreadable config.json"):
        check_model_folder(str(tmp_path))


def test_check_model_folder_not_a_causal_lm(tmp_path: Path, model_folder: Path, tokenizer) -> None:
    config = json.loads((model_folder / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="not a causal language model"):
        check_model_folder(str(tmp_path))


# --- build_model / tokenizer from a folder --------------------------------------------------------------


def test_build_model_is_seeded(tokenizer) -> None:
    a = build_model(TINY, tokenizer, seed=3).state_dict()
    b = build_model(TINY, tokenizer, seed=3).state_dict()
    c = build_model(TINY, tokenizer, seed=4).state_dict()
    assert_bit_equal(b, a)
    assert c.keys() == a.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"]), (
        "seeds 3 and 4 built the same embedding"
    )


def test_build_model_applies_overrides_and_dtype(tokenizer) -> None:
    model = build_model(TINY, tokenizer, seed=0, dtype="bfloat16")
    assert model.config.hidden_size == 32
    assert model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tokenizer) == 99
    assert model.config.use_cache is False
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.get_input_embeddings().weight.shape == (99, 32)


def test_build_model_from_folder_loads_the_saved_weights(model_folder: Path, tokenizer) -> None:
    cfg = {"path": str(model_folder), "dtype": "float32", "attn_implementation": "sdpa", "override_config": {}}
    loaded = build_model(cfg, build_tokenizer(cfg), seed=123).state_dict()
    original = build_model(TINY, tokenizer, seed=0).state_dict()
    assert_bit_equal(loaded, original)


def test_token_ids_char_tokenizer(tokenizer) -> None:
    ids = token_ids({"path": None}, tokenizer)
    assert ids == TokenIds(pad=0, eos=(1,))


def test_token_ids_adds_generation_config_eos(tmp_path: Path, tokenizer) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1, 5]}))
    assert token_ids({"path": str(tmp_path)}, tokenizer) == TokenIds(pad=0, eos=(1, 5, 7))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert token_ids({"path": str(tmp_path)}, tokenizer) == TokenIds(pad=0, eos=(1, 9))


# --- LRSchedule ---------------------------------------------------------------------------------------------


def test_lr_constant_without_warmup() -> None:
    schedule = LRSchedule(warmup_steps=0, total_steps=10, kind="constant")
    assert [schedule(s) for s in (0, 1, 5, 10, 50)] == [1.0] * 5


def test_lr_warmup_ramp_then_constant() -> None:
    schedule = LRSchedule(warmup_steps=4, total_steps=10, kind="constant")
    # step s < warmup: (s + 1) / warmup
    assert [schedule(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_lr_cosine() -> None:
    schedule = LRSchedule(warmup_steps=2, total_steps=10, kind="cosine", min_ratio=0.1)
    assert schedule(0) == pytest.approx(0.5)
    assert schedule(1) == pytest.approx(1.0)
    assert schedule(2) == pytest.approx(1.0)  # right after warmup: progress 0
    # step 6: progress (6-2)/(10-2) = 0.5 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert schedule(6) == pytest.approx(0.55)
    # step 4: progress 0.25 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi/4))
    assert schedule(4) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert schedule(10) == pytest.approx(0.1)
    assert schedule(25) == pytest.approx(0.1)  # stays at the floor past total_steps
    values = [schedule(s) for s in range(2, 11)]
    assert values == sorted(values, reverse=True)


def test_lr_cosine_min_ratio_zero_without_warmup() -> None:
    schedule = LRSchedule(warmup_steps=0, total_steps=4, kind="cosine")
    assert [round(schedule(s), 6) for s in range(5)] == [
        1.0,
        round(0.5 * (1 + math.cos(math.pi / 4)), 6),
        0.5,
        round(0.5 * (1 + math.cos(3 * math.pi / 4)), 6),
        0.0,
    ]


def test_lr_schedule_drives_lambda_lr() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LRSchedule(2, 4, "cosine", 0.0))
    lrs = []
    for _ in range(5):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.05, 0.0])


def test_a_restored_scheduler_keeps_this_run_s_schedule_from_its_first_step() -> None:
    from rlrunner.backends.optim import apply_schedule, build_optimizer

    def build(total_steps: int, param: torch.nn.Parameter):
        cfg = {
            "lr": 1.0,
            "betas": [0.9, 0.99],
            "weight_decay": 0.0,
            "warmup_steps": 0,
            "lr_schedule": "cosine",
            "min_lr_ratio": 0.0,
        }
        return build_optimizer([param], cfg, total_steps)

    param = torch.nn.Parameter(torch.zeros(2))
    saved_optimizer, saved_scheduler = build(4, param)
    for _ in range(2):
        saved_optimizer.step()
        saved_scheduler.step()
    assert "lr_lambdas" not in saved_scheduler.state_dict()  # the schedule is config, not state
    optimizer, scheduler = build(8, param)
    optimizer.load_state_dict(saved_optimizer.state_dict())  # its LR is the 4-step schedule's
    scheduler.load_state_dict(saved_scheduler.state_dict())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LRSchedule(0, 4, "cosine")(2))
    apply_schedule(optimizer, scheduler)
    assert scheduler.lr_lambdas[0].total_steps == 8 and scheduler.last_epoch == 2
    assert optimizer.param_groups[0]["lr"] == LRSchedule(0, 8, "cosine")(2)
    # with the same schedule the LR is bit for bit what LambdaLR set
    same_optimizer, same_scheduler = build(4, param)
    same_optimizer.load_state_dict(saved_optimizer.state_dict())
    same_scheduler.load_state_dict(saved_scheduler.state_dict())
    apply_schedule(same_optimizer, same_scheduler)
    assert same_optimizer.param_groups[0]["lr"] == saved_optimizer.param_groups[0]["lr"]


def test_adamw_is_fused_on_cuda_and_on_the_cpu_foreach_for_small_models_else_the_per_tensor_loop() -> None:
    """The actor's AdamW: fused on CUDA (torch's default there, foreach, makes temporaries of the whole shard); on the
    CPU foreach for a small model and the per-tensor loop above it. Each steps every element as a whole-model AdamW
    would, and the two CPU implementations give the same bits."""
    from rlrunner.backends.optim import adamw_implementation, build_optimizer
    from rlrunner.models.loading import SMALL_MODEL_BYTES

    assert adamw_implementation(torch.device("cuda", 0)) == "fused"
    assert adamw_implementation(torch.device("cpu"), SMALL_MODEL_BYTES) == "foreach"
    assert adamw_implementation(torch.device("cpu"), SMALL_MODEL_BYTES + 1) == "for-loop"
    cfg = {
        "lr": 0.1,
        "betas": [0.9, 0.99],
        "weight_decay": 0.01,
        "warmup_steps": 0,
        "lr_schedule": "constant",
        "min_lr_ratio": 0.0,
    }
    whole = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    halves = [torch.nn.Parameter(whole.detach()[:3].clone()), torch.nn.Parameter(whole.detach()[3:].clone())]
    looped = [torch.nn.Parameter(whole.detach()[:3].clone()), torch.nn.Parameter(whole.detach()[3:].clone())]
    optimizers = [build_optimizer([whole], cfg, 4)[0], build_optimizer(halves, cfg, 4)[0]]
    assert [(o.defaults["foreach"], o.defaults["fused"]) for o in optimizers] == [(True, None)] * 2
    loop = torch.optim.AdamW(looped, lr=0.1, betas=(0.9, 0.99), weight_decay=0.01, foreach=False)
    grad = torch.linspace(-1.0, 1.0, 6)
    for _ in range(3):
        whole.grad = grad.clone()
        for pair in (halves, looped):
            pair[0].grad, pair[1].grad = grad[:3].clone(), grad[3:].clone()
        for optimizer in [*optimizers, loop]:
            optimizer.step()
    assert torch.equal(torch.cat([h.detach() for h in halves]), whole.detach())  # the same bits, however split
    assert torch.equal(torch.cat([h.detach() for h in looped]), whole.detach())  # and as the per-tensor loop's


def test_fsdp_unit_auto_is_the_whole_model_only_for_small_models() -> None:
    from rlrunner.backends.fsdp.worker import resolve_unit
    from rlrunner.models.loading import SMALL_MODEL_BYTES

    assert resolve_unit("auto", 4 * 300_000) == "model"  # the default job's 0.3M parameters
    assert resolve_unit("auto", SMALL_MODEL_BYTES) == "model"
    assert resolve_unit("auto", SMALL_MODEL_BYTES + 1) == "decoder_layer"
    assert resolve_unit("auto", 4 * 120_000_000) == "decoder_layer"  # real sizes keep a unit per layer
    for unit in ("decoder_layer", "linear", "model"):
        assert resolve_unit(unit, 4) == unit == resolve_unit(unit, 4 << 40)


def test_recomputation_by_default_only_above_a_small_model() -> None:
    from rlrunner.models.loading import SMALL_MODEL_BYTES, recomputes_activations

    assert not recomputes_activations(None, 4 * 300_000)  # the default job's 0.3M parameters keep their activations
    assert not recomputes_activations(None, SMALL_MODEL_BYTES)
    assert recomputes_activations(None, SMALL_MODEL_BYTES + 1)
    assert recomputes_activations(None, 4 * 120_000_000)  # real sizes recompute
    for setting in (True, False):  # a setting is itself, whatever the size
        assert recomputes_activations(setting, 4) is setting is recomputes_activations(setting, 4 << 40)

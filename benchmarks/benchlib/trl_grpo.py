"""The default job's work run by TRL's `GRPOTrainer`, in one process: run by `bench_vs_trl.py` with the interpreter of
a venv that has TRL (`--trl-python`), not rlrunner's own (it imports only torch, transformers, datasets, TRL and
rlrunner's pure-Python arithmetic reward).

    python trl_grpo.py --model DIR --prompts prompts.jsonl --steps 200 --out trl.json

DIR holds the initial weights, config and tokenizer rlrunner's default job starts from; prompts.jsonl the prompts in the
order rlrunner's loader draws them ({"prompt", "answer"} per line, `--batch-size` per step). The algorithm is the
default job's: groups of `--group-size` samples per prompt, advantages normalized by the group's std, the PPO clip at
0.2 with one pass (TRL's `epsilon`, `num_iterations=1`), no KL, token-mean loss (TRL's `dapo`), AdamW at 3e-4 with
betas (0.9, 0.99) and no weight decay, gradients clipped at 1.0, a constant LR; sampling at temperature 1, top-p 1, up
to `--max-new-tokens` tokens; micro-batches of `--micro-batch-size` samples accumulated into one optimizer step per
batch. Writes, per step, the wall time of the whole step (generation, reward, update: TRL does all three inside
`training_step`) and the mean reward, and the time from the script's start to the first step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for the reward
from rlrunner.rewards.arithmetic import arithmetic_reward  # noqa: E402


def reward(completions: list[str], answer: list[str], **_) -> list[float]:
    return [arithmetic_reward(completion, expected) for completion, expected in zip(completions, answer)]


class StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.first_step_at: float | None = None
        self._began = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter() - STARTED
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._began)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=32, help="samples per forward/backward")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    dataset = Dataset.from_list(rows[: args.steps * args.batch_size])
    samples = args.batch_size * args.group_size
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_output"),
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=samples // args.micro_batch_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=3e-4,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        shuffle_dataset=False,  # the prompts come in rlrunner's order
        gradient_checkpointing=args.gradient_checkpointing,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    times = StepTimes()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[times],
    )
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    Path(args.out).write_text(
        json.dumps(
            {
                "step_s": times.times,
                "reward": rewards,
                "first_step_after_s": times.first_step_at,
                "wall_s": time.perf_counter() - STARTED,
                "versions": {"trl": __import__("trl").__version__, "torch": torch.__version__},
                "threads": torch.get_num_threads(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

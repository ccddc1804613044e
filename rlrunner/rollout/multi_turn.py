"""Multi-turn rollouts: the model's turns and what answers them (tools, an environment), token in and token out.

    rollout = MultiTurnRollout(engine, tokenizer, token_ids, settings, environments, seed)
    trajectories = rollout.run(recorder, mode, step, chunks, first_sample, sampling, chunk_done)

Each turn of every unfinished trajectory of a chunk is one engine call. The chunks take their turns in order, and a
chunk's tool calls run in the tool processes while the next chunks generate: a chunk waits for its answers only when
its next turn comes. What a trajectory gets depends on its chunk, its seeds and the weights alone, never on timing or
on which worker runs it: the chunks are fixed by the driver, an engine call holds exactly the trajectories of one chunk
still going at that turn, and turn k of sample j of prompt i draws from its own seed (run seed, step, i, j, k; turn 0
uses the single-turn sample's seed).

The model's sampled tokens are kept as they are (mask 1, with their log-probabilities); what answers a turn is the
chat template's delta (`rlrunner.agents.chat`, mask 0). A trajectory ends when its environment is done (tools: a turn
without a call), after `max_turns` turns, when its tokens reach `max_response_tokens`, or on a tool error with
`on_tool_error=terminate`. A turn cut by `rollout.max_new_tokens` before its eos is answered as it is (the template's
end of a turn follows it, not the model's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlrunner.agents.chat import ChatDeltas
from rlrunner.agents.environments import Answer, Environments, Pending, Recorder, Turn
from rlrunner.agents.settings import MultiTurnSettings
from rlrunner.models.loading import TokenIds
from rlrunner.rollout.base import RolloutEngine, SampleRequest, Sampling
from rlrunner.utils.seeding import derive_seed


@dataclass
class Trajectory:
    position: int  # its sample's place in the step's batch
    record: dict  # its prompt's record
    sample: int  # j: which of the prompt's samples
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)  # every token after the prompt
    mask: list[int] = field(default_factory=list)  # 1: the model's own token
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 on tokens that are not the model's
    texts: list[str] = field(default_factory=list)  # each assistant turn's text
    messages: list[dict] = field(default_factory=list)  # the conversation after the prompt
    calls: list[dict] = field(default_factory=list)  # every tool call and its result, in order
    ended: str | None = None  # done | max_turns | max_response_tokens | tool_error | env_error
    env_reward: float | None = None
    last_token: int | None = None
    errors: int = 0
    timeouts: int = 0
    tool_s: float = 0.0

    @property
    def turns(self) -> int:
        return len(self.texts)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response

    def summary(self) -> dict[str, Any]:
        """What the driver's metrics read of it (`rlrunner.agents.metrics`)."""
        return {
            "turns": self.turns,
            "model_tokens": sum(self.mask),
            "tool_calls": sum(1 for call in self.calls if call.get("made", True)),
            "tool_errors": self.errors,
            "tool_timeouts": self.timeouts,
            "ended": self.ended,
            "tool_s": self.tool_s,
            "env_reward": self.env_reward,
        }

    def for_reward(self, prompt_text: str) -> dict[str, Any]:
        """The whole trajectory as a reward function gets it (`extra_info["trajectory"]`)."""
        return {
            "prompt": prompt_text,
            "messages": list(self.messages),
            "tool_calls": list(self.calls),
            "turns": self.turns,
            "ended": self.ended,
            "env_reward": self.env_reward,
        }


@dataclass
class _Chunk:
    trajectories: list[Trajectory]
    turn: int = 0  # assistant turns taken
    pending: Pending | None = None  # answers asked for its last turn
    asked: list[Trajectory] = field(default_factory=list)  # the trajectories `pending` answers
    over: bool = False


class MultiTurnRollout:
    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        token_ids: TokenIds,
        settings: MultiTurnSettings,
        environments: Environments,
        seed: int,
    ):
        self.engine, self.tokenizer, self.token_ids = engine, tokenizer, token_ids
        self.settings, self.environments, self.seed = settings, environments, seed
        self.chat = ChatDeltas(tokenizer, settings.schemas)

    def run(
        self,
        recorder: Recorder,
        mode: str,
        step: int,
        chunks: Sequence[Sequence[tuple[dict, int]]],
        first_sample: int,
        sampling: Sampling,
        chunk_done: Callable[[list[Trajectory]], None],
    ) -> list[Trajectory]:
        """Every trajectory of `chunks` (each a list of (prompt record, sample j)), in order; `chunk_done` is called
        with each chunk's trajectories as soon as all of them have ended (to score them while the others go on)."""
        seed_name = "val_sample" if mode == "val" else "sample"
        runs, position = [], first_sample
        for rows in chunks:
            trajectories = []
            for record, j in rows:
                trajectories.append(Trajectory(position, record, j, list(record["prompt_ids"])))
                position += 1
            runs.append(_Chunk(trajectories))
        everyone = [t for run in runs for t in run.trajectories]
        first = self.environments.start(recorder, [self._turn(mode, step, t, seed_name) for t in everyone])
        for trajectory, observation in zip(everyone, first):
            if observation is not None:
                message = {"role": "user", "content": observation}
                trajectory.prompt_ids = self.chat.extend_prompt(trajectory.prompt_ids, [message])
                trajectory.messages.append(message)
        while not all(run.over for run in runs):
            for run in runs:
                if run.over:
                    continue
                if run.pending is not None:
                    answers = self.environments.answers(recorder, run.pending)
                    for trajectory, answer in zip(run.asked, answers):
                        self._take(trajectory, answer)
                    run.pending = None
                going = [t for t in run.trajectories if t.ended is None]
                if not going:
                    run.over = True
                    self.environments.finish([self._turn(mode, step, t, seed_name) for t in run.trajectories])
                    chunk_done(run.trajectories)
                    continue
                self._generate(going, step, run.turn, seed_name, sampling)
                run.turn += 1
                run.asked = [t for t in going if t.ended is None]
                if run.asked:
                    turns = [self._turn(mode, step, t, seed_name) for t in run.asked]
                    run.pending = self.environments.ask(recorder, turns, run.turn, run.turn >= self.settings.max_turns)
        return everyone

    def _turn(self, mode: str, step: int, trajectory: Trajectory, seed_name: str) -> Turn:
        record, env_record = trajectory.record, {}
        if self.environments.holds_instances:  # what a user's environment's reset gets
            env_record = {
                "prompt": self.tokenizer.decode(record["prompt_ids"]),
                "answer": record["answer"],
                "data_source": record["data_source"],
                "extra_info": record["extra_info"],
                "index": record["index"],
                "sample": trajectory.sample,
                "seed": derive_seed(self.seed, f"{seed_name}_env", step, record["index"], trajectory.sample),
            }
        return Turn(mode, step, trajectory.position, env_record, trajectory.context, list(trajectory.texts))

    def _generate(self, going: list[Trajectory], step: int, turn: int, seed_name: str, sampling: Sampling) -> None:
        """One engine call for the turn of every trajectory still going (those out of tokens end instead)."""
        budget = self.settings.max_response_tokens
        asked = []
        for trajectory in going:
            if len(trajectory.response) >= budget:
                trajectory.ended = "max_response_tokens"
            else:
                asked.append(trajectory)
        if not asked:
            return
        requests = []
        for trajectory in asked:
            parts: tuple = (self.seed, seed_name, step, trajectory.record["index"], trajectory.sample)
            seed = derive_seed(*parts) if turn == 0 else derive_seed(*parts, turn)
            requests.append(SampleRequest(trajectory.context, seed, budget - len(trajectory.response)))
        [completions] = self.engine.generate([requests], sampling)
        eos = set(self.token_ids.eos)
        for trajectory, request, completion in zip(asked, requests, completions):
            tokens = list(completion.token_ids)
            trajectory.response += tokens
            trajectory.mask += [1] * len(tokens)
            trajectory.logprobs += list(completion.logprobs)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            trajectory.texts.append(text)
            trajectory.messages.append({"role": "assistant", "content": text})
            # a turn cut by rollout.max_new_tokens is answered as it is (the template's turn end follows it); one that
            # used up the trajectory's tokens ends it
            trajectory.last_token = tokens[-1] if tokens and tokens[-1] in eos else None
            if trajectory.last_token is None and len(trajectory.response) >= budget:
                trajectory.ended = "max_response_tokens"

    def _take(self, trajectory: Trajectory, answer: Answer) -> None:
        """An answer to the trajectory's last turn: its calls recorded, and what follows the turn added, or the end."""
        trajectory.calls += answer.calls
        trajectory.errors += answer.errors
        trajectory.timeouts += answer.timeouts
        trajectory.tool_s += answer.seconds
        if answer.reward is not None:
            trajectory.env_reward = answer.reward
        trajectory.messages += answer.messages
        if answer.done:
            trajectory.ended = answer.ended or "done"
            return
        delta = self.chat.after_turn(answer.messages, trajectory.last_token)
        if len(trajectory.response) + len(delta) >= self.settings.max_response_tokens:
            trajectory.ended = "max_response_tokens"  # no room for the answer and a turn after it
            return
        trajectory.response += delta
        trajectory.mask += [0] * len(delta)
        trajectory.logprobs += [0.0] * len(delta)

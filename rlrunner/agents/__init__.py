"""Agents: multi-turn rollouts whose model calls tools or talks to an environment between its turns.

The pieces a rollout worker composes (`rlrunner.rollout.multi_turn` runs the turns with its engine):

    tools.py         a tools file: which of its functions are tools, their JSON schemas, a call's output as text
    parsers.py       the model's text -> its tool calls (`hermes`, or a user's own parser)
    tool_process.py  one tool process: calls a tool, or holds environment instances and steps them
    tool_pool.py     a rollout worker's tool processes (rlrunner.utils.process_pool) and the environment seam on them
    chat.py          the chat template's delta for messages after the model's turn: token in, token out
    ledger.py        the record of every tool call and environment step, kept outside the rollout workers (journaled)
    settings.py      `rollout.multi_turn.*` checked and resolved into what the workers get
    metrics.py       a step's agent metrics (pure)

Nothing here imports Ray or an engine: the rollout worker hands these their processes, tokenizer and record keeper.
"""

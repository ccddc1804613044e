"""The algorithm seam as pure tensor functions, chosen by name: `grpo` (GRPO's group advantages, token log-probs,
entropy, KL, masked reductions), `advantages` (advantage estimators: grpo, rloo, reinforce_plus_plus_baseline),
`policy_losses` (per-token policy losses: ppo_clip, gspo), `aggregation` (per-token loss to a micro-batch's scalar
share of the mini-batch loss), `rollout_correction` (truncated importance weights between the actor's and the rollout
engine's log-probs) and `registry` (the name -> "module:attr" tables the config picks from, importable without torch).
"""

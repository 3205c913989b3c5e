"""Rollout workflows: turn a dataset record into a group of scored trajectories.

The workflow contract (docs/plugin-authoring.md, "Workflows") in short:

- required: the constructor ``Workflow(tokenizer=, gconfig=, reward_target=,
  reward_pool=, config=)``, ``async arun_episode(engine, record) ->
  TrajectoryGroup | None``, ``async aevaluate(engine, record,
  max_new_tokens) -> (reward, text)`` and the reward counters
  ``reward_calls``, ``reward_failures``, ``last_reward_error``
  (``scoring.RewardScoring`` provides them);
- optional, with the kernel's default when absent: ``required_fields``
  (``("prompt",)``), ``encode_prompt(record) -> list[int]`` (``areal check``
  shows the tokens before the first generated one instead), ``close()``;
- a trajectory's ``metadata`` may carry ``"metrics"`` and ``"completion"``
  (the text ``areal check`` prints; default: the generated tokens decoded);
- a trajectory's ``reward`` comes from reward calls the workflow made on its
  generated text: between 0 and the largest of their scores (a discounted
  retry is allowed), 0 when every call failed.
"""

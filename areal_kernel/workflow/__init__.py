"""Rollout workflows: turn a dataset record into a group of scored trajectories.

The workflow contract lives in ``areal_kernel.api.workflow`` (its module
docstring; docs/plugin-authoring.md, "Workflows"). In short:

- subclass ``areal_kernel.api.workflow.Workflow``: the kernel builds it with
  ``Workflow.from_context(context)``, whose default calls the constructor
  ``Workflow(tokenizer=, gconfig=, reward_target=, reward_pool=, config=)``;
- required: ``async arun_episode(engine, record) -> TrajectoryGroup | None``,
  ``async aevaluate(engine, record, max_new_tokens) -> (reward, text)`` and
  the reward counters ``reward_calls``, ``reward_failures``
  (``scoring.RewardScoring`` keeps them);
- optional, with the kernel's default when absent: ``required_fields``
  (``("prompt",)``), ``encode_prompt(record) -> list[int]`` (``areal check``
  shows the tokens before the first generated one instead),
  ``last_reward_error``, ``close()``;
- a trajectory's ``metadata`` may carry ``"metrics"`` and ``"completion"``
  (the text ``areal check`` prints; default: the generated tokens decoded);
- a trajectory's ``reward`` comes from reward calls the workflow made on its
  generated text, within ``[min(0, scores), max(0, scores)]`` of them (a
  discounted retry is allowed), 0 when every call failed.
"""

"""The `eval:` section of the run config (learner/evaluate.py)."""

from __future__ import annotations

from pydantic import Field, StrictInt

from rollflash.broker.config_sections import Number, Section


class EvalConfig(Section):
    """The `eval:` section: held-out evaluation by the learner (learner/evaluate.py). When and on
    how many items are `trainer.eval_every` and `task.eval_size`."""

    n_samples: StrictInt = Field(
        0,
        ge=0,
        description="k > 0: also sample k responses per held-out item and report mean reward, "
        "pass@1 and pass@k (0 = greedy accuracy only)",
    )
    temperature: Number = Field(1.0, gt=0, description="sampling temperature of those samples")
    max_new_tokens: StrictInt | None = Field(
        None, gt=0, description="response length limit in evaluation (null = rollout's)"
    )
    threshold: Number = Field(
        1.0, description="a response is correct when its reward is at least this"
    )

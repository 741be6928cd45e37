"""The options of the built-in rewards that take some: `reward.code` (envs/code_verifier.py) and
`reward.judge` (envs/judge.py, served by `rollctl start-reward-worker`)."""

from __future__ import annotations

from pydantic import Field, StrictBool, StrictInt, StrictStr

from rollflash.broker.config.config_base import Number, Section


class CodeRewardConfig(Section):
    """`reward.code`: the `code` verifier runs a response's program against its row's tests."""

    time_s: Number = Field(2.0, gt=0, le=600, description="wall-clock (and CPU) limit of one test")
    memory_mb: StrictInt = Field(
        256, ge=64, le=65536, description="address space of one test's interpreter"
    )
    output_mb: StrictInt = Field(1, ge=1, le=1024, description="stdout + stderr of one test")
    budget_s: Number = Field(
        10.0, gt=0, le=3600, description="all of one sample's tests together; later tests fail"
    )
    max_workers: StrictInt = Field(
        4, ge=1, le=256, description="samples whose tests run at once (threads per generator)"
    )
    all_or_nothing: StrictBool = Field(
        False, description="reward 1 only if every test passes (false: the fraction passed)"
    )


class JudgeConfig(Section):
    """`reward.judge`: the `judge` reward asks a generative model to grade a response."""

    # `model_path` is a config key, not pydantic's `model_` API
    model_config = Section.model_config | {"protected_namespaces": ()}

    url: StrictStr = Field(
        "http://127.0.0.1:8100",
        description="the reward worker (`rollctl start-reward-worker`) or any OpenAI-style "
        "completions server, e.g. `vllm serve`",
    )
    model_path: StrictStr | None = Field(
        None, description="the judge model `rollctl start-reward-worker` serves (HF directory)"
    )
    template: StrictStr = Field(
        "Question: {prompt}\nAnswer: {response}\nReference: {answer}\nScore (0-10):",
        description="the judge's prompt; {prompt}, {response}, {answer} and row columns",
    )
    score_pattern: StrictStr = Field(
        r"-?\d+(?:\.\d+)?",
        description="regex: the first match in the judge's output (group 1 if any) is the score",
    )
    max_score: Number = Field(10.0, gt=0, description="reward = clip(score, 0, max_score) / this")
    max_new_tokens: StrictInt = Field(8, gt=0, le=4096, description="judge output length")
    timeout_s: Number = Field(60.0, gt=0, description="one scoring batch's request to the judge")

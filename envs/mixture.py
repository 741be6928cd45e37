"""`task.name: mixture`: prompts drawn from several tasks (domains) at configured weights.

    task:
      name: mixture
      params:
        components:
          - {task: arithmetic, weight: 0.5, max_new_tokens: 4}
          - name: code                       # the domain: metric names, prompt ids "code/..."
            task: dataset
            params: {path: data/code.jsonl, prompt_key: prompt, answer_key: null}
            weight: 0.5
            reward: {functions: [code]}      # this domain's reward functions (and weights)
            max_new_tokens: 48

Each component is any task of the catalog (envs/catalog.py) with its own `params`, its `weight`
(> 0, normalised), an optional `reward` ({functions, weights}; default: the task's own verifier;
the options of the built-ins, `reward.code` and `reward.judge`, and `reward.timeout_s` are the
run's) and an optional
`max_new_tokens` (default: `rollout.max_new_tokens`; the generators sample each domain's prompts
with its own limit). A mixture takes no top-level `reward.functions`. Multi-turn environments
cannot be components.

Order: item k's domain is drawn from (seed, k // 1024) with `random.Random` at the weights, so the
domain counts follow the weights (a multinomial draw per block of 1024), and each domain's items
are its own task's train stream (with seed (seed, component index)) in order. Item k therefore
depends on k alone, and `train_items(seed, start=k)` resumes exactly: it counts the domains drawn
before k (a Counter per block, about 0.3 s per million items) and resumes each component's stream
at its own position with `envs.base.train_stream` (O(1) for a dataset).

Ids: a domain's item "train-000123" becomes "code/train-000123" (the learner groups its metrics by
that prefix: `reward/<domain>/mean`, `eval/<domain>/heldout_acc`). The held-out set interleaves
the domains' held-out items round-robin, so `eval.size` keeps every domain.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rollflash.envs.answers import final_answer, reference_response
from rollflash.envs.base import Item, Task, train_stream
from rollflash.envs.multiturn import is_multi_turn
from rollflash.errors import BadInput

BLOCK = 1024  # items whose domains are drawn together
_DOMAIN = re.compile(r"[a-z][a-z0-9_]{0,31}")
_KEYS = {"task", "name", "params", "weight", "reward", "max_new_tokens"}


@dataclass
class Component:
    name: str  # the domain
    task: Task
    weight: float  # normalised: the weights sum to 1
    reward: dict[str, Any] | None  # {functions, weights}; None: the task's own verifier
    max_new_tokens: int | None

    @classmethod
    def checked(cls, where: str, spec: dict[str, Any], task: Task) -> Component:
        """The component of `task` with `spec`'s name (default: the task's name), weight and
        max_new_tokens, each checked (errors name `where`)."""
        name = spec.get("name", spec.get("task", task.name))
        if not isinstance(name, str) or not _DOMAIN.fullmatch(name):
            raise BadInput(f"{where}.name: {name!r} is not a short snake_case domain name")
        weight = spec.get("weight", 1.0)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not 0 < weight < math.inf  # NaN and infinity fail too
        ):
            raise BadInput(f"{where}.weight: must be a finite number > 0, got {weight!r}")
        limit = spec.get("max_new_tokens")
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise BadInput(f"{where}.max_new_tokens: must be an integer > 0, got {limit!r}")
        return cls(name, task, float(weight), spec.get("reward"), limit)


def _component(i: int, spec: Any, make_task: Callable[[str, Any], Task]) -> Component:
    """Component `i` of the config's list, its task built by `make_task` (the catalog's)."""
    where = f"task.params.components[{i}]"
    if not isinstance(spec, dict) or "task" not in spec:
        raise BadInput(f"{where}: expected a mapping with a `task` key")
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise BadInput(f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(sorted(_KEYS))}")
    reward = spec.get("reward")
    if reward is not None and (
        not isinstance(reward, dict) or not set(reward) <= {"functions", "weights"}
    ):
        raise BadInput(f"{where}.reward: expected {{functions: [...], weights: [...]}}")
    if spec["task"] == "mixture":
        raise BadInput(f"{where}.task: a mixture cannot contain a mixture")
    try:
        task = make_task(spec["task"], spec.get("params"))
    except ValueError as e:
        raise BadInput(f"{where}: {e}") from None
    if is_multi_turn(task):
        raise BadInput(f"{where}: multi-turn task {spec['task']!r} cannot be mixed")
    return Component.checked(where, spec, task)


class MixtureTask:
    """Several tasks drawn at weights; see the module docstring."""

    name = "mixture"

    def __init__(self, components: list[Component]) -> None:
        """`components`: built from the config's mappings (`from_specs`), or by a task that is a
        mixture of its own (envs/reasoning_gym.py)."""
        self.components = components
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise BadInput(f"task.params.components: domain names repeat ({names}); set `name`")
        total = sum(c.weight for c in self.components)
        for c in self.components:
            c.weight /= total
        self._by_name = {c.name: c for c in self.components}

    @classmethod
    def from_specs(cls, specs: Any, make_task: Callable[[str, Any], Task]) -> MixtureTask:
        """The mixture of the config's `task.params.components` (a non-empty list of mappings),
        each component's task built by `make_task` (envs/catalog.py passes its own)."""
        if not isinstance(specs, list) or not specs:
            raise BadInput("task.params.components: a non-empty list of tasks is required")
        return cls([_component(i, spec, make_task) for i, spec in enumerate(specs)])

    def use_reward_functions(self, reward: Any) -> None:
        """Wrap each component that names reward functions in them; `reward`: the run's
        `reward:` section (the options of code and judge, timeout_s)."""
        from rollflash.envs.reward_functions import RewardFunctions
        from rollflash.envs.scored_task import ScoredTask

        for c in self.components:
            if c.reward and c.reward.get("functions"):
                fns = RewardFunctions.load(
                    c.reward["functions"], c.reward.get("weights"), reward.timeout_s, reward
                )
                c.task = ScoredTask(c.task, fns)

    def use_formatter(self, formatter: Any) -> None:
        """Render every component's prompts with `formatter` (the learner's side)."""
        from rollflash.envs.chat import format_task

        for c in self.components:
            c.task = format_task(c.task, formatter)

    # -- prompts ---------------------------------------------------------------------------------

    def _domains(self, seed: int, block: int) -> list[int]:
        rng = random.Random(f"mixture-{seed}-{block}")
        return rng.choices(
            range(len(self.components)), [c.weight for c in self.components], k=BLOCK
        )

    def positions(self, seed: int, start: int) -> list[int]:
        """How many items of each component precede item `start` of the stream."""
        counts: Counter[int] = Counter()
        full, rest = divmod(start, BLOCK)
        for b in range(full):
            counts.update(self._domains(seed, b))
        counts.update(self._domains(seed, full)[:rest])
        return [counts[i] for i in range(len(self.components))]

    def train_items(self, seed: int, start: int = 0) -> Iterator[Item]:
        """Endless items at the weights, from item `start` on (module docstring)."""
        streams = [
            train_stream(c.task, seed * 1000 + i, pos)
            for i, (c, pos) in enumerate(zip(self.components, self.positions(seed, start)))
        ]
        block, offset = divmod(start, BLOCK)
        while True:
            for d in self._domains(seed, block)[offset:]:
                yield self._tagged(self.components[d].name, next(streams[d]))
            block, offset = block + 1, 0

    def heldout_items(self) -> list[Item]:
        """Every domain's held-out items, interleaved round-robin."""
        lists = [
            [self._tagged(c.name, it) for it in c.task.heldout_items()] for c in self.components
        ]
        return [it for row in itertools.zip_longest(*lists) for it in row if it is not None]

    @staticmethod
    def _tagged(domain: str, item: Item) -> Item:
        return dataclasses.replace(item, id=f"{domain}/{item.id}")

    # -- scoring ---------------------------------------------------------------------------------

    def component_of(self, item: Item) -> tuple[Component, Item]:
        """The component an item came from and the item as that component made it."""
        domain, _, inner = item.id.partition("/")
        if domain not in self._by_name:
            raise ValueError(f"mixture: item {item.id!r} belongs to no domain of this mixture")
        return self._by_name[domain], dataclasses.replace(item, id=inner)

    def final_answer(self, item_id: str, response: str) -> str:
        """The response's final answer as the item's domain reads it (envs/answers.py)."""
        domain, _, inner = item_id.partition("/")
        component = self._by_name.get(domain)
        if component is None:
            return response.strip()
        return final_answer(component.task, inner, response)

    def reference_response(self, item: Item) -> str | None:
        """A right response as the item's domain writes it (envs/answers.py)."""
        component, inner = self.component_of(item)
        return reference_response(component.task, inner)

    def response_limit(self, item: Item) -> int | None:
        """The item's domain's response limit (None: rollout.max_new_tokens)."""
        return self.component_of(item)[0].max_new_tokens

    def score(self, item: Item, response: str) -> float:
        component, inner = self.component_of(item)
        return component.task.score(inner, response)

    def score_groups(self, items: list[Item], groups: list[list[str]]) -> list[list[float]]:
        """Rewards shaped like `groups`: each domain's items scored in one batch by its task."""
        out: list[list[float]] = [[] for _ in items]
        by_domain: dict[str, list[int]] = {}
        for k, item in enumerate(items):
            by_domain.setdefault(self.component_of(item)[0].name, []).append(k)
        for domain, ks in by_domain.items():
            task = self._by_name[domain].task
            inner = [self.component_of(items[k])[1] for k in ks]
            batch = getattr(task, "score_groups", None)
            if batch is not None:
                scores = batch(inner, [groups[k] for k in ks])
            else:
                scores = [[task.score(it, r) for r in groups[k]] for it, k in zip(inner, ks)]
            for k, row in zip(ks, scores):
                out[k] = row
        return out

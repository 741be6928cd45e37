"""Tasks: prompt sources and verifiable rewards (stdlib only; see envs/base.py)."""

from envs.base import Item, Task, response_text
from envs.registry import known_tasks, make_task

__all__ = ["Item", "Task", "known_tasks", "make_task", "response_text"]

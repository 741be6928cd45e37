"""Tasks: prompt sources and verifiable rewards (stdlib only; see envs/base.py), and multi-turn
environments (envs/multiturn.py, envs/episode.py)."""

from rollflash.envs.base import Item, Task, response_text, train_stream
from rollflash.envs.catalog import known_tasks, make_task, task_from_config
from rollflash.envs.episode import Episode, char_encoder, chat_encoder, encoder_for, plain_encoder
from rollflash.envs.multiturn import EnvTask, StepResult, is_multi_turn

__all__ = [
    "Episode",
    "EnvTask",
    "Item",
    "StepResult",
    "Task",
    "char_encoder",
    "chat_encoder",
    "encoder_for",
    "is_multi_turn",
    "known_tasks",
    "make_task",
    "plain_encoder",
    "response_text",
    "task_from_config",
    "train_stream",
]

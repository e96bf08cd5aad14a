"""Evaluation tasks: GLUE (nine), SQuAD v1.1 (and its long-input form, squad-doc) and WikiText, each a small
Python definition with a version.

``approx.tasks.tasks()`` lists them, ``approx.tasks.get_task(name)`` returns one; ``approx tasks`` prints
them with their metrics, modes and defaults. Adding a task: one ``@register_task`` class (CONTRIBUTING.md).
"""

from .base import (
    SOURCE_ENV_VAR,
    DataError,
    DataSource,
    Feature,
    Task,
    collate,
    get_task,
    read_tsv,
    register_task,
    tasks,
)

__all__ = [
    "SOURCE_ENV_VAR",
    "DataError",
    "DataSource",
    "Feature",
    "Task",
    "collate",
    "get_task",
    "read_tsv",
    "register_task",
    "tasks",
]

"""The tasks a model family can serve (``app.tasks.base.Task``): ``rank`` (the two shipped
families), ``classify``, ``score`` and ``embed``. A family declares its task
(``app.model_family.ModelFamily.task``); the task gives its HTTP route, the dry-run checks of
its answers and how a candidate's answers are compared with stable's.

Pure package: numpy and the standard library; no Ray, torch or database.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from app.errors import ConfigError
from app.tasks.base import TASK_NAMES, Measure, MeasureTotals, Task, TaskName
from app.tasks.classify import CLASSIFY
from app.tasks.embed import EMBED
from app.tasks.rank import RANK
from app.tasks.score import SCORE

TASKS: Final[Mapping[str, Task]] = {task.name: task for task in (RANK, CLASSIFY, SCORE, EMBED)}


def task_named(name: str, where: str = "task") -> Task:
    """The task called ``name``; ConfigError naming ``where`` and the known tasks."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(
            f"{where}: unknown task {name!r} (known: {', '.join(TASKS)})", field=where
        ) from None


__all__ = [
    "CLASSIFY",
    "EMBED",
    "RANK",
    "SCORE",
    "TASKS",
    "TASK_NAMES",
    "Measure",
    "MeasureTotals",
    "Task",
    "TaskName",
    "task_named",
]

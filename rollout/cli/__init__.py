"""The ``rollout`` command line, one module per family of commands.

``main`` (``rollout/cli/main.py``) builds the group and runs it; ``artifacts``, ``operate`` and
``registry`` hold the commands; ``options``, ``render``, ``progress`` and ``exit_codes`` what
they share. This package re-exports what the single module ``rollout/cli.py`` exported, so the
entry point ``rollout.cli:main`` and every import of ``rollout.cli`` keep working.

Importing ``rollout.cli.main`` binds the package attribute ``main`` to the submodule; the
import below binds it back to the function, which is what ``rollout.cli.main`` has always
named. Reach the module through ``sys.modules`` or ``from rollout.cli.main import ...``.
"""

from rollout.cli.artifacts import (
    DEFAULT_CACHE_DIR,
    MAX_EXPECTED_DIVERGENCE_BYTES,
    keygen,
    make_demo_artifacts_command,
    pack,
    replay,
    verify,
)
from rollout.cli.main import cli, main
from rollout.cli.operate import (
    _show_ping,
    controller,
    controller_keep,
    controller_start,
    controller_status,
    controller_stop,
    history_command,
    rollback_command,
    standby_command,
    start_command,
    status_command,
)
from rollout.cli.render import emit

__all__ = [
    "DEFAULT_CACHE_DIR",
    "MAX_EXPECTED_DIVERGENCE_BYTES",
    "_show_ping",
    "cli",
    "controller",
    "controller_keep",
    "controller_start",
    "controller_status",
    "controller_stop",
    "emit",
    "history_command",
    "keygen",
    "main",
    "make_demo_artifacts_command",
    "pack",
    "replay",
    "rollback_command",
    "standby_command",
    "start_command",
    "status_command",
    "verify",
]

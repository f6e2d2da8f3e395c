"""``python -m rollout``: the ``rollout`` command, as the installed binary runs it."""

import sys

from rollout.cli.main import main

sys.exit(main())

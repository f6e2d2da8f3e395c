"""Settings of the developer's shell that would change what the tests exercise, and the time
table every run ends with (tests/time_table.py). Loaded by every tier: it imports no torch and
no Ray."""

import os

from app.cache import NODE_CACHE_DIR_ENV

pytest_plugins = ("tests.time_table",)

# A node's own cache directory wins over every replica's cache_dir: the tests name theirs.
os.environ.pop(NODE_CACHE_DIR_ENV, None)

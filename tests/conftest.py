"""Settings of the developer's shell that would change what the tests exercise."""

import os

from app.replica import NODE_CACHE_DIR_ENV

# A node's own cache directory wins over every replica's cache_dir: the tests name theirs.
os.environ.pop(NODE_CACHE_DIR_ENV, None)

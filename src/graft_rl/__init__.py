"""graft-rl: cross-model reinforcement learning with verifiable rewards (GRAFT).

Subpackages are imported on demand so that ``from graft_rl import algo`` loads torch only.
The version is the installed distribution's (``pyproject.toml`` is its one source).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("graft-rl")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

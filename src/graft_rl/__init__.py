"""graft-rl: cross-model reinforcement learning with verifiable rewards (GRAFT).

Subpackages are imported on demand so that ``from graft_rl import algo`` loads torch only; the
names most code needs are importable from here as well (``from graft_rl import Trainer,
load_config``). The version is the installed distribution's (``pyproject.toml`` is its one source).
The layers, one folder each: docs/design.md.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("graft-rl")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

#: name -> the module that defines it (imported on first use)
_API = {
    "Trainer": "graft_rl.engine.trainer",
    "TrainConfig": "graft_rl.engine.config",
    "load_config": "graft_rl.engine.config",
    "MethodConfig": "graft_rl.methods",
    "register_method": "graft_rl.methods",
    "register_advantage": "graft_rl.methods",
    "register_loss": "graft_rl.methods",
    "probe": "graft_rl.commands.probe",
    "run_eval": "graft_rl.commands.evaluate_cli",
    "analyze": "graft_rl.commands.analyze",
}


def __getattr__(name: str):
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'graft_rl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])

"""graft-rl: cross-model reinforcement learning with verifiable rewards (GRAFT).

Subpackages are imported on demand so that ``from graft_rl import algo`` loads torch only.
"""

__version__ = "0.1.0"

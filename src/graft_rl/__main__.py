"""``python -m graft_rl``: the ``graft`` command."""

from graft_rl.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

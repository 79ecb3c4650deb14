"""Layer 6, the commands (docs/design.md): ``graft train | eval | analyze | probe | plan |
preflight | seeds`` and what only they use (the run's default config, reports and plots)."""

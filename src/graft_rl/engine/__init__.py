"""Layer 5, the engine (docs/design.md): the config, the step loop and its parts (rollouts,
checkpointing, validation), workers and their handles, Ray actor groups, records, run directories,
evaluation of one policy, resource planning, and the CPU testbed pairs."""

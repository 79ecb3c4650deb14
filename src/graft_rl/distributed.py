"""``execution: ray``: one Ray actor per policy (SPEC §4 layer 5, "Execution").

Each actor holds a :class:`~graft_rl.worker.PolicyWorker` (model, optimiser, rollout backend)
on its own resources (``ray.num_cpus``/``num_gpus`` per policy, plus per-policy options such
as custom node resources). The driver only coordinates: it gathers groups (texts, token ids,
generation log-probs), verifies rewards, runs the exchange selection and sends each receiver
its batch. Model weights never cross the wire. Generation of all policies overlaps in time.

Run directories must be on a filesystem every node can write (checkpoints are written by
the actors). An actor that dies is reported with its policy name; resume with ``--resume``.
"""

from __future__ import annotations

__all__ = ["start_actors", "get", "ActorDied"]


class ActorDied(RuntimeError):
    """A policy's actor died; the run can be resumed from its last checkpoint."""


_NAMES: dict = {}


def start_actors(cfg, policy_configs) -> dict:
    import ray

    from graft_rl.worker import PolicyWorker

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=True, ignore_reinit_error=True)
    remote_cls = ray.remote(PolicyWorker)
    actors = {}
    for pc in policy_configs:
        opts = {"num_cpus": cfg.ray.num_cpus, "num_gpus": cfg.ray.num_gpus, "name": None, "max_restarts": 0}
        opts.update(cfg.ray.resources.get(pc.name, {}))
        threads = cfg.ray.torch_threads or max(1, int(cfg.ray.num_cpus))
        actor = remote_cls.options(**{k: v for k, v in opts.items() if v is not None}).remote(
            pc, cfg.method, cfg.minibatch, cfg.nonfinite_loss, None, None, threads
        )
        actors[pc.name] = actor
        _NAMES[actor._actor_id.hex()] = pc.name
    # fail early (with the policy's name) if an actor cannot build its model
    for name, actor in actors.items():
        get(actor.name.remote(), name)
    return actors


def get(ref, name: str | None = None):
    """``ray.get`` that names the policy whose actor died."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return ray.get(ref)
    except RayActorError as exc:
        who = name or _NAMES.get(getattr(exc, "actor_id", None) or "", "?")
        raise ActorDied(
            f"the Ray actor of policy {who!r} died ({type(exc).__name__}); resume the run with `graft train --resume RUN_DIR`"
        ) from exc
    except RayTaskError as exc:
        raise exc.as_instanceof_cause() from None

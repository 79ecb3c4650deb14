"""Where ``graft eval``'s work runs (paper Section 5.1, Appendix B): one in-process evaluator, or a
policy's replicas as Ray actors on the run's cluster, each benchmark cut into chunks of
:data:`~graft_rl.engine.evaluation.EVAL_CHUNK` problems dealt over them (a chunk's seed depends only
on its run and first problem, so any number of replicas gives the same numbers). The command
(:mod:`graft_rl.commands.evaluate_cli`) chooses what to evaluate and writes the results.
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

from graft_rl.engine.evaluation import EVAL_CHUNK, evaluate_policy, pass_at_k
from graft_rl.engine.worker import PolicyWorker
from graft_rl.policy import Policy, PolicyConfig

__all__ = ["LocalEvaluator", "eval_ray_config", "start_evaluators", "evaluate_benchmarks", "close_evaluators"]


class LocalEvaluator:
    """The in-process evaluator: one Policy, the same calls as a replica actor's."""

    def __init__(self, pc: PolicyConfig):
        self.policy = Policy(pc)

    def close(self) -> None:
        close = getattr(self.policy, "close", None)  # a Policy: its rollout engine's memory is freed
        if callable(close):
            close()

    def evaluate(self, *args, **kwargs):
        return evaluate_policy(self.policy, *args, **kwargs)

    def prompt_budget(self, problems, max_new_tokens):
        from graft_rl.engine.worker import prompt_budget

        return prompt_budget(self.policy, problems, max_new_tokens)


def eval_ray_config(target: str, pc: PolicyConfig, replicas: int):
    """``(Ray settings, replicas)`` for the eval actors of one policy: the run's (address, CPUs, GPUs,
    custom resources) where ``target`` is a run directory, else a local Ray. The replicas are fitted to
    the nodes the policy is pinned to (:func:`~graft_rl.engine.distributed.fit_replicas`): on CPUs they
    share those nodes' cores; fewer than asked when no more fit there (said in one line)."""
    from dataclasses import replace as dc_replace

    from graft_rl.engine.config import RayConfig, load_config

    cfg_file = Path(target).expanduser() / "config.yaml"
    cfg = load_config(cfg_file, [f"run_dir={target}"], saved=True) if cfg_file.is_file() else None
    ray_cfg = dc_replace(cfg.ray) if cfg is not None else RayConfig()
    from types import SimpleNamespace

    from graft_rl.engine.distributed import fit_replicas, init_ray

    init_ray(ray_cfg.address)
    if pc.device.startswith("cuda"):
        ray_cfg.num_gpus = ray_cfg.num_gpus or 1.0
    else:
        ray_cfg.num_gpus = 0.0
    settings = SimpleNamespace(ray=ray_cfg)
    fitted, cpus = fit_replicas(settings, pc, replicas)
    ray_cfg.num_cpus = cpus
    if fitted < replicas:
        print(
            f"graft eval: {pc.name}: {fitted} of {replicas} replicas fit on the Ray nodes it may run on "
            f"(ray.resources.{pc.name}); evaluating with {fitted} (the numbers do not depend on how many)"
        )
    return settings, fitted


def start_evaluators(target: str, pc: PolicyConfig, replicas: int) -> tuple[list, bool]:
    """``(workers, are Ray actors)``: one in-process evaluator, or ``replicas`` Ray actors."""
    if replicas == 1:
        return [LocalEvaluator(pc)], False
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            f"spreading {pc.name} over {replicas} devices needs Ray (pip install 'graft-rl[ray]'); "
            f"--world-size 1 evaluates in this process"
        )
    from graft_rl.engine.distributed import start_replicas

    settings, fitted = eval_ray_config(target, pc, replicas)
    return start_replicas(settings, pc, fitted), True


def evaluate_benchmarks(
    pc, workers, actors, data, bench, samples, runs, temperature, top_p, max_new_tokens, show, tqdm
) -> dict:
    """Every benchmark of ``data`` (label -> problems, ``bench[label]["reward"]`` its verifier) over
    ``runs`` seeds, its chunks of :data:`EVAL_CHUNK` problems dealt over the evaluators (``actors``:
    Ray replicas, at once), with ``tqdm`` progress: per benchmark pass@1 mean, std and runs, and pass@k
    over the pooled samples."""
    from graft_rl.engine.distributed import get

    def call(worker, fn, *args):  # fn: the PolicyWorker method (a Ray actor's of the same name)
        if actors:  # submitted now, all at once: the replicas work while the bar below waits on them
            return getattr(worker, fn.__name__).remote(*args)
        return functools.partial(getattr(worker, fn.__name__), *args)  # in this process: run when awaited

    def result(handle):
        return get(handle, pc.name) if actors else handle()

    per: dict = {}
    jobs: list[tuple] = []  # (label, run, chunk start, handle)
    for label, problems in data.items():
        budget, note = result(call(workers[0], PolicyWorker.prompt_budget, problems, max_new_tokens))
        if note and show:
            print(f"graft eval: {note} on {label}")
        verifier = bench[label]["reward"]
        for r in range(runs):
            for s in range(0, len(problems), EVAL_CHUNK):
                w = workers[len(jobs) % len(workers)]
                jobs.append(
                    (
                        label,
                        r,
                        s,
                        call(
                            w,
                            PolicyWorker.evaluate,
                            problems[s : s + EVAL_CHUNK],
                            verifier,
                            samples,
                            temperature,
                            top_p,
                            budget,
                            1000 * r + s,
                        ),
                    )
                )
    bar = tqdm(total=len(jobs), desc=f"graft eval {pc.name}", unit="chunk", disable=not show)
    correct: dict = {}
    for label, r, s, handle in jobs:
        correct[(label, r, s)] = result(handle)["correct"]
        bar.update(1)
    bar.close()
    for label, problems in data.items():
        run_scores, pooled = [], [0] * len(problems)
        for r in range(runs):
            c = [x for s in range(0, len(problems), EVAL_CHUNK) for x in correct[(label, r, s)]]
            run_scores.append(statistics.fmean(x / samples for x in c))
            pooled = [a + b for a, b in zip(pooled, c, strict=True)]
        total = samples * runs
        ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, total) if k <= total})
        per[label] = {
            "pass@1_mean": statistics.fmean(run_scores),
            "pass@1_std": statistics.stdev(run_scores) if runs > 1 else 0.0,
            "pass@1_runs": run_scores,
            "pass@k": {k: statistics.fmean(pass_at_k(total, c, k) for c in pooled) for k in ks},
            "problems": len(problems),
        }
    return per


def close_evaluators(workers: list, actors: bool) -> None:
    """Free the evaluators (Ray actors killed; an in-process engine's memory freed), so the next policy's
    engines can start on the same devices."""
    if actors:
        from graft_rl.engine.distributed import kill_actors

        kill_actors(workers)
    else:
        workers[0].close()

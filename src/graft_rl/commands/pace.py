"""The pace model: a step's wall time under either rollout schedule, from each policy's phase times
(``graft plan --gpus N``; docs/benchmarks.md, "One step off").

A small discrete-event simulation of the lockstep that GRAFT needs (every policy's group of a prompt
in the same step). :func:`colocated_step` plays ``rollout.mode: colocated``: each policy generates on its
trainer devices; the driver verifies every policy's groups, one after another, and builds the exchange;
every policy updates at once; under Ray a policy whose update is done starts its next generation.
:func:`one_step_off_step` plays ``one_step_off``: the trainer waits for every policy's batch (the
lockstep wait for the slowest generator), verifies, pushes each policy's weights (one after another,
each generator starting its next batch right after its push), builds the exchange and updates while
the generators sample. Both return the steady-state seconds per step (validation amortised over its
``every``). One policy one step off: ``max(verify + push + generate, verify + push + exchange + update)``,
since a batch starts only after the previous one is verified and the weights pushed.

What it leaves out (say so where its numbers are used): contention between the two sides on shared
hardware (memory bandwidth on a CPU, a node's PCIe/NVLink), the time an engine takes to wake and
reload when colocated, and any scaling loss: the phase times are given per schedule, so a caller that
divides one device's generation time by ``g`` assumes perfect scaling, under which colocated work on
2 devices takes as long as overlapped work on 1 + 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PhaseTimes", "colocated_step", "one_step_off_step"]


@dataclass(frozen=True)
class PhaseTimes:
    """One policy's seconds per step in each phase, on the devices the schedule gives it."""

    generate: float  # sampling the step's batch (its generators one step off; its trainer devices colocated)
    verify: float = 0.0  # rewards, on the driver
    push: float = 0.0  # weights to the generators (one step off; colocated pushes are part of generate)
    exchange: float = 0.0  # the driver's exchange, records and metrics
    update: float = 0.0  # pi_old, weights and the update on the trainer devices
    validation: float = 0.0  # one validation, on the trainer devices
    every: int = 0  # steps between validations (0: none)


def _validation(policies: Sequence[PhaseTimes], step: int) -> float:
    return max((p.validation for p in policies if p.every and step % p.every == 0), default=0.0)


def _steady(marks: list[float]) -> float:
    """Seconds per step between the first step (which waits for a generation nothing overlapped) and the
    last (which starts none)."""
    return (marks[-2] - marks[0]) / (len(marks) - 2)


def colocated_step(policies: Sequence[PhaseTimes], steps: int = 60, prefetch: bool = True) -> float:
    """``rollout.mode: colocated``: seconds per step. ``prefetch``: a policy starts its next generation when
    its own update is done (Ray); without it, when every update is (one process)."""
    gen_end = [p.generate for p in policies]
    marks, t = [], 0.0
    for step in range(1, steps + 1):
        t = max(t, *gen_end)
        t += sum(p.verify for p in policies) + max(p.exchange for p in policies)
        ends = [t + p.update for p in policies]
        t = max(ends)
        val = _validation(policies, step)
        t += val
        starts = ends if prefetch and not val else [t] * len(policies)
        gen_end = [s + p.generate for s, p in zip(starts, policies, strict=True)]
        marks.append(t)
    return _steady(marks)


def one_step_off_step(policies: Sequence[PhaseTimes], steps: int = 60) -> float:
    """``rollout.mode: one_step_off``: seconds per step (step 1's batch is pushed and sampled first)."""
    gen_end = [p.push + p.generate for p in policies]
    marks, t = [], 0.0
    for step in range(1, steps + 1):
        t = max(t, *gen_end)  # the lockstep: every policy's batch, the slowest generator's included
        t += sum(p.verify for p in policies)
        for i, p in enumerate(policies):
            if step < steps:
                t += p.push
                gen_end[i] = t + p.generate
        t += max(p.exchange for p in policies)
        t = max(t + p.update for p in policies)
        t += _validation(policies, step)
        marks.append(t)
    return _steady(marks)


# ---------------------------------------------------------------------------------- graft plan --gpus N
#: Planning figure for a push to the generators: bytes per second from trainer rank 0 to the generator
#: replicas (NCCL over NVLink within a node moves several times this; across nodes, less). An assumption.
PUSH_BYTES_PER_S = 25e9

#: Planning figure for verification on the driver: responses checked per second by its reward workers
#: (math-verify, a few milliseconds a response, over a pool of processes). An assumption.
VERIFY_RESPONSES_PER_S = 2_000


def _splits(k: int, total: int, least: int):
    """Every way to give ``k`` parts at least ``least`` each and ``total`` in all."""
    if k == 1:
        if total >= least:
            yield [total]
        return
    for g in range(least, total - least * (k - 1) + 1):
        for rest in _splits(k - 1, total - g, least):
            yield [g, *rest]


def _times(work, cfg, gen_gpus: int, train_gpus: int, push: float) -> PhaseTimes:
    gen, _ = work.seconds(gen_gpus)
    _, upd = work.seconds(train_gpus)
    return PhaseTimes(generate=gen, verify=cfg.prompt_batch * cfg.n / VERIFY_RESPONSES_PER_S, push=push, update=upd)


def generator_peak(pc, gpu_bytes: float) -> float:
    """A generator replica's GPU memory: the policy's model in float32 (the copy pushes land in; a LoRA
    policy's merged weights) and, for vLLM, its awake engine's share of the GPU; plus the runtime margin."""
    from graft_rl.commands.plan import RUNTIME_BYTES, model_shape
    from graft_rl.policy.vllm_backend import VLLM_MEMORY_SHARE

    share = float(pc.vllm_kwargs.get("gpu_memory_utilization", VLLM_MEMORY_SHARE)) if pc.backend == "vllm" else 0
    return 4 * model_shape(pc).params + share * gpu_bytes + RUNTIME_BYTES


def best_one_step_off(cfg, works, gpus: int, gpu_bytes: float):
    """``(seconds per step, [(generator GPUs, trainer GPUs)] per policy, fits, phase times)``: the split of
    ``gpus`` with the shortest one-step-off step (fitting memory first). Each split of ``gpus`` between the
    policies is tried; within a policy's share, the split between its generators and trainers that is best
    for that policy alone (so the search grows with the shares, not with every way to cut ``gpus``)."""
    from dataclasses import replace

    from graft_rl.commands.plan import model_shape, plan_policy

    _BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
    push = [_BYTES.get(pc.dtype, 2) * model_shape(pc).params / PUSH_BYTES_PER_S for pc in cfg.policies]
    own: dict[tuple[int, int], tuple] = {}

    def within(i: int, share: int) -> tuple:
        """Policy ``i``'s best (fits, step, (g, t), times) on ``share`` GPUs."""
        if (i, share) not in own:
            pc = cfg.policies[i]
            options = []
            for g in range(1, share):
                t = share - g
                times = _times(works[i], cfg, g, t, push[i])
                fits = plan_policy(replace(pc, world_size=t), cfg).peak(gpu_bytes) <= gpu_bytes
                fits = fits and generator_peak(pc, gpu_bytes) <= gpu_bytes
                options.append((not fits, one_step_off_step([times]), (g, t), times))
            own[(i, share)] = min(options, key=lambda o: o[:2])
        return own[(i, share)]

    best = None
    for shares in _splits(len(works), gpus, 2):
        picks = [within(i, share) for i, share in enumerate(shares)]
        step = one_step_off_step([p[3] for p in picks])
        key = (any(p[0] for p in picks), step)
        if best is None or key < best[0]:
            best = (key, step, [p[2] for p in picks], not key[0], [p[3] for p in picks])
    assert best is not None
    return best[1], best[2], best[3], best[4]


def format_schedules(cfg, gpus: int, gpu_gib: float = 141.0) -> str:
    """``graft plan --gpus N``: the colocated step at the best split of ``gpus`` between the policies, and the
    one-step-off step at the best split between each policy's generators and trainers, with whether each
    fits memory and the phase times the pace model played."""
    from dataclasses import replace

    from graft_rl.commands.plan import GiB, plan_policy, step_work, suggest_split

    G = gpu_gib * GiB
    works = [step_work(pc, cfg) for pc in cfg.policies]
    if gpus < 2 * len(works):
        return f"One step off needs a generator GPU and a trainer GPU per policy: at least {2 * len(works)} GPUs."
    split, _ = suggest_split(works, gpus)
    co_times = [_times(w, cfg, g, g, 0.0) for w, g in zip(works, split, strict=True)]
    co = colocated_step(co_times)
    co_fits = all(
        plan_policy(replace(pc, world_size=g), cfg).peak(G) <= G for pc, g in zip(cfg.policies, split, strict=True)
    )
    off, pairs, off_fits, off_times = best_one_step_off(cfg, works, gpus, G)
    names = [w.name for w in works]
    fit = {True: "fits", False: "does NOT fit"}
    lines = [
        f"Schedules on {gpus} GPUs of {gpu_gib:g} GiB (pace model, graft_rl.commands.pace; the policies in lockstep):",
        f"- colocated (rollout.mode: colocated): {' / '.join(f'{n} {g}' for n, g in zip(names, split, strict=True))} "
        f"GPUs: ~{co:.0f} s a step ({fit[co_fits]})",
        "- one step off (rollout.mode: one_step_off): "
        + " / ".join(f"{n} {g} generator + {t} trainer" for n, (g, t) in zip(names, pairs, strict=True))
        + f" GPUs: ~{off:.0f} s a step, {off / co - 1:+.0%} against colocated ({fit[off_fits]}; a generator "
        f"holds the model in float32 beside its engine)",
        "Phase times the model played (s a step; generate and update from the FLOP planning figures above at each "
        f"schedule's GPUs, verify at {VERIFY_RESPONSES_PER_S:,} responses/s on the driver, push of the compute-dtype "
        f"weights at {PUSH_BYTES_PER_S / 1e9:g} GB/s; all assumptions, none measured on a GPU here):",
    ]
    for n, c, o in zip(names, co_times, off_times, strict=True):
        lines.append(
            f"- {n}: colocated generate {c.generate:.0f}, update {c.update:.0f}, verify {c.verify:.1f}; one step off "
            f"generate {o.generate:.0f}, update {o.update:.0f}, push {o.push:.1f}"
        )
    lines.append(
        "Under perfect scaling (as these figures assume) colocated work on 2 GPUs takes as long as overlapped work on "
        "1 + 1, so the model finds gains only where generation and update are unequal at the split; the +23-40 % "
        "that verl's one-step-off recipe reports also come from what the model leaves out: decode that scales "
        "worse than linearly with GPUs, and a colocated engine's wake, reload and resharding each step."
    )
    return "\n".join(lines)

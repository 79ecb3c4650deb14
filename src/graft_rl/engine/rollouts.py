"""A training step's rollout phase (paper Section 4, step 1-2; Section 6.2 for stored peers).

:class:`Rollouts` is the trainer's collaborator for steps 1 and 2 of a step: which prompts a step
draws, every policy's generation (:meth:`Rollouts.generate`, started on its worker, so under Ray the
policies sample at once), then :meth:`Rollouts.verify`: the reward (the run's reward, or the
``reward_groups`` the trainer was given; success is ``reward >= data.success_threshold``), the method's rollout filter
with its refills (DAPO's dynamic sampling), and the replay of stored peers' groups. Every draw
derives from ``(seed, step, policy)``, so a resumed run samples what an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from graft_rl.data import Problem, check_answers, default_reward
from graft_rl.engine.handles import Pending, WorkerHandle
from graft_rl.engine.prompts import PromptRows
from graft_rl.engine.store import RecordStore
from graft_rl.engine.timing import PhaseTimer
from graft_rl.policy import RolloutGroup, SamplingParams
from graft_rl.rewards import Reward, resolve_reward
from graft_rl.seeding import Purpose, derive_seed

__all__ = ["DynamicSamplingError", "Rollouts", "run_reward"]

#: A step's groups per policy, and each policy's metric line so far.
Groups = dict[str, list[RolloutGroup]]


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling found too few prompts with mixed rewards within ``method.max_num_gen_batches``."""


def run_reward(cfg, data: Sequence[Problem], given) -> Reward:
    """The run's reward: the one given to the trainer (recorded in the config), else ``data.reward``
    (``auto``: the training set's own verifier, math for a user's file). Checked before training: a
    built-in's references must be matchable; a user's function runs once on a reference answer, so an
    import error or a broken contract is one line now."""
    if given is not None:
        reward = resolve_reward(given, cfg.data.success_threshold)
        cfg.data.reward = reward.name if reward.payload is None else f"python:{reward.name}"
    else:
        spec = cfg.data.reward if cfg.data.reward != "auto" else default_reward(cfg.data.train, data[0])
        reward = resolve_reward(spec or "math", cfg.data.success_threshold)
    if reward.builtin:
        check_answers(data, reward.target, cfg.data.train)
    else:
        reward.check(data[0].row(), cfg.data.verify_timeout)
    return reward


class Rollouts:
    """Steps 1-2 of a training step for the live ``policies`` (their ``workers``) and the stored
    ``peers`` (name -> (records, the peer's policy)); ``names`` orders every participant for seeds."""

    def __init__(
        self,
        cfg,
        data: Sequence[Problem],
        rows: PromptRows,
        reward: Reward,
        workers: Mapping[str, WorkerHandle],
        samplings: Mapping[str, SamplingParams],
        names: Sequence[str],
        method,
        peers: Mapping[str, tuple[RecordStore, str]] | None = None,
        reward_groups: Callable[[list[RolloutGroup]], dict] | None = None,
        one_step=None,
    ):
        """``one_step``: the one-step-off schedule (:class:`~graft_rl.engine.generators.OneStepOff`), where
        training generations run on generators of their own (``rollout.mode: one_step_off``)."""
        self.cfg, self.data, self.rows, self.reward = cfg, data, rows, reward
        self.one_step = one_step
        self.workers, self.samplings, self.names, self.method = workers, samplings, list(names), method
        self.peers, self.given_reward_groups = peers or {}, reward_groups
        self.steps_per_epoch = len(data) // cfg.prompt_batch
        # Ray: generations started for the next step as each policy's update finished (Trainer.update)
        self._prefetched: dict[tuple[str, int], Pending] = {}

    # ------------------------------------------------------------------ data order
    def prompts_for_step(self, step: int, name: str | None = None) -> list[tuple[str, str]]:
        """The prompt batch of a step: epoch-wise shuffles seeded by (seed, epoch), the same for every
        policy; with ``rollout.prompts: own``, policy ``name``'s own shuffle, seeded by (seed, epoch,
        policy) (SAPO: each node draws its own questions from one dataset)."""
        epoch, pos = divmod(step - 1, self.steps_per_epoch)
        if name is not None and self.cfg.rollout.prompts == "own":
            seed = derive_seed(self.cfg.seed, Purpose.PROMPT_STREAM, epoch, self.names.index(name))
        else:
            seed = derive_seed(self.cfg.seed, Purpose.EPOCH_ORDER, epoch)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(self.data), generator=g)
        idx = perm[pos * self.cfg.prompt_batch : (pos + 1) * self.cfg.prompt_batch].tolist()
        return self.rows.draw(idx, step)  # the rows a reward gets for them are kept for the step

    # ------------------------------------------------------------------ generation (step 1)
    def generation_seed(self, name: str, step: int) -> int:
        return derive_seed(self.cfg.seed, Purpose.GENERATE, step, self.names.index(name))

    def start(self, name: str, step: int) -> Pending:
        """Start policy ``name``'s generation for ``step`` on its worker: ``(groups, seconds)``; one step off,
        the batch in flight or one sampled now on its generators (:meth:`OneStepOff.batch`)."""
        if self.one_step is not None:
            prompts = self.prompts_for_step(step, name)
            return self.one_step.batch(name, step, prompts, self.samplings[name], self.generation_seed(name, step))
        return self.workers[name].generate(
            self.prompts_for_step(step, name),
            self.samplings[name],
            self.generation_seed(name, step),
            self.cfg.rollout.lag,
        )

    def prefetch(self, names: Iterable[str], step: int) -> None:
        """Start ``step``'s generation for ``names`` now (a policy whose update is done); :meth:`generate`
        takes it up. (One step off, the generators sample ahead: :meth:`advance`.)"""
        if self.one_step is not None:
            return
        for name in names:
            self._prefetched[(name, step)] = self.start(name, step)

    def drop_prefetched(self) -> None:
        """Forget generations started for a step that will not run (the end of a ``Trainer.run`` call)."""
        self._prefetched.clear()
        if self.one_step is not None:
            self.one_step.drop()

    def advance(self, step: int, last: int) -> None:
        """One step off, after ``step``'s verification: push each policy's live weights to its generators and
        start step ``step + 1``'s generation there (up to step ``last``), to run while ``step`` updates."""
        if self.one_step is None or step + 1 > last:
            return
        for name in self.workers:
            prompts = self.prompts_for_step(step + 1, name)
            seed = self.generation_seed(name, step + 1)
            self.one_step.advance(name, step + 1, prompts, self.samplings[name], seed)

    def generate(self, step: int, policies: Iterable[str]) -> dict[str, Pending]:
        """Every policy's generation for ``step``, started at once (overlapping in time under Ray; one
        after another in-process), or taken from :meth:`prefetch`."""
        return {
            name: self._prefetched.pop((name, step)) if (name, step) in self._prefetched else self.start(name, step)
            for name in policies
        }

    # ------------------------------------------------------------------ rewards (step 2)
    def verify_groups(self, groups: list[RolloutGroup]) -> dict:
        """Set the groups' rewards (the run's reward, or the ``reward_groups`` the trainer was given)
        and mark each response's success: ``reward >= data.success_threshold``."""
        stats = (self.given_reward_groups or self.reward_groups)(groups)
        for g in groups:
            g.success = self.reward.successes(g.rewards)
        return stats

    def reward_groups(self, groups: list[RolloutGroup]) -> dict:
        """The default ``reward_groups``: the run's reward on every response (hard timeout per answer, a budget
        per call), setting each group's ``rewards``; returns the verification counts."""
        rows = [(g, i) for g in groups for i in range(g.n)]
        rewards, st = self.reward.score(
            [g.texts[i] for g, i in rows],
            [self.rows[g.prompt_id] for g, _ in rows],
            self.cfg.data.verify_timeout,
            self.cfg.data.verify_budget,
        )
        it = iter(rewards)
        for g in groups:
            g.rewards = [next(it) for _ in range(g.n)]
        return {"verify_timeouts": st.timeout, "verify_errors": st.error + st.crash, "verify_over_budget": st.budget}

    def verify(self, step: int, pending: Mapping[str, Pending]) -> tuple[Groups, dict[str, dict]]:
        """Wait for each policy's generation and verify it (dynamic sampling applied), replay the stored
        peers' groups (rewards verified again, not trusted from the records), and start each policy's
        metric line. time_generate is measured in the worker, where the generation ran (Table 5)."""
        groups: Groups = {}
        lines: dict[str, dict] = {name: {"step": step, "policy": name} for name in pending}
        for name, handle in pending.items():
            timer = PhaseTimer()
            with timer("wait_generation"):  # one step off: how long the step waits for its batch
                gs, gen_s = handle.get()
            if self.one_step is None:
                timer.seconds.pop("wait_generation")
            rollouts = len(gs) * self.cfg.n
            timer.add("generate", gen_s)
            with timer("reward"):
                vst = self.verify_groups(gs)
            rfilter = self.method.rollout_filter()
            if rfilter is not None:
                gs, extra, lines[name]["gen_batches"] = self._dynamic_sampling(
                    name, self.prompts_for_step(step, name), gs, step, vst, timer, rfilter
                )
                rollouts += extra
            lines[name].update(timer.metrics())
            lines[name].update(vst)
            lines[name]["rollouts"] = rollouts
            groups[name] = gs
        prompts = self.prompts_for_step(step)  # shared: a replayed peer answers every policy's prompts
        for name, (store, peer_policy) in self.peers.items():
            groups[name] = [
                RolloutGroup(g.prompt_id, g.prompt, name, g.texts, g.token_ids, g.gen_logprobs, g.finish_reasons)
                for g in store.replay(peer_policy, step, prompts)
            ]
            self.verify_groups(groups[name])
        return groups, lines

    def _dynamic_sampling(
        self, name, prompts, groups, step, vstats, timer: PhaseTimer, rfilter
    ) -> tuple[list, int, int]:
        """DAPO's dynamic sampling (``recipe/dapo``, ``filter_groups``): keep the groups with mixed
        rewards; while fewer than ``prompt_batch`` are kept, generate another batch of
        ``method.refill_factor`` x ``prompt_batch`` prompts (DAPO's ``gen_prompt_bsz``), up to
        ``method.max_num_gen_batches`` batches in the step (the first included; <= 0: no limit), past
        which the run stops with :class:`DynamicSamplingError`. Fresh prompts come from the training
        data not yet drawn in this step (then, reshuffled, from those not kept). ``timer`` accumulates the
        extra batches' ``generate`` (measured in the worker) and ``reward`` seconds.
        Returns ``(kept groups, extra rollouts, generation batches)``."""
        keep = [g for g in groups if rfilter.keep(g)]
        extra_rollouts = 0
        g = torch.Generator().manual_seed(
            derive_seed(self.cfg.seed, Purpose.REFILL_ORDER, step, self.names.index(name))
        )
        used = {self.rows.index(pid) for pid, _ in prompts}  # table indices: no per-row lookups over the table
        pool = [p for p in torch.randperm(len(self.data), generator=g).tolist() if p not in used]
        cap = rfilter.max_batches
        batches = 1
        while len(keep) < self.cfg.prompt_batch:
            if 0 < cap <= batches:
                raise DynamicSamplingError(
                    f"step {step}: policy {name!r} has {len(keep)} of {self.cfg.prompt_batch} prompts with mixed rewards after "
                    f"{batches} generation batches (method.max_num_gen_batches={cap}); the data may be too hard (or easy) "
                    f"for it. Set method.max_num_gen_batches=0 for no limit, and resume with --resume"
                )
            if not pool:  # every prompt drawn once in this step: another pass over those not kept (a prompt
                # is in a step's batch once), as DAPO's next epoch would
                kept = {self.rows.index(gr.prompt_id) for gr in keep}
                pool = [p for p in torch.randperm(len(self.data), generator=g).tolist() if p not in kept]
                if not pool:
                    raise DynamicSamplingError(
                        f"step {step}: policy {name!r} has {len(keep)} of {self.cfg.prompt_batch} prompts with mixed rewards, "
                        f"and every other prompt of data.train was drawn; prompt_batch is larger than what the data can fill"
                    )
            batches += 1
            size = rfilter.refill_factor * self.cfg.prompt_batch  # DAPO's gen_prompt_bsz
            take, pool = pool[:size], pool[size:]
            more_prompts = self.rows.draw(take, step)
            seed = derive_seed(self.cfg.seed, Purpose.REFILL_GENERATE, step, self.names.index(name), batches - 1)
            if self.one_step is not None:
                more, gen_s = self.one_step.refill(name, more_prompts, self.samplings[name], seed).get()
            else:
                more, gen_s = (
                    self.workers[name].generate(more_prompts, self.samplings[name], seed, self.cfg.rollout.lag).get()
                )
            timer.add("generate", gen_s)
            extra_rollouts += len(more) * self.cfg.n
            with timer("reward"):
                st = self.verify_groups(more)
            for k, v in st.items():
                vstats[k] = vstats.get(k, 0) + v
            keep.extend(gr for gr in more if rfilter.keep(gr))
        return keep[: self.cfg.prompt_batch], extra_rollouts, batches

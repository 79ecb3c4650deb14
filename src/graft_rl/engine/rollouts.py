"""A training step's rollout phase (paper Section 4, step 1-2; Section 6.2 for stored peers).

:class:`Rollouts` is a part of :class:`~graft_rl.engine.trainer.Trainer`: which prompts a step draws, every
policy's generation (started on its worker, so under Ray the policies sample at once), the reward
(the run's reward, or the scorer the trainer was given; success is ``reward >= data.success_threshold``), the method's rollout filter with its
refills (DAPO's dynamic sampling), and the replay of stored peers' groups. Every draw derives from
``(seed, step, policy)``, so a resumed run samples what an uninterrupted one would.
"""

from __future__ import annotations

import time

import torch

from graft_rl.data import check_answers, default_reward
from graft_rl.policy import RolloutGroup
from graft_rl.rewards import Reward, resolve_reward
from graft_rl.seeding import Purpose, derive_seed

__all__ = ["DynamicSamplingError", "Rollouts"]


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling found too few prompts with mixed rewards within ``method.max_num_gen_batches``."""


class Rollouts:
    """The rollout phase; mixed into the trainer, whose ``cfg``, ``data``, ``_rows``, ``reward``,
    ``names``, ``policies``, ``peers``, ``samplings``, ``method``, ``scorer``, ``_prefetched`` and
    ``workers`` (the policies' handles) and ``_result`` it uses."""

    # ------------------------------------------------------------------ data order
    def prompts_for_step(self, step: int) -> list[tuple[str, str]]:
        """The prompt batch of a step: epoch-wise shuffles seeded by (seed, epoch)."""
        epoch, pos = divmod(step - 1, self.steps_per_epoch)
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, Purpose.EPOCH_ORDER, epoch))
        perm = torch.randperm(len(self.data), generator=g)
        idx = perm[pos * self.cfg.prompt_batch : (pos + 1) * self.cfg.prompt_batch].tolist()
        return self._rows.draw(idx, step)  # the rows a reward gets for them are kept for the step

    # ------------------------------------------------------------------ rewards
    def _run_reward(self, cfg, given) -> Reward:
        """The run's reward: the one given to the trainer (recorded in the config), else ``data.reward``
        (``auto``: the training set's own verifier, math for a user's file). Checked before training: a
        built-in's references must be matchable; a user's function runs once on a reference answer, so an
        import error or a broken contract is one line now."""
        if given is not None:
            reward = resolve_reward(given, cfg.data.success_threshold)
            cfg.data.reward = reward.name if reward.payload is None else f"python:{reward.name}"
        else:
            spec = cfg.data.reward if cfg.data.reward != "auto" else default_reward(cfg.data.train, self.data[0])
            reward = resolve_reward(spec or "math", cfg.data.success_threshold)
        if reward.builtin:
            check_answers(self.data, reward.target, cfg.data.train)
        else:
            reward.check(self.data[0].row(), cfg.data.verify_timeout)
        return reward

    def _verify(self, groups: list[RolloutGroup]) -> dict:
        """Score the groups (the run's reward, or the scorer the trainer was given) and mark each
        response's success: ``reward >= data.success_threshold``."""
        stats = (self.scorer or self.score_groups)(groups)
        for g in groups:
            g.success = self.reward.successes(g.rewards)
        return stats

    def score_groups(self, groups: list[RolloutGroup]) -> dict:
        """The default scorer: the run's reward on every response (hard timeout per answer, a budget
        per call), setting each group's ``rewards``; returns the verification counts."""
        rows = [(g, i) for g in groups for i in range(g.n)]
        scores, st = self.reward.score(
            [g.texts[i] for g, i in rows],
            [self._rows[g.prompt_id] for g, _ in rows],
            self.cfg.data.verify_timeout,
            self.cfg.data.verify_budget,
        )
        it = iter(scores)
        for g in groups:
            g.rewards = [next(it) for _ in range(g.n)]
        return {"verify_timeouts": st.timeout, "verify_errors": st.error + st.crash, "verify_over_budget": st.budget}

    # ------------------------------------------------------------------ generation
    def _generation_seed(self, name: str, step: int) -> int:
        return derive_seed(self.cfg.seed, Purpose.GENERATE, step, self.names.index(name))

    def _start_generation(self, name: str, step: int):
        return self.workers[name].generate(
            self.prompts_for_step(step), self.samplings[name], self._generation_seed(name, step)
        )

    def _dynamic_sampling(self, name, prompts, groups, step, vstats, times, rfilter) -> tuple[list, list, int, int]:
        """DAPO's dynamic sampling (``recipe/dapo``, ``filter_groups``): keep the groups with mixed
        rewards; while fewer than ``prompt_batch`` are kept, generate another batch of
        ``method.refill_factor`` x ``prompt_batch`` prompts (DAPO's ``gen_prompt_bsz``), up to
        ``method.max_num_gen_batches`` batches in the step (the first included; <= 0: no limit), past
        which the run stops with :class:`DynamicSamplingError`. Fresh prompts come from the training
        data not yet drawn in this step (then, reshuffled, from those not kept). ``times`` accumulates the
        extra batches' ``time_generate`` (measured in the worker) and ``time_reward``.
        Returns ``(kept groups, their prompts, extra rollouts, generation batches)``."""
        keep = [g for g in groups if rfilter.keep(g)]
        extra_rollouts = 0
        g = torch.Generator().manual_seed(
            derive_seed(self.cfg.seed, Purpose.REFILL_ORDER, step, self.names.index(name))
        )
        used = {self._rows.index(pid) for pid, _ in prompts}  # table indices: no per-row lookups over the table
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
                kept = {self._rows.index(gr.prompt_id) for gr in keep}
                pool = [p for p in torch.randperm(len(self.data), generator=g).tolist() if p not in kept]
                if not pool:
                    raise DynamicSamplingError(
                        f"step {step}: policy {name!r} has {len(keep)} of {self.cfg.prompt_batch} prompts with mixed rewards, "
                        f"and every other prompt of data.train was drawn; prompt_batch is larger than what the data can fill"
                    )
            batches += 1
            size = rfilter.refill_factor * self.cfg.prompt_batch  # DAPO's gen_prompt_bsz
            take, pool = pool[:size], pool[size:]
            more_prompts = self._rows.draw(take, step)
            seed = derive_seed(self.cfg.seed, Purpose.REFILL_GENERATE, step, self.names.index(name), batches - 1)
            more, gen_s = self.workers[name].generate(more_prompts, self.samplings[name], seed).get()
            times["time_generate"] += gen_s
            extra_rollouts += len(more) * self.cfg.n
            t0 = time.perf_counter()
            st = self._verify(more)
            times["time_reward"] += time.perf_counter() - t0
            for k, v in st.items():
                vstats[k] = vstats.get(k, 0) + v
            keep.extend(gr for gr in more if rfilter.keep(gr))
        keep = keep[: self.cfg.prompt_batch]
        return keep, [(gr.prompt_id, gr.prompt) for gr in keep], extra_rollouts, batches

    # ------------------------------------------------------------------ the phase
    def rollouts(self, step: int) -> tuple[dict[str, list[RolloutGroup]], dict[str, dict]]:
        """A step's rollout phase: every policy's verified groups (dynamic sampling applied), stored
        peers' replayed groups, and each policy's metric line so far. (``graft probe`` runs this.)"""
        prompts = self.prompts_for_step(step)
        groups: dict[str, list[RolloutGroup]] = {}
        lines: dict[str, dict] = {name: {"step": step, "policy": name} for name in self.policies}
        # all policies generate at once (overlapping in time with Ray; one after another in-process);
        # time_generate is measured in the worker, where the generation runs (Table 5's compute).
        # Under Ray a policy's generation may have started already, when its last update finished
        pending = {
            name: self._prefetched.pop((name, step))
            if (name, step) in self._prefetched
            else self._start_generation(name, step)
            for name in self.policies
        }
        for name in self.policies:
            gs, gen_s = self._result(pending[name])
            rollouts = len(gs) * self.cfg.n
            t0 = time.perf_counter()
            vst = self._verify(gs)
            times = {"time_generate": gen_s, "time_reward": time.perf_counter() - t0}
            rfilter = self.method.rollout_filter()
            if rfilter is not None:
                gs, _, extra, lines[name]["gen_batches"] = self._dynamic_sampling(
                    name, prompts, gs, step, vst, times, rfilter
                )
                rollouts += extra
            lines[name].update(times)
            lines[name].update(vst)
            lines[name]["rollouts"] = rollouts
            groups[name] = gs
        for name, (store, peer_policy) in self.peers.items():
            replayed = store.replay(peer_policy, step, prompts)
            groups[name] = [
                RolloutGroup(g.prompt_id, g.prompt, name, g.texts, g.token_ids, g.gen_logprobs, g.finish_reasons)
                for g in replayed
            ]
            self._verify(groups[name])  # rewards are re-verified, not trusted from the records
        return groups, lines

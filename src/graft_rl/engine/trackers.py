"""Experiment trackers (docs/tasks.md, "Trackers"): TensorBoard, Weights & Biases, MLflow, trackio.

``report_to: [tensorboard, wandb, mlflow, trackio]`` sends what ``metrics.jsonl`` and
``validation.jsonl`` record -- every metric per policy and step (``A/loss``, ``B/val/score``,
``A/exchanged_in``, ...), keyed by step -- plus the resolved config at start and, every
``tracking.completions_every`` steps, a table of sampled completions: for a receiver, the peer
responses it grafted with their compatibility ``s``, weight, reward and advantage (own responses
fill the table where nothing was grafted). The JSONL files stay the record of truth: a tracker that is
not installed, or fails at any call, is one line and is off for the rest of the run; training goes on.

Offline by default where a service would be needed: W&B runs offline unless it has an API key (or
``WANDB_MODE``/``tracking.wandb_mode`` says otherwise), MLflow writes a file store in
``RUN_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI``/``tracking.mlflow_uri`` names a server (its metric
names write the ``/`` after the policy as ``.``: ``A/val.heldout.first``, as its file store needs). A resumed
run continues the same tracker run (ids kept in ``RUN_DIR/trackers.json``).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

__all__ = ["TRACKERS", "Trackers", "completion_rows", "mlflow_key"]

#: the names ``report_to`` accepts
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")

#: a response's text in a table is cut to this many characters
TEXT_CHARS = 2000


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _scalars(line: dict) -> dict[str, float]:
    """A metrics line as ``POLICY/KEY -> number`` (step and policy are the coordinates, not values)."""
    name = line.get("policy", "run")
    return {
        f"{name}/{k}": float(v)
        for k, v in line.items()
        if k not in ("step", "policy") and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    }


class _Tracker:
    name = ""

    def __init__(self, run_dir: Path, cfg: dict, tracking, state: dict):
        self.run_dir, self.cfg, self.tracking, self.state = run_dir, cfg, tracking, state

    def log(self, step: int, values: dict[str, float]) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def table(self, step: int, rows: list[dict]) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def finish(self) -> None:
        pass


class _TensorBoard(_Tracker):
    name = "tensorboard"

    def __init__(self, *a):
        super().__init__(*a)
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(self.run_dir / "tensorboard")
        self.w.add_text("config", "```yaml\n" + json.dumps(self.cfg, indent=1) + "\n```", 0)

    def log(self, step, values):
        for k, v in values.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def table(self, step, rows):
        cols = list(rows[0])
        md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += [
            "| " + " | ".join(str(r[c]).replace("\n", " ").replace("|", "\\|")[:300] for c in cols) + " |" for r in rows
        ]
        self.w.add_text("completions", "\n".join(md), step)

    def finish(self):
        self.w.close()


class _RunTracker(_Tracker):
    """A tracker whose ``run`` object logs a step's values and finishes (W&B's and trackio's API)."""

    run = None

    def log(self, step, values):
        self.run.log(values, step=step)

    def finish(self):
        self.run.finish()


def _table(table_cls, rows: list[dict]):
    cols = list(rows[0])
    return table_cls(columns=cols, data=[[r[c] for c in cols] for r in rows])


class _Wandb(_RunTracker):
    name = "wandb"

    def __init__(self, *a):
        super().__init__(*a)
        import wandb

        self.wandb = wandb
        mode = self.tracking.wandb_mode or os.environ.get("WANDB_MODE")
        if mode is None:
            has_key = bool(os.environ.get("WANDB_API_KEY")) or "api.wandb.ai" in _netrc()
            mode = "online" if has_key else "offline"
            if mode == "offline":
                print(
                    f"graft train: wandb has no API key; logging offline to {self.run_dir / 'wandb'} (wandb sync to upload)"
                )
        self.state.setdefault("wandb_id", uuid.uuid4().hex[:12])
        self.run = wandb.init(
            project=self.tracking.project,
            name=self.tracking.name or self.run_dir.name,
            dir=str(self.run_dir),
            id=self.state["wandb_id"],
            resume="allow",
            mode=mode,
            config=self.cfg,
            settings=wandb.Settings(console="off", silent=True),
        )

    def table(self, step, rows):
        self.run.log({"completions": _table(self.wandb.Table, rows)}, step=step)


def _netrc() -> str:
    try:
        return (Path.home() / ".netrc").read_text()
    except OSError:
        return ""


class _Mlflow(_Tracker):
    name = "mlflow"

    def __init__(self, *a):
        super().__init__(*a)
        from mlflow import MlflowClient

        uri = (
            self.tracking.mlflow_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or (self.run_dir / "mlruns").resolve().as_uri()
        )
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store, as the docs say
        self.client = MlflowClient(uri)
        exp = self.client.get_experiment_by_name(self.tracking.project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.tracking.project)
        if "mlflow_run_id" not in self.state:
            run = self.client.create_run(exp_id, run_name=self.tracking.name or self.run_dir.name)
            self.state["mlflow_run_id"] = run.info.run_id
            params = {k: str(v)[:500] for k, v in _flat(self.cfg).items()}
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.state["mlflow_run_id"], params=items[i : i + 100])
        self.run_id = self.state["mlflow_run_id"]
        self.uri = uri

    def log(self, step, values):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now, step) for k, v in values.items()])

    def table(self, step, rows):
        cols = list(rows[0])
        self.client.log_table(
            self.run_id, data={c: [r[c] for r in rows] for c in cols}, artifact_file=f"completions/step_{step:06d}.json"
        )

    def finish(self):
        self.client.set_terminated(self.run_id)


def mlflow_key(key: str) -> str:
    """``POLICY/val/set/family`` as ``POLICY/val.set.family``: MLflow's file store makes each ``/`` a
    folder, so ``val/set`` (a file) and ``val/set/family`` (inside a folder of that name) cannot both be."""
    policy, _, rest = key.partition("/")
    return f"{policy}/{rest.replace('/', '.')}" if rest else key


class _Trackio(_RunTracker):
    name = "trackio"

    def __init__(self, *a):
        super().__init__(*a)
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=self.tracking.project,
            name=self.tracking.name or self.run_dir.name,
            config=self.cfg,
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def table(self, step, rows):
        self.run.log({"completions": _table(self.trackio.Table, rows)}, step=step)


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow, "trackio": _Trackio}


class Trackers:
    """The run's trackers; every call is guarded: a failure is one line and turns that tracker off."""

    def __init__(self, names: list[str], run_dir: Path, cfg: dict, tracking, *, say=print):
        self.run_dir, self.tracking, self.say = Path(run_dir), tracking, say
        self.state_file = self.run_dir / "trackers.json"
        try:
            state = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        except (OSError, ValueError):
            state = {}
        self.live: list[_Tracker] = []
        self._tables: dict[int, list[dict]] = {}
        for name in dict.fromkeys(names):
            try:
                self.live.append(_CLASSES[name](self.run_dir, cfg, tracking, state))
            except ImportError as exc:
                self.say(
                    f"graft train: report_to {name}: {exc.name or name} is not installed "
                    f"(pip install {'mlflow-skinny' if name == 'mlflow' else name}); the run goes on without it"
                )
            except Exception as exc:
                self.say(f"graft train: report_to {name}: cannot start ({_why(exc)}); the run goes on without it")
        if state:
            from graft_rl.engine.rundir import write_text_atomic

            write_text_atomic(self.state_file, json.dumps(state, indent=1))

    def _each(self, what: str, call) -> None:
        for t in list(self.live):
            try:
                call(t)
            except Exception as exc:
                self.live.remove(t)
                self.say(
                    f"graft train: {t.name} failed to {what} ({_why(exc)}); it is off for the rest of the run (metrics.jsonl has everything)"
                )

    def log(self, lines: list[dict]) -> None:
        """Metric lines (``metrics.jsonl`` / ``validation.jsonl``): each step's values, policies side by
        side; then the step's completions table, if one was collected."""
        by_step: dict[int, dict[str, float]] = {}
        for line in lines:
            by_step.setdefault(int(line["step"]), {}).update(_scalars(line))
        for step, values in sorted(by_step.items()):
            self._each("log metrics", lambda t, s=step, v=values: t.log(s, v))
            rows = self._tables.pop(step, None)
            if rows:
                self._each("log the completions table", lambda t, s=step, r=rows: t.table(s, r))

    def wants_completions(self, step: int) -> bool:
        return bool(self.live) and step % self.tracking.completions_every == 0

    def add_completions(self, step: int, rows: list[dict]) -> None:
        """A receiver's rows for the step's table (logged with the step's metrics)."""
        if self.wants_completions(step):
            self._tables.setdefault(step, []).extend(rows)

    def finish(self) -> None:
        self._each("finish", lambda t: t.finish())
        self.live = []


def _why(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def completion_rows(step: int, receiver: str, rows, weights, exchange_rows: list[dict], limit: int) -> list[dict]:
    """A receiver's sampled completions for the table: its grafted peer responses first (with the
    compatibility ``s`` its gate saw and the weight it gave), then its own, at most ``limit``."""
    compat = iter(exchange_rows)
    peer: list = []
    own: list = []
    for r, w in zip(rows, weights, strict=True):
        s = next(compat).get("compat_token") if r.is_peer else None
        (peer if r.is_peer else own).append(
            {
                "step": step,
                "receiver": receiver,
                "source": r.source,
                "prompt": r.prompt[:TEXT_CHARS],
                "response": r.text[:TEXT_CHARS],
                "reward": r.reward,
                "success": bool(r.success),
                "advantage": r.advantage,
                "s": s,
                "weight": w,
            }
        )
    return (peer + own[:: max(1, len(own) // max(1, limit))])[:limit]

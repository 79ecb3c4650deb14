"""Trajectory records (docs/design.md, layer 4; docs/reliability.md): one Parquet file per step per policy, written atomically.

Layout: ``RUN_DIR/records/<policy>/step_<step:06d>.parquet``. One row per response: step,
prompt id, prompt text, policy, group position, response text, token ids, generation
log-probs, reward, finish reason, success (``reward >= data.success_threshold``). A file is written to a temporary name and renamed, so a
crash never leaves a half-written record. A later run replays a peer from these records
(Section 6.2) by prompt id, refusing a mismatched prompt text.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from graft_rl.policy import RolloutGroup

__all__ = ["RecordStore", "RecordError", "SCHEMA", "EXCHANGE_SCHEMA"]

SCHEMA = pa.schema(
    [
        ("step", pa.int32()),
        ("prompt_id", pa.string()),
        ("prompt", pa.string()),
        ("policy", pa.string()),
        ("group_index", pa.int32()),  # a group of n > 32,767 responses fits (int16 did not)
        ("response", pa.string()),
        ("token_ids", pa.list_(pa.int32())),
        ("gen_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float32()),
        ("finish_reason", pa.string()),
        ("success", pa.bool_()),  # reward >= data.success_threshold (null where not scored; absent in older records)
    ]
)


EXCHANGE_SCHEMA = pa.schema(
    [
        ("step", pa.int32()),
        ("receiver", pa.string()),
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("group_index", pa.int32()),  # a group of n > 32,767 responses fits (int16 did not)
        ("reward", pa.float32()),
        ("advantage", pa.float32()),
        ("weight", pa.float32()),
        ("compat_token", pa.float32()),
        ("compat_char", pa.float32()),
        ("included", pa.bool_()),
        ("auxiliary", pa.bool_()),
        # what moved: "response" (a peer response in the receiver's batch), "reward" (a peer's reward that
        # only shaped the receiver's baseline: XGRPO); null in records written before it
        ("moved", pa.string()),
    ]
)


def _read_table(path: Path):
    """A record file, or one line naming it when it is torn or not Parquet (a copy cut short, a disk error)."""
    try:
        return pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise RecordError(
            f"{path}: not a readable record file ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        ) from None


class RecordError(ValueError):
    """Records that cannot be replayed; the message names the run, policy, step or prompt."""


def _write_atomic(table: pa.Table, out: Path) -> Path:
    """Write a Parquet file under a temporary name and rename it: a crash never leaves half a file (docs/design.md, layer 4; docs/reliability.md)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".parquet.tmp{os.getpid()}")
    try:
        pq.write_table(table, tmp, compression="zstd")
    except OSError as exc:  # pyarrow's error on a full disk names no file: name the record
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror or str(exc).splitlines()[0], str(out)) from None
    os.replace(tmp, out)
    return out


class RecordStore:
    def __init__(self, run_dir: str | Path):
        self.root = Path(run_dir) / "records"

    def path(self, policy: str, step: int) -> Path:
        return self.root / policy / f"step_{step:06d}.parquet"

    def write(self, step: int, groups: list[RolloutGroup]) -> Path:
        """Write one policy's groups of one step (all groups must come from one policy)."""
        if not groups:
            raise RecordError(f"step {step}: no groups to record")
        policy = groups[0].policy
        cols: dict[str, list] = {name: [] for name in SCHEMA.names}
        for g in groups:
            if g.policy != policy:
                raise RecordError(f"step {step}: groups from {policy!r} and {g.policy!r} in one record file")
            rewards = g.rewards or [float("nan")] * g.n
            success = g.success if len(g.success) == g.n else [None] * g.n
            for i in range(g.n):
                cols["step"].append(step)
                cols["prompt_id"].append(g.prompt_id)
                cols["prompt"].append(g.prompt)
                cols["policy"].append(policy)
                cols["group_index"].append(i)
                cols["response"].append(g.texts[i])
                cols["token_ids"].append(g.token_ids[i])
                cols["gen_logprobs"].append(g.gen_logprobs[i])
                cols["reward"].append(rewards[i])
                cols["finish_reason"].append(g.finish_reasons[i])
                cols["success"].append(success[i])
        return _write_atomic(pa.table(cols, schema=SCHEMA), self.path(policy, step))

    def write_exchange(self, step: int, receiver: str, rows: list[dict]) -> Path | None:
        """What a receiver took from its peers at a step (``exchange/<receiver>/step_N.parquet``)."""
        if not rows:
            return None
        out = self.root.parent / "exchange" / receiver / f"step_{step:06d}.parquet"
        table = pa.Table.from_pylist([{"step": step, "receiver": receiver, **r} for r in rows], schema=EXCHANGE_SCHEMA)
        return _write_atomic(table, out)

    def read_exchange(self, receiver: str | None = None) -> list[dict]:
        root = self.root.parent / "exchange"
        if not root.is_dir():
            return []
        files = sorted((root / receiver).glob("step_*.parquet")) if receiver else sorted(root.glob("*/step_*.parquet"))
        rows: list[dict] = []
        for f in files:
            rows.extend(_read_table(f).to_pylist())
        return rows

    def steps(self, policy: str) -> list[int]:
        d = self.root / policy
        if not d.is_dir():
            return []
        return sorted(int(p.stem.split("_")[1]) for p in d.glob("step_*.parquet"))

    def policies(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    def read(self, policy: str, step: int) -> list[RolloutGroup]:
        """Groups of one policy at one step, in recorded prompt order."""
        path = self.path(policy, step)
        if not path.is_file():
            have = self.policies()
            if policy not in have:
                raise RecordError(
                    f"{self.root.parent}: no records for policy {policy!r} (have: {', '.join(have) or 'none'})"
                )
            raise RecordError(f"{self.root.parent}: policy {policy!r} has no record for step {step}")
        rows = _read_table(path).to_pylist()
        groups: dict[str, dict] = {}
        for r in rows:
            g = groups.setdefault(
                r["prompt_id"],
                {"prompt": r["prompt"], "texts": [], "ids": [], "lps": [], "fin": [], "rew": [], "ok": []},
            )
            g["texts"].append(r["response"])
            g["ids"].append(r["token_ids"])
            g["lps"].append(r["gen_logprobs"])
            g["fin"].append(r["finish_reason"])
            g["rew"].append(r["reward"])
            g["ok"].append(r.get("success"))
        return [
            RolloutGroup(
                pid,
                g["prompt"],
                policy,
                g["texts"],
                g["ids"],
                g["lps"],
                g["fin"],
                g["rew"],
                g["ok"] if None not in g["ok"] else [],
            )
            for pid, g in groups.items()
        ]

    def truncate_after(self, step: int) -> int:
        """Delete records of steps after ``step`` (resume rewrites them); returns how many."""
        removed = 0
        dirs = [d for root in (self.root, self.root.parent / "exchange") if root.is_dir() for d in root.iterdir()]
        for pol in dirs:
            for f in pol.glob("step_*.parquet*"):
                name = f.name.split(".")[0]
                if ".tmp" in f.name or int(name.split("_")[1]) > step:
                    f.unlink()
                    removed += 1
        return removed

    def replay(self, policy: str, step: int, prompts: list[tuple[str, str]]) -> list[RolloutGroup]:
        """The recorded groups for exactly these ``(prompt_id, prompt)`` pairs, in this order."""
        recorded = {g.prompt_id: g for g in self.read(policy, step)}
        out = []
        for pid, text in prompts:
            if pid not in recorded:
                raise RecordError(f"{self.root.parent}: step {step} of {policy!r} has no record of prompt {pid!r}")
            g = recorded[pid]
            if g.prompt != text:
                raise RecordError(
                    f"{self.root.parent}: step {step}, prompt {pid!r}: recorded prompt text differs from this run's"
                )
            out.append(g)
        return out

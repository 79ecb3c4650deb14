"""report_to: the real trackers in their local modes (W&B offline, an MLflow file store, TensorBoard event
files) get the config, every metric per policy and step, validation, and a table of grafted completions;
one that is missing or fails is one line and the run goes on; a resumed run continues the same tracker run."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from graft_rl.engine.trainer import Trainer

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")


def _cfg(make_cfg, tiny_data, report_to, steps=2, **kw):
    return make_cfg(
        {"name": "graft"},
        steps=steps,
        report_to=report_to,
        tracking={"completions_every": 1, "completions_rows": 4, "wandb_mode": "offline"},
        validation={"data": [str(tiny_data)], "every": 1, "samples": 2, "max_new_tokens": 4, "limit": 2},
        **kw,
    )


def _mlflow_run(run_dir):
    client = mlflow.MlflowClient((run_dir / "mlruns").resolve().as_uri())
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow_run_id"]
    return client, run_id


def wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline W&B run, read from its ``.wandb`` file (a LevelDB-style log of
    protobuf records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, buf, rows = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == 0 and length == 0:
            break
    return rows


@pytest.mark.slow  # two trackers' packages in one run
def test_wandb_offline_and_an_mlflow_file_store_get_everything(make_cfg, tiny_data, fake_rewards, capsys):
    cfg = _cfg(make_cfg, tiny_data, ["wandb", "mlflow"])
    tr = Trainer(cfg, show_progress=False)
    try:
        lines = tr.run()
    finally:
        tr.close()
    run_dir = tr.run_dir
    truth = {
        (ln["step"], ln["policy"]): ln for ln in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }
    assert len(lines) == 4 and len(truth) == 4

    client, run_id = _mlflow_run(run_dir)
    run = client.get_run(run_id)
    assert run.data.params["method.name"] == "graft" and run.data.params["n"] == "4"
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "A/loss")}
    assert loss == pytest.approx({s: truth[(s, "A")]["loss"] for s in (1, 2)})
    assert [m.step for m in client.get_metric_history(run_id, "B/val.score")] == [0, 1, 2]
    assert {m.step for m in client.get_metric_history(run_id, "A/exchanged_in")} == {1, 2}
    table = json.loads(
        (run_dir / "mlruns").joinpath(*_artifact_parts(run)).joinpath("completions/step_000001.json").read_text()
    )
    cols = table["columns"]
    rows = [dict(zip(cols, r, strict=True)) for r in table["data"]]
    assert {"receiver", "source", "prompt", "response", "s", "weight", "reward", "advantage"} <= set(cols)
    grafted = [r for r in rows if r["source"] != r["receiver"]]
    assert grafted and all(r["s"] is not None and 0.0 <= r["weight"] <= 1.0 for r in grafted)

    history = wandb_history(run_dir)
    by_step = {}
    for h in history:
        by_step.setdefault(h["_step"], {}).update(h)
    assert by_step[2]["B/loss"] == pytest.approx(truth[(2, "B")]["loss"])
    assert by_step[1]["completions/_type"] == "table-file" and by_step[1]["completions/nrows"] == len(rows)
    assert "B/val/score" in by_step[0]
    out = capsys.readouterr().out
    assert "failed" not in out


def _artifact_parts(run):
    uri = run.info.artifact_uri
    return uri.split("/mlruns/", 1)[1].split("/")


def test_a_missing_or_failing_tracker_is_one_line_and_the_run_goes_on(
    make_cfg, tiny_data, fake_rewards, monkeypatch, capsys
):
    from graft_rl.engine import trackers

    monkeypatch.setitem(sys.modules, "trackio", None)  # not installed

    def broken(self, step, values):
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(trackers._Mlflow, "log", broken)
    tr = Trainer(_cfg(make_cfg, tiny_data, ["trackio", "mlflow"]), show_progress=False)
    try:
        lines = tr.run()
    finally:
        tr.close()
    out = [ln for ln in capsys.readouterr().out.splitlines() if "report_to" in ln or "failed" in ln]
    assert out == [
        "graft train: report_to trackio: trackio is not installed (pip install trackio); the run goes on without it",
        "graft train: mlflow failed to log metrics (ConnectionError: tracking server went away); it is off for the "
        "rest of the run (metrics.jsonl has everything)",
    ]
    assert len(lines) == 4 and len((tr.run_dir / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_resumed_run_continues_the_same_tracker_runs(make_cfg, tiny_data, fake_rewards):
    cfg = _cfg(make_cfg, tiny_data, ["mlflow"], steps=3)
    tr = Trainer(cfg, show_progress=False)
    try:
        tr.run(max_steps=1)
    finally:
        tr.close()
    first = json.loads((tr.run_dir / "trackers.json").read_text())
    tr = Trainer(cfg, resume=True, show_progress=False)
    try:
        tr.run()
    finally:
        tr.close()
    assert json.loads((tr.run_dir / "trackers.json").read_text()) == first
    client, run_id = _mlflow_run(tr.run_dir)
    assert sorted({m.step for m in client.get_metric_history(run_id, "A/loss")}) == [1, 2, 3]
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1


def test_tensorboard_gets_the_same_scalars(make_cfg, tiny_data, fake_rewards):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tr = Trainer(_cfg(make_cfg, tiny_data, ["tensorboard"]), show_progress=False)
    try:
        tr.run()
    finally:
        tr.close()
    acc = EventAccumulator(str(tr.run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("A/loss")] == [1, 2] and "completions" in "".join(acc.Tags()["tensors"])


@pytest.mark.slow  # a fresh process importing trackio: ~25 s
def test_trackio_writes_its_local_store(make_cfg, tiny_data, tmp_path):
    """trackio reads its folder (TRACKIO_DIR) once, at import: a fresh process with its own folder."""
    pytest.importorskip("trackio")
    import subprocess
    import textwrap

    from graft_rl.engine.config import to_dict

    (tmp_path / "parity.py").write_text(
        "def parity(responses, problems):\n    return [float(len(r) % 2) for r in responses]\n"
    )
    cfg = _cfg(
        make_cfg, tiny_data, ["trackio"], data={"train": str(tiny_data), "reward": f"{tmp_path / 'parity.py'}:parity"}
    )
    script = textwrap.dedent(
        f"""
        import json
        from graft_rl import Trainer, load_config
        tr = Trainer(load_config(json.loads({json.dumps(json.dumps(to_dict(cfg)))})), show_progress=False)
        try:
            tr.run()
        finally:
            tr.close()
        from trackio.sqlite_storage import SQLiteStorage
        logs = SQLiteStorage.get_logs("graft-rl", "run")
        print("LOSS", sorted((r["step"], round(r["A/loss"], 6)) for r in logs if "A/loss" in r))
        """
    )
    env = {**__import__("os").environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    truth = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    want = sorted((ln["step"], round(ln["loss"], 6)) for ln in truth if ln["policy"] == "A")
    assert len(want) == 2 and f"LOSS {want}" in res.stdout

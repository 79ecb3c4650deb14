"""Two Ray nodes on this machine (``ray.cluster_utils.Cluster``: two raylets of 2 CPUs, custom
resources ``node_a`` / ``node_b``), as the README's two-node recipe runs: A pinned to ``node_a``, B
(``world_size: 2``) to ``node_b``, the advantage from a file plugin, one step off with both policies'
generators pinned to ``node_a`` (``rollout.generators.resources``: B's weights cross nodes). Training
places every actor where it was pinned, resumes, and ``graft eval RUN`` / ``graft analyze`` of the run finish (``graft eval``
used to wait for ever: its replicas did not fit the node A is pinned to)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from runs import quick_eval_args

from graft_rl.commands.cli import main

from .test_plugins import PARTS, REWARD, forget_file_plugins

pytestmark = pytest.mark.slow


@pytest.fixture
def two_nodes():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}})
    # Cluster writes /tmp/ray/ray_current_cluster, which a plain ray.init() elsewhere on this machine
    # would join, dead, if this process were killed before shutdown; everything here names the address
    from ray._common.utils import reset_ray_address

    reset_ray_address()
    try:
        cluster.add_node(num_cpus=2, resources={"node_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _placed() -> dict[tuple[str, int | None], str]:
    """(policy, rank) -> the custom resource of the node each live actor runs on."""
    import ray

    from graft_rl.engine import distributed

    node_of = {
        n["NodeID"]: next(k for k in ("node_a", "node_b") if k in n["Resources"]) for n in ray.nodes() if n["Alive"]
    }
    # actors of this cluster only: earlier tests in this process leave records of actors on other nodes
    where = {aid: w[0] for aid, w in distributed._WHERE.items() if w[0] in node_of}
    return {who: node_of[where[aid]] for aid, who in distributed._NAMES.items() if aid in where}


@pytest.fixture
def forget_plugins():
    """What the test's file plugin registers leaves with the test (other tests list the registries)."""
    yield
    forget_file_plugins()


def test_two_nodes_train_resume_eval_and_analyze(two_nodes, tiny_pair, tmp_path, monkeypatch, forget_plugins):
    from graft_rl.engine.config import load_config
    from graft_rl.engine.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "parts.py").write_text(PARTS)
    (tmp_path / "reward.py").write_text(REWARD)
    rows = [{"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": str(2 * i)} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "steps": 2,
        "prompt_batch": 4,
        "minibatch": 4,
        "n": 4,
        "max_new_tokens": 6,
        "checkpoint_every": 1,
        "execution": "ray",
        "data": {"train": "train.jsonl", "reward": "reward.py:odd", "success_threshold": 1.0},
        "method": {"name": "graft", "advantage": "parts.py:sign", "balance": False},
        "rollout": {"mode": "one_step_off", "generators": {"num_cpus": 0.5, "resources": {"node_a": 0.25}}},
        "ray": {
            "address": two_nodes.address,
            "num_cpus": 1,
            "torch_threads": 1,
            "placement_timeout": 60,
            "resources": {"A": {"resources": {"node_a": 0.5}}, "B": {"resources": {"node_b": 1}}},
        },
        "policies": [
            {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3},
            {"name": "B", "model": str(tiny_pair[1]), "lr": 1e-3, "world_size": 2},
        ],
    }
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    tr = Trainer(load_config(tmp_path / "two.yaml"), show_progress=False)
    try:
        assert _placed() == {
            ("A", None): "node_a",
            ("B", 0): "node_b",
            ("B", 1): "node_b",
            ("A generator", 0): "node_a",
            ("B generator", 0): "node_a",
        }
        tr.run()
    finally:
        tr.close()
    assert main(["train", "--resume", "run", "--no-progress", "steps=3"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 1, 2, 2, 3, 3]

    # graft eval RUN: 3 replicas per policy (the run's 3 devices) on the nodes each is pinned to; in its
    # own process, with a time limit, so a wait for ever is a failure here
    args = [sys.executable, "-m", "graft_rl.commands.cli", *quick_eval_args("run", "train.jsonl")]
    res = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    evaluated = json.loads((tmp_path / "run" / "eval" / "eval.json").read_text())["policies"]
    assert set(evaluated) == {"A", "B"} and all(p["replicas"] == 3 for p in evaluated.values())
    assert main(["analyze", "run"]) == 0


def test_a_resource_no_node_has_free_ends_in_one_line(two_nodes, tiny_pair, tmp_path, capsys):
    """A one-rank actor that cannot be placed (node_a's 2 CPUs, 3 asked) ends within placement_timeout."""
    (tmp_path / "train.jsonl").write_text(json.dumps({"id": "q", "problem": "1+1=?", "answer": "2"}) + "\n")
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "steps": 1,
        "prompt_batch": 1,
        "execution": "ray",
        "data": {"train": str(tmp_path / "train.jsonl")},
        "ray": {"address": two_nodes.address, "num_cpus": 2, "placement_timeout": 5},
        "policies": [{"name": "A", "model": str(tiny_pair[0])}, {"name": "B", "model": str(tiny_pair[1])}],
    }
    (tmp_path / "busy.yaml").write_text(yaml.safe_dump(cfg))
    import ray

    @ray.remote(num_cpus=2, resources={"node_a": 1})
    class Holder:
        def ping(self):
            return 1

    holder = Holder.remote()  # node_a's CPUs are taken: A and B fit only one node now
    ray.get(holder.ping.remote())
    try:
        assert main(["train", str(tmp_path / "busy.yaml"), "--no-progress"]) == 2
    finally:
        ray.kill(holder)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "within 5 s (ray.placement_timeout)" in err[0] and "short:" in err[0], err

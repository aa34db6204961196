"""Cluster-shaped run on one machine, as on KubeRay: a head node that offers no engine resource and a second Ray node
that offers one (`specdec_engine`, and a declared GPU), started with Ray's `ray.cluster_utils.Cluster`. A study runs to a decision; Ray's node
ids recorded per trial show the trial process on the head and the engine replica on the engine node, so everything
the replica must do where the engine runs (node checks, preflight, the engine itself) ran away from the trial."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
REPO = Path(__file__).resolve().parents[2]
ENGINE_RESOURCE = "specdec_engine"


# Ray's own multi-node-on-one-host helper, in a process of its own: SIGTERM shuts down exactly these two nodes
# (`ray stop` would kill every Ray on the machine, including other tests' and developers').
CLUSTER = """
import signal, sys, time
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
cluster.add_node(num_cpus=0, num_gpus=1, resources={%r: 1})
cluster.wait_for_nodes()
print(cluster.address, flush=True)
signal.signal(signal.SIGTERM, lambda *_: (cluster.shutdown(), sys.exit(0)))
while True:
    time.sleep(1)
""" % ENGINE_RESOURCE


@pytest.fixture(scope="module")
def two_node_cluster():
    # Head: CPUs for trial processes, no engine resource. Engine node: the engine resource, no CPUs (so no trial
    # process can land there and no replica can land on the head) and one declared GPU, which lets an SGLang replica
    # be placed there and run its checks on that node (this machine has no real GPU).
    env = dict(os.environ)
    holder = subprocess.Popen([sys.executable, "-c", CLUSTER], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout is not None
    try:
        started, _, _ = select.select([holder.stdout], [], [], 300)  # a start that hangs fails instead of blocking
        address = holder.stdout.readline().strip() if started else ""
        assert address, "the two-node cluster did not start (no address within 300 s, or it exited)"
        yield address, env
    finally:
        holder.terminate()
        try:
            holder.wait(timeout=120)
        except subprocess.TimeoutExpired:
            holder.kill()


def ray_nodes(address: str, env: dict) -> dict[str, dict]:
    """{node id: resources} as Ray reports them (a separate driver: this test process may hold its own Ray)."""
    code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
            "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))" % address)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_trial_and_replica_run_on_different_nodes_and_the_study_decides(tmp_path, two_node_cluster):
    address, env = two_node_cluster
    space = tmp_path / "space.yaml"
    space.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokens: {type: int, low: 3, high: 3}\n")
    study_file = tmp_path / "study.yaml"
    # replica_cpus 0: the engine node offers no CPUs to Ray (so no trial process lands there); the CPU engine uses
    # the host's cores whatever Ray accounts.
    study_file.write_text(
        f"name: cluster\nsearch_space: {space}\nray: {{address: '{address}'}}\nbudget: {{max_trials: 2}}\n"
        "workload: {warmup_prompts: 2, measure_prompts: 2, max_new_tokens: 12, remeasure: 0}\n"
        f"engine: {{start_timeout_s: 300, replica_cpus: 0, replica_resources: {{{ENGINE_RESOURCE}: 1}}}}\n"
        # Placement is what this test checks: the search's trials show it; the promotion's re-runs (6 more fresh
        # replicas on the same path) would add minutes and no assertion.
        "promotion: {finalists: 0}\n")
    done = subprocess.run([sys.executable, "-m", "pipeline.tune", "--study", str(study_file), "--output",
                           str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "decision:" in done.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("cluster")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`specdec.kind` = 'trial'")
    assert len(runs) == 2 and all(r.data.tags["outcome"] == "COMPLETE" for r in runs)
    nodes = ray_nodes(address, env)
    for run in runs:
        trial_node, replica_node = run.data.tags["trial_node_id"], run.data.tags["replica_node_id"]
        assert trial_node and replica_node and trial_node != replica_node
        assert nodes[replica_node].get(ENGINE_RESOURCE) == 1  # the engine ran on the engine node
        assert ENGINE_RESOURCE not in nodes[trial_node]


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4, "vocab_size": 1000,
              "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}


def sglang_study(tmp_path, address, env, name, extra=""):
    from serve.engines.sglang.engine import installed_version

    if installed_version() is None:
        pytest.skip("sglang is not installed in this venv: bash infra/install-sglang-parser.sh")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    study_file = tmp_path / "study.yaml"
    study_file.write_text(
        f"name: {name}\nsearch_space: ngram.yaml\nray: {{address: '{address}'}}\nbudget: {{max_trials: 1}}\n"
        f"model: {{target: '{model}'}}\n"
        # SGLang resolves the argv in the replica: seconds on an idle box, minutes on a loaded 2-core one.
        f"engine: {{kind: sglang, device: cuda, start_timeout_s: 600, replica_cpus: 0, "
        f"replica_resources: {{{ENGINE_RESOURCE}: 1}}{extra}}}\n")
    done = subprocess.run([sys.executable, "-m", "pipeline.tune", "--study", str(study_file), "--output",
                           str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # no baseline could be measured

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`specdec.kind` = 'trial'")
    return run.data.tags


def test_sglang_checks_run_in_the_replica_on_the_engine_node(tmp_path, two_node_cluster):
    # Defect 3: SGLang's own parser and the node checks run where the engine would run (the replica on the engine
    # node), not in the trial process on the head. The parser accepts the flags there; the node has no NVIDIA driver.
    address, env = two_node_cluster
    tags = sglang_study(tmp_path, address, env, "cluster-sglang")
    assert tags["outcome"] == "LAUNCH_FAILED", tags["reason"]
    assert "no NVIDIA driver" in tags["reason"] and "engine.kind: cpu" in tags["reason"]
    assert "preflight ok" in tags["reason"]


def test_flags_the_installed_sglang_refuses_make_an_invalid_trial(tmp_path, two_node_cluster):
    # SGLang's parser, in the replica, refuses the argv: INVALID with SGLang's own words, not LAUNCH_FAILED.
    address, env = two_node_cluster
    tags = sglang_study(tmp_path, address, env, "cluster-sglang-bad",
                        extra=", extra_flags: [--no-such-flag-in-sglang, '1']")
    assert tags["outcome"] == "INVALID", tags["reason"]
    assert "SGLang rejected the flags at parse" in tags["reason"] and "unrecognized arguments" in tags["reason"]

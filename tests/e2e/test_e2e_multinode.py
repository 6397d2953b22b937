"""A two-node Ray cluster (`ray.cluster_utils.Cluster`) over S3 (`moto_server`): SFT and an RL round, end to end.

The head node runs the pipeline's tasks; every actor (DeepSpeed ranks, the reference scorer, the vLLM
engine) asks for a custom resource only the second node has, and no CPU slots, of which that node
has none, so no task can land there. Each node has a cache directory of its own (ALIGNFLOW_CACHE_DIR,
set in the environment each node starts with). Both nodes share this machine's disk, so a path handed
from a task to an actor would still resolve here: the test checks instead where the copies were made.
The actors' node must hold verified copies of every model they loaded; the tasks' node must never
have downloaded a weight file; and the stages must be committed with the files the actors uploaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

WORKER = "alignflow_test_worker_node"
PINNED = {"num_cpus": 0, "resources": {WORKER: 1}}
ROUND = {"algorithm": "grpo", "steps": 2, "prompts_per_step": 8, "reward": {"source": "rule"},
         "kl": {"coef": 0.05}, "generation": {"num_samples": 2, "max_new_tokens": 8, "placement": PINNED},
         "actor": {"placement": PINNED}, "scorer_placement": PINNED}


@pytest.fixture(scope="module")
def two_nodes(moto_s3, tmp_path_factory):
    """(cluster address, head cache, worker cache). The nodes inherit this process's environment when
    they start (the S3 credentials moto_s3 set, and each its own cache directory)."""
    from alignflow.cluster import START_TIMED_OUT, _children, _end_rays_since, loopback_only

    loopback_only()  # both nodes on 127.0.0.1
    from ray.cluster_utils import Cluster

    base = tmp_path_factory.mktemp("two_nodes")
    head_cache, worker_cache = base / "head-cache", base / "worker-cache"
    saved = os.environ.get("ALIGNFLOW_CACHE_DIR")

    def start() -> Cluster:
        cluster, before = None, _children()
        try:
            os.environ["ALIGNFLOW_CACHE_DIR"] = str(head_cache)
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 4, "node_ip_address": "127.0.0.1", "include_dashboard": False,
                "object_store_memory": 256 * 2**20})
            os.environ["ALIGNFLOW_CACHE_DIR"] = str(worker_cache)
            cluster.add_node(num_cpus=0, resources={WORKER: 8}, node_ip_address="127.0.0.1",
                             object_store_memory=256 * 2**20, wait=False)
            cluster.wait_for_nodes(timeout=300)
            return cluster
        except BaseException:
            if cluster is not None:
                cluster.shutdown()
            _end_rays_since(before)  # what a node that did not start left (a head's, before Cluster returned)
            raise
        finally:
            os.environ.pop("ALIGNFLOW_CACHE_DIR", None)
            if saved is not None:
                os.environ["ALIGNFLOW_CACHE_DIR"] = saved

    # A node's raylet has a fixed 30 s to register (ray/_private/node.py), which a busy CI machine can miss:
    # started again, as alignflow.cluster.init_ray starts a local Ray again.
    for attempt in (1, 2, 3):
        try:
            cluster = start()
            break
        except Exception as err:
            if attempt == 3 or not (START_TIMED_OUT in str(err) or isinstance(err, TimeoutError)):
                raise
    try:
        yield cluster.address, head_cache, worker_cache
    finally:
        cluster.shutdown()


def _stages(stdout: str) -> dict[str, tuple[str, str]]:
    lines = stdout.splitlines()
    assert "stages:" in lines, stdout[-3000:]
    stages = {}
    for line in lines[lines.index("stages:") + 1:]:
        if not line.startswith("  "):
            break
        name, state, uri = line.split()
        stages[name] = (state, uri)
    return stages


def _cache_copy(cache: Path, uri: str) -> Path:
    return cache / hashlib.sha256(uri.encode()).hexdigest()[:24]  # Storage.fetch's key, no files skipped


def test_sft_and_a_round_with_every_actor_on_another_node(two_nodes, moto_s3, cli_env, alignflow_cli, tmp_path):
    address, head_cache, worker_cache = two_nodes
    root = f"s3://{moto_s3.bucket}/multinode"
    args = ["run",
            "data.synthetic.num_sft=64", "data.synthetic.num_preference=32", "data.synthetic.num_eval=16",
            "data.synthetic.num_rl_prompts=16", "sft.epochs=1", "sft.max_steps=4", "sft.batch_size=16",
            f"sft.placement={json.dumps(PINNED)}", "reward_model=null", "evaluation=null",
            f"rounds={json.dumps([ROUND])}", f"infra.ray_address={address}",
            f"infra.storage.root={root}", f"infra.storage.endpoint_url={moto_s3.endpoint_url}",
            f"infra.storage.cache_dir={tmp_path / 'config-cache'}",
            f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    # The CLI runs on the head node, with its cache.
    result = alignflow_cli(args, env=cli_env(ALIGNFLOW_CACHE_DIR=str(head_cache)), cwd=tmp_path / "cwd")
    assert result.returncode == 0, result.describe()
    stages = _stages(result.stdout)
    assert {"base_model", "sft", "round_1"} <= set(stages), stages

    fs = moto_s3.fs()
    for name in ("sft", "round_1"):  # committed, with the weights rank 0 uploaded from its node
        manifest = json.loads(fs.cat(f"{stages[name][1]}/manifest.json"))
        assert "model.safetensors" in manifest["files"], (name, sorted(manifest["files"]))
        assert fs.size(f"{stages[name][1]}/model.safetensors") == manifest["files"]["model.safetensors"]["size"]

    # The actors fetched what they loaded on their node: SFT's ranks the base model, the round's
    # actor, reference and engine the SFT policy; every file verified against the manifest.
    for name in ("base_model", "sft"):
        uri = stages[name][1]
        copy = _cache_copy(worker_cache, uri)
        manifest = json.loads(fs.cat(f"{uri}/manifest.json"))
        assert copy.is_dir(), f"{name} was not fetched on the actors' node ({sorted(os.listdir(worker_cache))})"
        for rel, info in manifest["files"].items():
            assert hashlib.sha256((copy / rel).read_bytes()).hexdigest() == info["sha256"], (name, rel)

    # The tasks' node read tokenizers and configs only; no weights were ever downloaded there.
    assert head_cache.is_dir(), "the tasks fetched nothing on their node"
    assert not [p for p in head_cache.rglob("*.safetensors")], sorted(head_cache.rglob("*"))
    # Every node set its own cache: no artifact was copied into the configured cache_dir.
    config_cache = tmp_path / "config-cache"
    assert not config_cache.exists() or not [p for p in config_cache.iterdir() if p.is_dir()]

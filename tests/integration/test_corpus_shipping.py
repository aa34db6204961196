"""Issue #18 (cluster defect): a corpus shipped in the replica's config is written where the engine runs and loaded by
the real CPU engine (smallest model), started as a Serve replica starts it. The folder holds no corpus file before the
replica starts, as on an engine node that shares no filesystem with the trial's driver; the config is the served
form (the corpus named by its file name only), as production's replicas receive it."""

from __future__ import annotations

import httpx
import pytest

from serve.engines.base import ReplicaConfig
from serve.replica.deployment import EngineProcess
from serve.spec import NgramSpec

pytestmark = pytest.mark.integration
DOCS = ("Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.", "one, two, three, four, five, six")


def test_a_shipped_corpus_is_written_on_the_engines_node_and_loaded(smol_dir, tmp_path):
    node = tmp_path / "engine-node"
    spec = NgramSpec(num_draft_tokens=8, max_bfs_breadth=2, external_corpus="warmup-0123abcd.jsonl",
                     external_sam_budget=4)
    sent = ReplicaConfig(model="smollm2-135m", threads=1, spec=spec, corpus_documents=DOCS, log_dir=str(node))
    received = ReplicaConfig.model_validate(sent.to_replica())  # what Serve hands the replica
    assert not (node / "corpora").exists()
    process = EngineProcess(received)
    try:
        process.wait_ready()
        local = node / "corpora" / "warmup-0123abcd.jsonl"
        assert local.is_file()
        assert process.argv[process.argv.index("--speculative-ngram-external-corpus-path") + 1] == str(local)
        loaded = httpx.get(f"{process.url}/list_external_corpora", timeout=30).json()["corpus_token_counts"]
        # Both documents' tokens and one separator between them: the engine read the file the replica wrote.
        assert list(loaded) == [str(local)] and loaded[str(local)] > 2 * len(DOCS)
    finally:
        process.stop()

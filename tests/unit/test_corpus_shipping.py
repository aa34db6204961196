"""Issue #18 (cluster defect): an NGRAM external corpus travels with the replica, not as a path on the trial's node.

The driver resolves the corpus (the warm-up split written, a user file read) and ships its documents in the
`ReplicaConfig`; the replica writes them on its own node and points the engine's corpus flag there; the served
config of a winner carries them too. Real files, real configs, the engines' real command-line renderers."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.config import TrialConfig, load_study
from pipeline.trial.corpus import SHARED_PREFIX, WARMUP_CORPUS, corpus_for_trial, ship_corpus, write_corpus
from pipeline.measure.load import LoadRequest
from pipeline.trial.engine_pass import shipped_replica_config
from serve.engines import engine_for
from serve.engines.base import MAX_SHIPPED_CORPUS_BYTES, REDACTED, ReplicaConfig
from serve.engines.spec_flags import effective_diff
from serve.engines.sglang.engine import sglang_args
from serve.production.app import replica_config as production_replica
from serve.replica.deployment import write_shipped_corpus
from serve.serving import COMMAND_FILE, Provenance, deploy_files, engine_argv, serving_config, spec_params
from serve.spec import NgramSpec

FLAG = "--speculative-ngram-external-corpus-path"
WARM = [LoadRequest(0, "the cat sat on the mat", 4), LoadRequest(1, "a dog ran — far", 4),
        LoadRequest(0, "the cat sat on the mat", 4)]  # a cycled split repeats prompts: the corpus does not


def corpus_trial(corpus: str = WARMUP_CORPUS) -> TrialConfig:
    return TrialConfig(spec=NgramSpec(num_draft_tokens=8, external_corpus=corpus, external_sam_budget=3))


def flag_value(argv: list[str]) -> str:
    return argv[argv.index(FLAG) + 1]


@pytest.fixture()
def study(tmp_path):
    return load_study(None, {"model.target": str(tmp_path / "model"), "engine.env": {"HF_TOKEN": "s3cret"}})


def test_the_replica_config_carries_the_documents_to_the_replica_and_secrets_stay_redacted(study, tmp_path):
    log_dir = tmp_path / "trials" / "0"
    config, corpus = shipped_replica_config(study, corpus_trial(), WARM, log_dir)
    assert corpus is not None and config.corpus_documents == ("the cat sat on the mat", "a dog ran — far")
    assert isinstance(config.spec, NgramSpec)
    assert config.spec.external_corpus == corpus.path == str(log_dir / "corpora" / Path(corpus.path).name)
    # The form Serve hands the replica carries the documents (and the env values, as before); logged forms carry the
    # documents but never the env values.
    received = ReplicaConfig.model_validate(json.loads(json.dumps(config.to_replica())))
    assert received == config and received.env == {"HF_TOKEN": "s3cret"}
    assert config.model_dump(mode="json")["env"] == {"HF_TOKEN": REDACTED}
    assert config.model_dump(mode="json")["corpus_documents"] == list(config.corpus_documents)


def test_on_another_node_the_replica_writes_the_corpus_and_points_the_flag_at_it(study, tmp_path):
    log_dir = tmp_path / "trials" / "1"
    config, corpus = shipped_replica_config(study, corpus_trial(), WARM, log_dir)
    received = ReplicaConfig.model_validate(config.to_replica())
    shutil.rmtree(tmp_path / "trials")  # the engine's node never had the trial's folder (no shared filesystem)
    local = write_shipped_corpus(received, received.log_dir or "")
    assert isinstance(local.spec, NgramSpec) and local.spec.external_corpus is not None
    assert corpus is not None
    path = Path(local.spec.external_corpus)
    assert path.is_file() and [json.loads(line) for line in path.read_text().splitlines()] == list(corpus.texts)
    assert local.corpus_documents is None  # written once; what remains is an ordinary path on this node
    assert flag_value(engine_for("cpu").argv(local, "127.0.0.1", 1234)) == str(path)
    assert flag_value(sglang_args(local, "127.0.0.1", 1234)) == str(path)
    # Same path as the trial asked for: the engine's report of its corpus path is no "changed setting".
    assert effective_diff(config.spec, None, {"speculative_algorithm": "NGRAM",
                                              "speculative_ngram_external_corpus_path": str(path)}) == {}


def test_on_the_driver_node_the_replica_rewrites_the_same_bytes_and_a_plain_path_is_left_alone(study, tmp_path):
    config, corpus = shipped_replica_config(study, corpus_trial(), WARM, tmp_path / "t")
    assert corpus is not None
    before = Path(corpus.path).read_bytes()
    local = write_shipped_corpus(config, tmp_path / "t")
    assert isinstance(local.spec, NgramSpec)
    assert local.spec.external_corpus == corpus.path and Path(corpus.path).read_bytes() == before
    plain, _ = shipped_replica_config(study, TrialConfig(spec=NgramSpec(num_draft_tokens=8)), WARM, tmp_path / "t")
    assert write_shipped_corpus(plain, tmp_path / "t") is plain


def test_a_user_file_is_shipped_and_shared_paths_are_passed_as_they_are(study, tmp_path):
    user = tmp_path / "mine.jsonl"
    user.write_text('"alpha beta"\n\n"gamma"\n')
    config, corpus = shipped_replica_config(study, corpus_trial(str(user)), [], tmp_path / "t")
    assert isinstance(config.spec, NgramSpec) and config.spec.external_corpus is not None
    assert config.corpus_documents == ("alpha beta", "gamma") and Path(config.spec.external_corpus).stem.startswith(
        "mine-")
    shared = corpus_trial(f"{SHARED_PREFIX}/mnt/shared/big.jsonl")
    config, corpus = shipped_replica_config(study, shared, [], tmp_path / "t")
    assert isinstance(config.spec, NgramSpec)
    assert config.spec.external_corpus == "/mnt/shared/big.jsonl" and config.corpus_documents is None
    assert corpus is not None and corpus.documents is None  # the driver need not see a shared file
    with pytest.raises(ValueError, match="spec.external_corpus: 'shared:rel.jsonl' is relative.*absolute path"):
        corpus_for_trial(corpus_trial(f"{SHARED_PREFIX}rel.jsonl"), [], tmp_path)


def test_bad_or_oversized_corpora_are_refused_naming_field_value_and_fix(study, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl' line 2 holds a dict, not a JSON string"):
        corpus_for_trial(corpus_trial(str(bad)), [], tmp_path)
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps("x" * MAX_SHIPPED_CORPUS_BYTES) + "\n")
    with pytest.raises(ValueError, match=rf"spec.external_corpus: '{big}' is {MAX_SHIPPED_CORPUS_BYTES + 3} bytes "
                                         rf"as a corpus, more than the {MAX_SHIPPED_CORPUS_BYTES}.*'shared:<path>'"):
        corpus_for_trial(corpus_trial(str(big)), [], tmp_path)
    base = ReplicaConfig(model="m", spec=NgramSpec(num_draft_tokens=8, external_corpus="c.jsonl",
                                                   external_sam_budget=3))
    with pytest.raises(ValidationError, match=r"corpus_documents: 1 documents, \d+ bytes as JSONL, more than"):
        ReplicaConfig.model_validate({**base.to_replica(), "corpus_documents": ["y" * MAX_SHIPPED_CORPUS_BYTES]})
    with pytest.raises(ValidationError, match="corpus_documents: given, but spec.external_corpus is not set"):
        ReplicaConfig(model="m", spec=NgramSpec(num_draft_tokens=8), corpus_documents=("a",))
    with pytest.raises(ValidationError, match="corpus_documents: empty"):
        ReplicaConfig.model_validate({**base.to_replica(), "corpus_documents": []})


def test_the_served_config_carries_the_corpus_and_production_writes_it_on_its_own_node(study, tmp_path):
    out = tmp_path / "study"
    config, corpus = shipped_replica_config(study, corpus_trial(), WARM, out)
    assert corpus is not None
    provenance = Provenance(study="s", decision="promote", source="final-0-trial-1", workload="w",
                            workload_digest="0123456789abcdef")
    serving = serving_config(config, provenance)
    name = Path(corpus.path).name
    assert isinstance(serving.replica.spec, NgramSpec)
    assert serving.replica.spec.external_corpus == name and serving.replica.corpus_documents == corpus.texts
    # Production loads the registered JSON (on any node) and its replica writes the corpus in its own folder.
    served = production_replica({"config": json.loads(serving.model_dump_json())})
    assert served == serving.replica
    local = write_shipped_corpus(served, tmp_path / "prod-node")
    assert isinstance(local.spec, NgramSpec) and local.spec.external_corpus is not None
    assert Path(local.spec.external_corpus) == tmp_path / "prod-node" / "corpora" / name
    assert Path(local.spec.external_corpus).read_bytes() == Path(corpus.path).read_bytes()
    # The deploy files: the corpus beside the engine command, which runs from its own folder; no trial folder named.
    files = deploy_files(serving, {"config_file": "serving_config.json"}, "promote")
    assert files[name].encode() == Path(corpus.path).read_bytes()
    assert flag_value(engine_argv(serving)) == name
    assert all(str(out) not in text for text in files.values())
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    for file, text in files.items():
        (deploy / file).write_text(text)
    script = files[COMMAND_FILE]
    assert 'cd "$(dirname "$0")"' in script and subprocess.run(["sh", "-n", str(deploy / COMMAND_FILE)]).returncode == 0
    # the env references (`NAME="$NAME" `) come before `exec`
    exec_line = next(line for line in script.splitlines() if not line.startswith("#") and " exec " in f" {line}")
    assert (deploy / flag_value(shlex.split(exec_line))).is_file()
    params = spec_params(serving)
    assert params["corpus_documents"] == str(len(corpus.texts)) and "cat sat" not in json.dumps(params)


def test_ship_corpus_keeps_the_env_values_the_replica_needs(study, tmp_path):
    written = write_corpus(["one", "two"], tmp_path / "c.jsonl")
    trial = corpus_trial(written.path)
    base = ReplicaConfig(model="m", spec=trial.spec, env={"HF_TOKEN": "s3cret"})
    shipped = ship_corpus(base, written)
    assert shipped.env == {"HF_TOKEN": "s3cret"} and shipped.corpus_documents == ("one", "two")
    assert ship_corpus(base, None) is base

"""A study with the external-corpus dimension, end to end through `python -m pipeline.tune` (issue #18): NGRAM without
a corpus and with the study's warm-up split as the corpus, at equal draft tokens, on a chat workload whose measured
prompts never appear in the warm-up (chat, as production sends it: the instruct model answers a raw-text question
with its end-of-turn token at once, and a one-token answer would compare nothing). Real local Ray, Ray Serve replicas
of the CPU engine (smallest model), MLflow and Optuna on SQLite.

The two NGRAM points are enqueued in the study's Optuna storage before the command runs (after the baseline, as
`enqueue_baseline` puts it first), the way a user pins points they want measured: a sampled study could draw the
same corpus choice twice and compare nothing."""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest

from pipeline.measure.load import requests_of, target_tokenizer
from pipeline.records.tracking import Tracker
from pipeline.search.space import enqueue_baseline, load_space
from pipeline.workloads import load_workload

from tests.conftest import TINY_STUDY

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
REPO = Path(__file__).resolve().parents[2]
NAME = "it-corpus"
MODEL = "smollm2-135m"
DRAFT_TOKENS = 6
# Distinct questions that share phrasing, so the warm-up corpus has n-grams the measured answers may reuse; no prompt
# repeats (a repeated prompt would let the trie alone match it, hiding what the corpus adds).
PROMPTS = ["Explain in two sentences how a bicycle gear works.",
           "Explain in two sentences how a refrigerator keeps food cold.",
           "Explain in two sentences how a solar panel makes electricity.",
           "Explain in two sentences how a vaccine trains the immune system."]
SPACE = f"""algorithms: [none, ngram]
common:
  warmup_requests: {{type: fixed, value: 0}}
branches:
  ngram:
    num_draft_tokens: {{type: fixed, value: {DRAFT_TOKENS}}}
    match_type: {{type: fixed, value: BFS}}
    max_bfs_breadth: {{type: fixed, value: 2}}
    capacity: {{type: fixed, value: 100000}}
    external_corpus: {{type: categorical, choices: [null, warmup]}}
    external_sam_budget: {{type: fixed, value: 2, when: {{external_corpus: [warmup]}}}}
"""
POINTS: list[dict[str, Any]] = [
    {"algorithm": "ngram", "ngram.external_corpus": None}, {"algorithm": "ngram", "ngram.external_corpus": "warmup"}]


@pytest.fixture(scope="module")
def corpus_study(tmp_path_factory):
    """(output folder, workload file, the command's stdout) of a finished 3-trial study."""
    tmp = tmp_path_factory.mktemp("corpus-study")
    workload = tmp / "questions.jsonl"
    workload.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    space = tmp / "space.yaml"
    space.write_text(SPACE)
    out = tmp / "out"
    out.mkdir()
    ot_study = optuna.create_study(study_name=NAME, storage=f"sqlite:///{out / 'optuna.db'}", direction="maximize")
    assert enqueue_baseline(ot_study, load_space(space))
    for point in POINTS:
        ot_study.enqueue_trial(point)
    args = [sys.executable, "-m", "pipeline.tune", "--name", NAME, "--output", str(out), "--search-space", str(space),
            "--workload", str(workload), "--trials", "3", "--seed", "0"]
    for key, value in TINY_STUDY.items():
        args += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    (tmp / "tune.log").write_text(done.stdout + done.stderr)  # kept with the test's folder for a failure's reader
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, workload, done.stdout


def trial_runs(out: Path) -> dict[str, Any]:
    """The study's trial runs by corpus setting: baseline, none, warmup."""
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", NAME)
    runs = [r for r in tracker.client().search_runs([tracker.experiment_id()], max_results=100)
            if r.data.tags.get("specdec.kind") == "trial"]
    assert len(runs) == 3, [r.info.run_name for r in runs]
    by: dict[str, Any] = {}
    for run in runs:
        key = ("baseline" if run.data.params["spec.algorithm"] == "none"
               else run.data.params.get("spec.external_corpus", "none"))  # MLflow keeps no param for None
        by[key] = run
    assert set(by) == {"baseline", "none", "warmup"}, set(by)
    return by


def test_corpus_trial_loads_the_warmup_split_and_records_its_size_and_load_time(corpus_study):
    out, workload, _ = corpus_study
    runs = trial_runs(out)
    warm, plain = runs["warmup"], runs["none"]
    for run in runs.values():
        assert run.data.tags["outcome"] == "COMPLETE", run.data.tags.get("reason")
    assert warm.data.params["spec.num_draft_tokens"] == plain.data.params["spec.num_draft_tokens"] == str(DRAFT_TOKENS)
    assert warm.data.params["spec.external_sam_budget"] == "2"
    split = load_workload(str(workload), seed=0, n_warmup=TINY_STUDY["workload.warmup_prompts"],
                          n_measure=TINY_STUDY["workload.measure_prompts"],
                          max_new_tokens=TINY_STUDY["workload.max_new_tokens"])
    # The corpus file the trial wrote is the warm-up split as the engine sees it (rendered with the chat template),
    # one JSON string per prompt, and holds none of the measured questions.
    files = list((out / "trials").rglob("corpora/warmup-*.jsonl"))
    assert files, "the corpus trial wrote no corpus file"
    documents = [json.loads(line) for line in files[0].read_text().splitlines()]
    tokenizer = target_tokenizer(MODEL)
    warm_ids = [r.input_ids for r in requests_of(split.warmup, MODEL)]
    assert [tuple(tokenizer.encode(d, add_special_tokens=False)) for d in documents] == warm_ids
    assert all(p.messages is not None and p.messages[-1][1] in d for p, d in zip(split.warmup, documents))
    assert all(p.messages is not None and p.messages[-1][1] not in d for p in split.measure for d in documents)
    metrics = warm.data.metrics
    assert metrics["corpus_documents"] == len(documents)
    assert metrics["corpus_bytes"] == files[0].stat().st_size
    # The engine reports the tokens it loaded, one separator per document on top of the documents' own tokens.
    tokens = sum(len(ids) for ids in warm_ids if ids is not None)  # none is None: compared with the documents above
    assert tokens <= metrics["corpus_tokens"] <= tokens + len(documents)
    assert metrics["corpus_load_s"] >= 0.0  # present: a cost paid at every engine start
    assert not {k for k in plain.data.metrics if k.startswith("corpus_")}
    # The engine ran with the corpus: its GET /list_external_corpora (SGLang's route, logged per trial) lists it.
    client = Tracker(f"sqlite:///{out / 'mlflow.db'}", NAME).client()
    info = json.loads(Path(client.download_artifacts(warm.info.run_id, "server_info.json")).read_text())
    assert list(info["list_external_corpora"].values()) == [metrics["corpus_tokens"]]


def test_both_ngram_trials_were_checked_equivalent_to_the_baseline(corpus_study):
    out, _, _ = corpus_study
    runs = trial_runs(out)
    client = Tracker(f"sqlite:///{out / 'mlflow.db'}", NAME).client()
    for key in ("none", "warmup"):
        run = runs[key]
        # Real answers were compared: several tokens each, decoded in speculative steps (accept length measured).
        metrics = run.data.metrics
        assert metrics["completion_tokens"] > 4 * metrics["n_ok"] and metrics["accept_len"] >= 1.0
        assert run.data.metrics["equiv_identical_share"] == 1.0
        report = json.loads(Path(client.download_artifacts(run.info.run_id, "equivalence.json")).read_text())
        assert report["passed"] is True, report


def test_stdout_and_report_compare_corpus_with_none_at_equal_draft_tokens(corpus_study):
    out, _, stdout = corpus_study
    runs = trial_runs(out)
    head = "NGRAM external corpus vs none, at equal draft tokens:"
    assert head in stdout, stdout[-4000:]
    table = stdout.split(head, 1)[1].strip().split("\n\n", 1)[0].splitlines()
    assert len(table) == 3, table  # header, none, warmup
    for line, key in zip(table[1:], ("none", "warmup")):
        cells = line.split()
        run = runs[key]
        assert cells[:3] == [str(DRAFT_TOKENS), key, "1"], line
        # the best trial by its run name, a config label (spaces and all)
        assert cells[3] == f"{run.data.metrics['tput_tok_s']:.2f}" and line.endswith(f"  {run.info.run_name}"), line
        assert f"{run.data.metrics['accept_len']:.2f}" in cells, line
    assert f"{runs['warmup'].data.metrics['corpus_load_s']:.2f}" in table[2].split()
    page = (out / "report" / "report.html").read_text()
    assert "External corpus vs none (at equal draft tokens)" in page
    assert all(html.escape(line) in page for line in table)
    assert (out / "report" / "corpus_vs_accept.png").stat().st_size > 0

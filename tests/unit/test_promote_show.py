"""`python -m pipeline.promote --show` prints what production would serve and its engine command line (issue #20).
Real MLflow on SQLite, the CLI's own `main`."""

from __future__ import annotations

from pipeline.promote import main
from pipeline.records.tracking import Tracker, default_tracking_uri
from pipeline.records.registry import register_config
from serve.engines.base import ReplicaConfig
from serve.serving import Provenance, ServingConfig


def test_show_prints_the_production_config_and_the_command_line(tmp_path, capsys):
    tracker = Tracker(default_tracking_uri(tmp_path), "shown", artifact_dir=tmp_path / "artifacts")
    run_id = tracker.start_study("shown", "name: shown\n", resume=False)
    serving = ServingConfig(
        replica=ReplicaConfig(model="smollm2-135m", spec={"algorithm": "ngram", "num_draft_tokens": 6},
                              extra_flags=[], env_from=["HF_TOKEN"]),
        provenance=Provenance(study="shown", decision="promote", source="final-0", workload="templated",
                              workload_digest="0123456789abcdef"))
    register_config(tracker, run_id, "specdec-shown", serving, move_production=True)
    assert main(["--name", "shown", "--output", str(tmp_path), "--show"]) == 0
    out = capsys.readouterr().out
    assert "specdec-shown version 1 (alias production)" in out
    assert ServingConfig.model_validate_json(out.split(":\n", 1)[1].split("\n\nengine command line:")[0]) == serving
    command = out.split("engine command line:\n  ", 1)[1].strip()
    assert command.startswith('HF_TOKEN="$HF_TOKEN" python -m serve.engines.cpu --model-path smollm2-135m')
    assert "--speculative-num-draft-tokens 6" in command

"""Issue 40, "Also": the study's up-front checks look at the draft models the search space can use, not every path
`model.drafts` names: an NGRAM-only study keeps a study file's EAGLE-3 path for another space without failing here."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_study
from pipeline.errors import PipelineError
from pipeline.preflight import check_study
from pipeline.search.space import load_space

ROOT = Path(__file__).resolve().parents[2]


def study_with_missing_draft(tmp_path: Path):
    return load_study(None, {"output_dir": str(tmp_path / "out"), "model.target": "smollm2-135m",
                             "model.drafts": {"eagle3": "/models/nowhere/eagle3-head"}})


def test_an_ngram_only_space_does_not_need_the_eagle3_draft(tmp_path):
    check_study(study_with_missing_draft(tmp_path), load_space(ROOT / "search_spaces" / "ngram.yaml"))


def test_a_space_that_searches_eagle3_needs_its_draft(tmp_path):
    with pytest.raises(PipelineError, match="model.drafts.eagle3.*does not exist"):
        check_study(study_with_missing_draft(tmp_path), load_space(ROOT / "search_spaces" / "eagle3.yaml"))

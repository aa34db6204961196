"""Defaults do not drift: docs/configuration.md's table, module constants and the typed defaults agree."""

import re
from pathlib import Path

import yaml

from pipeline.config import StudyConfig
from pipeline.workloads import DEFAULT_MAX_NEW_TOKENS

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _lookup(study: dict, dotted: str):
    node = study
    for part in dotted.split("."):
        node = node[part]
    return node


def test_every_literal_default_in_the_configuration_table_is_the_real_default():
    study = StudyConfig().model_dump(mode="json")
    checked = 0
    for key, default in re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", DOC.read_text(), flags=re.M):
        if "<" in default:  # a computed default such as `specdec-<name>`, described in words
            continue
        try:
            actual = _lookup(study, key)
        except KeyError:
            raise AssertionError(f"docs/configuration.md documents `{key}`, which StudyConfig does not have")
        assert yaml.safe_load(default) == actual, f"{key}: the docs say {default!r}, the code says {actual!r}"
        checked += 1
    assert checked >= 20  # the table was parsed, not skipped


def test_the_workload_loader_default_is_the_study_default():
    assert DEFAULT_MAX_NEW_TOKENS == StudyConfig().workload.max_new_tokens

"""Credentials in URLs are masked wherever a URL is shown (issue #15 item 6)."""

from typing import Any

import pytest

from pipeline.redact import mask_study_dict, mask_url


@pytest.mark.parametrize("url, masked", [
    ("postgresql://tuner:hunter2@db:5432/optuna", "postgresql://tuner:***@db:5432/optuna"),
    ("postgresql://tuner:p%40ss@db/optuna?sslmode=require", "postgresql://tuner:***@db/optuna?sslmode=require"),
    ("postgresql://db/optuna?password=hunter2&sslmode=require", "postgresql://db/optuna?password=***&sslmode=require"),
    ("https://u:p@mlflow.example/?token=abc&x=1", "https://u:***@mlflow.example/?token=***&x=1"),
])
def test_passwords_and_secret_query_values_are_masked(url, masked):
    assert mask_url(url) == masked


@pytest.mark.parametrize("url", ["sqlite:///runs/x/optuna.db", "http://user@host:5000/", "databricks", None, ""])
def test_urls_without_secrets_are_unchanged(url):
    assert mask_url(url) == url


def test_study_dict_masking_leaves_the_input_alone():
    data: dict[str, Any] = {"storage": {"url": "postgresql://a:b@h/d"}, "tracking": {"uri": None}, "name": "x"}
    assert mask_study_dict(data)["storage"]["url"] == "postgresql://a:***@h/d"
    assert data["storage"]["url"] == "postgresql://a:b@h/d"


def test_urls_quoted_in_an_error_message_are_masked():
    from pipeline.redact import mask_in_text

    text = "could not reach http://bob:s3cret@mlflow:5000 (timeout)"
    assert mask_in_text(text, ["http://bob:s3cret@mlflow:5000", None]) == \
        "could not reach http://bob:***@mlflow:5000 (timeout)"

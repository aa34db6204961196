"""Who must authenticate on the production endpoint, and which keys are refused: pure rules, no Ray."""

from pathlib import Path

import pytest
import yaml

from serve.production.settings import MIN_KEY_CHARS, ProductionSettings, auth_problem, auth_required, key_problem

ROOT = Path(__file__).resolve().parents[2]
GOOD = "k" * MIN_KEY_CHARS


@pytest.mark.parametrize("bind, require, expected", [
    ("127.0.0.1", None, False), ("::1", None, False), ("0.0.0.0", None, True), ("10.0.0.5", None, True),
    ("0.0.0.0", False, False), ("127.0.0.1", True, True),
])
def test_auth_follows_the_real_bind_address(bind, require, expected):
    # the app's own `host` says localhost; with `serve deploy` the proxy's http_options decide
    settings = ProductionSettings(registered_model="m", host="127.0.0.1", require_auth=require)
    assert auth_required(settings, bind) is expected


def test_no_keys_off_localhost_is_refused_with_the_fix():
    problem = auth_problem(ProductionSettings(registered_model="m"), "0.0.0.0", [])
    assert problem is not None
    assert "SPECDEC_API_KEYS" in problem and "--api-key-file" in problem and "--no-require-auth" in problem
    assert auth_problem(ProductionSettings(registered_model="m"), "127.0.0.1", []) is None
    assert auth_problem(ProductionSettings(registered_model="m", require_auth=False), "0.0.0.0", []) is None


@pytest.mark.parametrize("key", ["change-me-1", "change-me", "CHANGEME-0123456789", "short-key"])
def test_placeholder_and_short_keys_are_refused_without_echoing_them(key):
    assert key_problem(key)
    problem = auth_problem(ProductionSettings(registered_model="m"), "127.0.0.1", [GOOD, key])
    assert problem and "#2" in problem and key not in problem


def test_the_shipped_serve_configs_hold_no_usable_key():
    """Example files must not carry keys: any key in them is public, so it must be refused at start."""
    texts = [(ROOT / "infra/serve-production.yaml").read_text()]
    rayservice = yaml.safe_load((ROOT / "infra/kuberay/rayservice.yaml").read_text())
    texts.append(rayservice["spec"]["serveConfigV2"])
    for text in texts:
        for app in yaml.safe_load(text)["applications"]:
            env = (app.get("runtime_env") or {}).get("env_vars") or {}
            for key in str(env.get("SPECDEC_API_KEYS", "")).split(","):
                assert not key.strip() or key_problem(key.strip()), f"usable key shipped in an example: {key!r}"

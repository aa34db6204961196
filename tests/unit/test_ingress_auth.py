"""Who may call the closed loop's control routes (serve/production/settings.py `admin_access`, docs/security.md):
an admin key only; without admin keys nobody, except on a localhost endpoint with no keys at all."""

from __future__ import annotations

import pytest

from serve.production.settings import ProductionSettings, admin_access, auth_problem

GOOD = "a-good-key-0123456789"


@pytest.mark.parametrize("bind, users, admins, given, expected", [
    ("0.0.0.0", 1, 1, "admin", None),
    ("0.0.0.0", 1, 1, "user", 403),
    ("127.0.0.1", 1, 1, None, 401),
    ("127.0.0.1", 0, 0, None, None),  # a localhost endpoint without any key: open, as its OpenAI routes are
    ("127.0.0.1", 1, 0, "user", 403),  # user keys but no admin key: nobody may
    ("0.0.0.0", 0, 0, None, 403),  # --no-require-auth off localhost: the capture stays closed
])
def test_admin_routes_take_an_admin_key_only(bind, users, admins, given, expected):
    assert admin_access(bind, users, admins, given) == expected


def test_admin_keys_are_checked_like_user_keys_and_count_as_keys():
    settings = ProductionSettings(registered_model="m")
    problem = auth_problem(settings, "127.0.0.1", [GOOD], ["change-me-please-0123"])
    assert problem and "admin key #1" in problem and "change-me" not in problem
    assert auth_problem(settings, "0.0.0.0", [], [GOOD]) is None  # every route then takes the admin key

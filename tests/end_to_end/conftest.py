"""The end-to-end tier: the closed loop (capture, re-tune, canary, promotion), the level study, distributed mode on
PostgreSQL, a 2-node cluster, `serve deploy`, the production driver, and whole studies of a feature (open loop, corpus).
Not in the default test run: `python -m pytest -q -n 2 --dist loadfile tests` runs every tier. The integration tier's
fixtures apply here too."""

from tests.integration.conftest import cpu_server, smol, smol_dir  # noqa: F401 - fixtures

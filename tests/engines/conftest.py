"""The engines tier: the real-engine contract, study and production files for SGLang's own server on a CPU and for
llama-server (they need `bash infra/install-sglang-cpu.sh` and `bash infra/install-llama-cpp.sh`; each skips with that
command when its engine is missing). Not in the default test run: `python -m pytest -q -n 2 --dist loadfile tests`
runs every tier. The integration tier's fixtures apply here too."""

from tests.integration.conftest import cpu_server, smol, smol_dir  # noqa: F401 - fixtures

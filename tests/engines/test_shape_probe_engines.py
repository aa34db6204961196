"""The verify-cost probe over an engine's HTTP API (pipeline/measure/shape.py) against the real engines that report
no round table of their own: SGLang 0.5.23's own server on this CPU and llama-server, each started as a replica
starts it (the baseline: no speculation), one launch per engine.

Asserted: structure, not which way a measurement falls -- the record is a round table the step-cost model reads
unchanged, every cell was measured (every request extended its cached context: no cache miss left a hole) and
passed the probe's own check, the widest rounds cost more than the plain steps (the table is not monotone in
between on a CPU: see pipeline/measure/shape.py), and on SGLang every batched call of b requests was prefilled in
one forward (the engine's own log). Skipped without SGLang's CPU venv (bash infra/install-sglang-cpu.sh) or
llama-server (bash infra/install-llama-cpp.sh). ~2 min on 2 cores."""

from __future__ import annotations

import re

import pytest

from pipeline.measure.shape import WIDTHS, probe_shape, table_problem
from pipeline.simulate.cost import round_table
from serve.engines.base import ReplicaConfig
from serve.replica.deployment import EngineProcess
from serve.spec import NoSpec
from tests.integration.llama_cpp_helpers import require_llama_server
from tests.sglang_servers import needs_sglang_cpu, owned_engine

pytestmark = [pytest.mark.integration, pytest.mark.engines]


def check_record(record: dict, batches: tuple[int, ...]) -> dict:
    assert "error" not in record, record.get("error")
    assert record["source"] == "http-probe" and 1 <= record["attempts"] <= 3
    table = record["round_cost"]
    assert round_table(record) is not None  # the cost model reads it as it reads the CPU engine's
    assert table["batches"] == list(batches) and table["widths"] == list(WIDTHS)
    assert [len(row) for row in table["ms"]] == [len(WIDTHS)] * len(batches)
    assert all(cell > 0 for row in table["ms"] for cell in row)
    assert table["long_context_ms"] > 0 and table["short_context_ms"] == table["ms"][0][0]
    assert table_problem(table) is None, (table_problem(table), record["attempts"])
    # monotone within noise where the kernels do not change path: the widest round of each batch costs more than
    # its plain step, and the widest of the largest batch more than the widest of one request (in between, fp32
    # GEMMs on 2-3 rows are slower than on 4: dips the probe keeps, `record["dips"]`)
    assert all(row[-1] > row[0] for row in table["ms"]) and table["ms"][-1][-1] > table["ms"][0][-1]
    return table


@needs_sglang_cpu
def test_the_probe_measures_sglangs_round_table_in_one_forward_per_round(tmp_path):
    config = ReplicaConfig(engine="sglang", device="cpu", model="smollm2-135m", spec=NoSpec(), threads=1,
                           start_timeout_s=600, log_dir=str(tmp_path))
    with owned_engine(config) as engine:
        record = probe_shape(engine.url, "sglang", [1, 4])
        log = engine.log()
    table = check_record(record, (1, 2, 4))
    assert record["dialect"] == "generate" and table["logit_rows"] == "every query row"
    # every call of 4 requests x w new tokens after their cached 128 was one prefill batch of 4 (SGLang's own line)
    batches = re.findall(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)", log)
    of_four = [(int(t), int(c)) for n, t, c in batches if n == "4"]
    assert {t for t, c in of_four if c == 4 * 128} >= {4 * w for w in WIDTHS}, batches[-20:]


def test_the_probe_measures_llama_servers_table_through_its_own_completion_route(tmp_path):
    require_llama_server()
    config = ReplicaConfig(engine="llama_cpp", model="smollm2-135m", spec=NoSpec(), threads=1,
                           max_running_requests=4, start_timeout_s=300, log_dir=str(tmp_path))
    process = EngineProcess(config)
    try:
        process.wait_ready()
        record = probe_shape(process.url, "llama_cpp", [1, 4], max_running=4)
    finally:
        process.stop()
    table = check_record(record, (1, 2, 4))
    assert record["dialect"] == "completion" and table["logit_rows"].startswith("the requests' last rows only")

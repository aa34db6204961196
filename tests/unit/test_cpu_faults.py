"""The CPU engine's test-only fault switches: parsing (`--test-fault`), scope and the per-request decision. Pure."""

from __future__ import annotations

import asyncio
import itertools
import logging
from types import SimpleNamespace

import pytest

from serve.engines.cpu.command_line import ConfigError, parse_config
from serve.engines.cpu.faults import (SLOW_ENGINE_FACTOR, Fault, FaultSpecError, armed, before_start, count_start,
                                      install, parse_fault, parse_faults, request_action, turns_slow)


@pytest.mark.parametrize("text, fault", [
    ("exit-at-start", Fault(kind="exit-at-start", value=3)),
    ("exit-at-start=9@speculative", Fault(kind="exit-at-start", value=9, scope="speculative")),
    ("slow-start=2.5", Fault(kind="slow-start", value=2.5)),
    ("crash-after=0", Fault(kind="crash-after", value=0)),
    ("hang-after=4@speculative", Fault(kind="hang-after", value=4, scope="speculative")),
    ("wrong-tokens@speculative", Fault(kind="wrong-tokens", scope="speculative")),
    ("slow-steps=3@baseline", Fault(kind="slow-steps", value=3, scope="baseline")),
    ("slow-engine=2@speculative", Fault(kind="slow-engine", value=2, scope="speculative")),
    ("slow-after=8@speculative", Fault(kind="slow-after", value=8, scope="speculative")),
])
def test_specs_parse_and_print_back(text, fault):
    assert parse_fault(text) == fault
    assert parse_fault(str(fault)) == fault


@pytest.mark.parametrize("text, message", [
    ("explode", "unknown fault 'explode'"),
    ("crash-after", "crash-after needs a request count >= 0, e.g. 'crash-after=1'"),
    ("crash-after=-1", "needs a request count >= 0, got '-1'"),
    ("hang-after=1.5", "needs a request count >= 0, got '1.5'"),
    ("slow-start=0", "slow-start needs seconds > 0"),
    ("exit-at-start=0", "an exit code 1..255"),
    ("wrong-tokens=1", "wrong-tokens takes no value"),
    ("crash-after=1@warm", "unknown scope '@warm'"),
    ("slow-engine=0", "slow-engine needs the start (1, 2, ...) that runs slow"),
    ("slow-after=-1", "slow-after needs a request count >= 0"),
])
def test_bad_specs_name_the_value_and_the_fix(text, message):
    with pytest.raises(FaultSpecError, match="--test-fault") as err:
        parse_fault(text)
    assert message in str(err.value)


def test_the_engine_parser_takes_the_flag_repeated_and_rejects_a_kind_twice():
    config = parse_config(["--model-path", "m", "--test-fault", "crash-after=2@speculative",
                           "--test-fault", "wrong-tokens"])
    assert [str(f) for f in config.test_faults] == ["crash-after=2@speculative", "wrong-tokens"]
    assert "test_faults" not in config.server_args()  # /server_info reports what SGLang would: no test switches
    assert parse_config(["--model-path", "m"]).test_faults == ()
    with pytest.raises(ConfigError, match="hang-after given more than once"):
        parse_config(["--model-path", "m", "--test-fault", "hang-after=1", "--test-fault", "hang-after=2"])
    with pytest.raises(ConfigError, match="slow-steps given more than once"):  # @baseline and unscoped overlap
        parse_config(["--model-path", "m", "--test-fault", "slow-steps=2", "--test-fault", "slow-steps=3@baseline"])
    both = parse_config(["--model-path", "m", "--test-fault", "slow-steps=2@speculative",
                         "--test-fault", "slow-steps=4@baseline"]).test_faults
    assert armed(both, speculative=True)["slow-steps"].value == 2
    assert armed(both, speculative=False)["slow-steps"].value == 4


def test_speculative_scope_spares_the_baseline():
    faults = (parse_fault("wrong-tokens@speculative"), parse_fault("slow-start=1"))
    assert set(armed(faults, speculative=True)) == {"wrong-tokens", "slow-start"}
    assert set(armed(faults, speculative=False)) == {"slow-start"}


def test_baseline_scope_spares_speculative_engines():
    faults = (parse_fault("slow-steps=3@baseline"), parse_fault("wrong-tokens@speculative"))
    assert set(armed(faults, speculative=False)) == {"slow-steps"}
    assert set(armed(faults, speculative=True)) == {"wrong-tokens"}


def test_requests_crash_or_hang_only_after_n_generation_requests():
    faults = armed((parse_fault("crash-after=3"), parse_fault("hang-after=1")), speculative=False)
    assert [request_action(faults, "POST", "/generate", n) for n in range(5)] == \
        ["pass", "hang", "hang", "crash", "crash"]
    for method, path in (("GET", "/health"), ("POST", "/flush_cache"), ("GET", "/server_info"), ("GET", "/generate")):
        assert request_action(faults, method, path, 10) == "pass"
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert request_action(faults, "POST", path, 3) == "crash"
    assert request_action({}, "POST", "/generate", 100) == "pass"


def test_start_faults_exit_or_sleep_and_say_so_in_the_log(caplog):
    slept: list[float] = []
    with caplog.at_level(logging.WARNING, logger="serve.engines.cpu"):
        assert before_start((parse_fault("exit-at-start=7@speculative"),), True, slept.append) == 7
        assert before_start((parse_fault("exit-at-start=7@speculative"),), False, slept.append) is None
        assert before_start((parse_fault("slow-start=12"),), False, slept.append) is None
    assert slept == [12.0]
    assert "TEST FAULT exit-at-start: exiting with code 7" in caplog.text
    assert "TEST FAULT armed: slow-start=12" in caplog.text


def test_batch_noise_parses_and_needs_a_positive_scale():
    assert parse_fault("batch-noise=0.5") == Fault(kind="batch-noise", value=0.5)
    with pytest.raises(FaultSpecError, match="batch-noise needs a logit noise scale > 0"):
        parse_fault("batch-noise=0")


def test_batch_noise_follows_the_rounds_batch_composition_and_spares_the_prefill():
    """On a tiny random Llama: a request decodes the same tokens whenever its rounds are composed the same way, other
    tokens when they are not (another request id), the same first token always; without the switch, exact decoding."""
    from types import SimpleNamespace

    from serve.spec import NoSpec

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from serve.engines.cpu.decode import Decoder, Request, StopRules
    from serve.engines.cpu.faults import install
    from serve.engines.cpu.runner import ModelRunner
    from serve.engines.cpu.verify import Sampling

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()

    def decode(rid: str, noise: bool) -> list[int]:
        decoder = Decoder(ModelRunner(model), None, None)
        engine = SimpleNamespace(config=SimpleNamespace(test_faults=(parse_fault("batch-noise=2"),) if noise else (),
                                                        spec=NoSpec()),
                                 speculative=False, decoder=decoder, scheduler=SimpleNamespace(decoder=decoder),
                                 runner=decoder.runner)
        install(None, engine)  # type: ignore[arg-type]
        assert (decoder.logit_noise is not None) == noise
        req = Request(rid=rid, prompt_ids=[5, 17, 42, 8], sampling=Sampling(temperature=0.0),
                      rules=StopRules(max_new_tokens=24), seed=0)
        while not req.finished:
            engine.scheduler.decoder.step_many([req])
        return req.output_ids

    exact = decode("a", noise=False)
    assert decode("b", noise=False) == exact
    first, again, other = decode("a", True), decode("a", True), decode("b", True)
    assert first == again  # the same compositions: the same numerics
    assert other != first and exact not in (first, other)  # other compositions: other tokens
    assert first[0] == other[0] == exact[0]  # the prefill's token is exact


def test_a_drafts_scope_arms_a_fault_for_one_draft_size_only():
    faults = parse_faults(["exit-at-start@drafts=2", "hang-after=1@drafts=3", "wrong-tokens@speculative"])
    assert set(armed(faults, True, 2)) == {"exit-at-start", "wrong-tokens"}
    assert set(armed(faults, True, 3)) == {"hang-after", "wrong-tokens"}
    assert set(armed(faults, True, 4)) == {"wrong-tokens"}
    assert armed(faults, False) == {}  # the baseline arms none of them
    assert str(parse_fault("crash-after=2@drafts=5")) == "crash-after=2@drafts=5"
    with pytest.raises(FaultSpecError, match="'@drafts=N' with N >= 1"):
        parse_fault("crash-after=2@drafts=0")
    with pytest.raises(FaultSpecError, match="given more than once for one engine"):
        parse_faults(["crash-after=2@drafts=3", "crash-after=4@speculative"])  # both arm on a 3-draft engine
    parse_faults(["crash-after=2@drafts=3", "crash-after=4@drafts=4"])  # different engines: fine


def test_busy_neighbours_start_once_at_their_request():
    faults = armed(parse_faults(["busy-neighbours=2"]), False)
    actions = [request_action(faults, "POST", "/generate", count) for count in range(4)]
    assert actions == ["pass", "pass", "neighbours", "pass"]
    assert request_action(faults, "GET", "/health", 2) == "pass"


def test_starts_are_counted_per_kind_and_scope_across_processes(tmp_path):
    odd = parse_fault("slow-engine=2@speculative")
    assert [count_start(odd, True, str(tmp_path)) for _ in range(3)] == [0, 1, 2]
    assert count_start(odd, False, str(tmp_path)) == 0  # the baseline's starts are counted apart
    assert count_start(parse_fault("hang-at-start=1"), True, str(tmp_path)) == 0  # and each kind's
    with pytest.raises(FaultSpecError, match="SPECDEC_TEST_FAULT_STATE"):
        count_start(odd, True, None)


def test_slow_after_turns_slow_at_generation_request_n_plus_one():
    faults = armed(parse_faults(["slow-after=2"]), False)
    assert [turns_slow(faults, "POST", "/generate", count) for count in range(4)] == [False, False, True, True]
    assert not turns_slow(faults, "GET", "/health", 5) and not turns_slow(faults, "POST", "/flush_cache", 5)
    assert turns_slow(faults, "POST", "/v1/chat/completions", 2) and not turns_slow({}, "POST", "/generate", 9)


def test_slow_after_slows_every_round_once_n_requests_came(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `install`: the middleware it adds counts the generation requests; every scheduler round that starts
    after request N+1 arrived sleeps (factor - 1) x its own time, none before; an engine of the other scope is
    untouched."""
    from serve.spec import NoSpec

    slept: list[float] = []
    ticks = itertools.count(step=0.5)  # every inner round takes 0.5 s on this clock
    monkeypatch.setattr("serve.engines.cpu.faults.time.perf_counter", lambda: next(ticks))
    monkeypatch.setattr("serve.engines.cpu.faults.time.sleep", slept.append)

    class Inner:
        def step_many(self, reqs):
            return list(reqs)

    class App:  # what `install` uses of the server's app
        def __init__(self) -> None:
            self.middleware: list = []

        def add_middleware(self, cls, **kwargs) -> None:
            self.middleware.append((cls, kwargs))

    def engine(speculative: bool) -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(test_faults=(parse_fault("slow-after=2@baseline"),),
                                                      spec=NoSpec()),
                               speculative=speculative, scheduler=SimpleNamespace(decoder=Inner()))

    spared, spared_app = engine(speculative=True), App()
    install(spared_app, spared)  # type: ignore[arg-type]
    assert spared_app.middleware == [] and isinstance(spared.scheduler.decoder, Inner)

    slowed, app = engine(speculative=False), App()
    install(app, slowed)  # type: ignore[arg-type]
    [(middleware, kwargs)] = app.middleware

    async def one_round(scope, receive, send) -> None:  # the server answers each request with a scheduler round
        assert slowed.scheduler.decoder.step_many([scope["path"]]) == [scope["path"]]

    server = middleware(one_round, **kwargs)

    def request(method: str, path: str) -> list[float]:
        asyncio.run(server({"type": "http", "method": method, "path": path}, None, None))
        return list(slept)

    assert request("POST", "/v1/completions") == []
    assert request("GET", "/health") == [] and request("POST", "/flush_cache") == []  # not generation requests
    assert request("POST", "/generate") == []  # request N = 2: still full speed
    slow = pytest.approx((SLOW_ENGINE_FACTOR - 1) * 0.5)
    assert request("POST", "/v1/chat/completions") == [slow]
    assert request("GET", "/health") == [slow, slow]  # every round from then on

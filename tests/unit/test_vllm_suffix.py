"""vLLM's `suffix` method without vLLM: the spec variant and its rendering, the flush rule (a suffix server that
generated anything is restarted, since vLLM has no route that empties its suffix cache), the shim doing it against a
real child process that stands in for vLLM's server, the node check for Arctic Inference, and the bundled space."""

import asyncio
import json
import sys
import textwrap

import httpx
import pytest

from pipeline.config.trial import TrialConfig, validate_trial
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from serve.engines.vllm import flags, install, protocol
from serve.engines.vllm.server import Child, Shim, build_app
from serve.spec import VllmNgramSpec, VllmSuffixSpec, draft_token_count, parse_spec

# vLLM 0.32.0's SpeculativeConfig defaults for suffix decoding (vllm/config/speculative.py); K unset = the tree depth
VLLM_DEFAULTS = {"num_speculative_tokens": 24, "suffix_decoding_max_tree_depth": 24,
                 "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
                 "suffix_decoding_min_token_prob": 0.1}


def test_the_spec_has_vllms_names_defaults_and_ranges():
    spec = parse_spec({"algorithm": "vllm_suffix"})
    assert isinstance(spec, VllmSuffixSpec) and spec.model_dump(exclude={"algorithm"}) == VLLM_DEFAULTS
    assert draft_token_count(VllmSuffixSpec(num_speculative_tokens=6)) == 6
    assert validate_trial(TrialConfig(spec=spec), "vllm") == []
    for field, bad in [("suffix_decoding_max_tree_depth", 0), ("suffix_decoding_max_cached_requests", -1),
                       ("suffix_decoding_max_cached_requests", 2**31), ("suffix_decoding_max_spec_factor", -0.5),
                       ("suffix_decoding_min_token_prob", 1.5), ("num_speculative_tokens", 0)]:
        with pytest.raises(ValueError, match=field):
            parse_spec({"algorithm": "vllm_suffix", field: bad})


def test_the_speculative_config_writes_every_suffix_key():
    spec = VllmSuffixSpec(num_speculative_tokens=8, suffix_decoding_max_cached_requests=0,
                          suffix_decoding_min_token_prob=0.2)
    assert flags.speculative_config(spec) == {"method": "suffix", **VLLM_DEFAULTS, "num_speculative_tokens": 8,
                                              "suffix_decoding_max_cached_requests": 0,
                                              "suffix_decoding_min_token_prob": 0.2}
    argv = flags.server_argv("/venv/bin/python", "/m", "m", "float32", spec, 2, [])
    assert '"method":"suffix"' in argv[argv.index("--speculative-config") + 1]


def test_flush_restarts_only_a_server_whose_suffix_cache_holds_something():
    page = 'vllm:generation_tokens_total{engine="0",model_name="m"} 48.0\nvllm:prompt_tokens_total 9.0\n'
    assert protocol.generated_tokens(page) == 48.0 and protocol.generated_tokens("") == 0.0
    assert protocol.flush_action(VllmSuffixSpec(), 48.0) == "restart"
    assert protocol.flush_action(VllmSuffixSpec(), 0.0) == "reset"  # fresh server: nothing cached yet
    assert protocol.flush_action(VllmSuffixSpec(suffix_decoding_max_cached_requests=0), 48.0) == "reset"
    assert protocol.flush_action(VllmNgramSpec(), 48.0) == "reset"  # the n-gram proposer keeps nothing


# A stand-in for vLLM's server (standard library only): /health, /version, /metrics with its generated tokens since
# its own start, /v1/completions, /reset_prefix_cache. Each process is a new "vLLM", as a restart makes one.
FAKE_VLLM = textwrap.dedent('''
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    port = int(sys.argv[sys.argv.index("--port") + 1])
    state = {"generated": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, body, kind="application/json"):
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/metrics":
                self.answer(f"vllm:generation_tokens_total {state['generated']}.0\\n", "text/plain")
            elif self.path == "/version":
                self.answer(json.dumps({"version": "fake", "pid": os.getpid()}))
            else:
                self.answer("{}")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/v1/completions":
                state["generated"] += 2
                self.answer(json.dumps({"choices": [{"text": "ab", "token_ids": [7, 8], "finish_reason": "length"}],
                                        "usage": {"completion_tokens": 2}}))
            else:
                self.answer(json.dumps({"success": True}))

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def flush_answer(response: httpx.Response) -> dict:
    """The flush's result: a JSON body, or a restart's event stream whose last event is it."""
    assert response.status_code == 200, response.text
    if not response.headers["content-type"].startswith("text/event-stream"):
        return response.json()
    assert response.text.startswith(": restarting vLLM")  # a byte before the restart ends: no read timeout
    return json.loads([line for line in response.text.splitlines() if line.startswith("data:")][-1][5:])


def shim_flow(tmp_path, spec):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    shim = Shim(spec, Child([sys.executable, str(script)]), "m", 60.0)

    def pid() -> int:
        assert shim.child.process is not None
        return shim.child.process.pid

    async def go():
        await shim.start_child()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(shim)),
                                         base_url="http://shim") as c:
                empty = (await c.post("/flush_cache")).json()  # nothing generated yet
                first = pid()
                await c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
                flushed = flush_answer(await c.post("/flush_cache"))
                info = (await c.get("/server_info")).json()
                return empty, first, flushed, pid(), info
        finally:
            shim.child.stop()

    return asyncio.run(go())


def test_the_shim_restarts_a_suffix_server_on_flush(tmp_path):
    empty, first, flushed, second, info = shim_flow(tmp_path, VllmSuffixSpec())
    assert empty == {"flushed": True, "restarted": False, "vllm_starts": 1}
    assert flushed == {"flushed": True, "restarted": True, "vllm_starts": 2} and second != first
    assert info["vllm_starts"] == 2 and info["internal_states"][0]["requests_since_flush"] == 0


def test_the_shim_keeps_an_ngram_server_on_flush(tmp_path):
    empty, first, flushed, second, _ = shim_flow(tmp_path, VllmNgramSpec())
    assert flushed == {"flushed": True, "restarted": False, "vllm_starts": 1} and second == first


def test_a_node_without_arctic_inference_fails_the_launch_with_the_fix(monkeypatch, tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / install.STAMP_FILE).write_text(install.VERSION)
    monkeypatch.setenv(install.VENV_ENV, str(venv))
    problem = install.arctic_problem()
    assert problem and install.ARCTIC_VERSION in problem and install.INSTALL_COMMAND in problem
    monkeypatch.setattr("serve.engines.vllm.adapter.model_folder", lambda model: str(tmp_path / model))
    engine = engine_for("vllm")
    config = ReplicaConfig(engine="vllm", model="m", spec=VllmSuffixSpec())
    with pytest.raises(install.VllmMissing, match="Arctic Inference"):  # a launch failure, not an INVALID config
        engine.prepare(config, engine.argv(config, "127.0.0.1", 9))
    (venv / install.ARCTIC_STAMP_FILE).write_text(install.ARCTIC_VERSION + "\n")
    assert install.arctic_problem() is None


def test_the_bundled_space_searches_warm_up_and_resolves_to_tpe():
    from pipeline.config import SEARCH_SPACES_DIR, load_study
    from pipeline.search.space import load_space
    from pipeline.search.strategy import resolve_strategy

    space = load_space(SEARCH_SPACES_DIR / "vllm-suffix.yaml")
    assert list(space.algorithms) == ["none", "vllm_suffix"]
    names = [name for _, name, _ in space.params_for("vllm_suffix")]
    assert "warmup_requests" in names and set(VLLM_DEFAULTS) <= set(names)
    study = load_study(None, overrides={"engine": {"kind": "vllm"}, "search": {"strategy": "auto"}})
    strategy = resolve_strategy(study, space)
    assert strategy.name == "tpe" and "vllm_suffix" in strategy.reason

"""The one table of speculative settings (serve/engines/spec_flags.py) and who reads it."""

from serve.engines.cpu.command_line import build_parser
from serve.engines.spec_flags import ENGINE_OWNED_FLAGS, SETTINGS, effective_diff, render_spec, requested
from serve.spec import NgramSpec, NoSpec, SpecConfig, StandaloneSpec


def test_the_cpu_engine_parses_every_flag_of_the_table():
    options = {o for action in build_parser()._actions for o in action.option_strings}
    assert {s.flag for s in SETTINGS} <= options


def test_every_rendered_flag_is_owned_by_the_tuner():
    specs: list[SpecConfig] = [NoSpec(), NgramSpec(),
                               StandaloneSpec(draft_model="d", num_steps=2, topk=2, num_draft_tokens=4)]
    for spec in specs:
        flags = [a for a in render_spec(spec, max_running_requests=4) if a.startswith("--")]
        assert flags and set(flags) <= ENGINE_OWNED_FLAGS


def test_ngram_never_asks_for_steps_or_topk():
    fields = [s.field for s, _ in requested(NgramSpec(num_draft_tokens=4, max_bfs_breadth=2))]
    assert "num_steps" not in fields and "topk" not in fields and "num_draft_tokens" in fields


def test_effective_diff_reports_what_the_engine_changed():
    spec = StandaloneSpec(draft_model="d", num_steps=3, topk=1, num_draft_tokens=8)
    resolved = {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                "speculative_num_draft_tokens": 4, "speculative_draft_model_path": "d", "max_running_requests": 48}
    assert effective_diff(spec, None, resolved) == {"num_draft_tokens": (8, 4)}
    assert effective_diff(spec, 16, resolved)["max_running_requests"] == (16, 48)
    assert effective_diff(NoSpec(), None, {"speculative_algorithm": "NGRAM"}) == {"algorithm": (None, "NGRAM")}
    # A setting the engine does not report is no diff (nothing to compare with).
    assert effective_diff(NgramSpec(), None, {"speculative_algorithm": "NGRAM"}) == {}

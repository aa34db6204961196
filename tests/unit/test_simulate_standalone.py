"""STANDALONE configs in the simulator, without a model: the draft replay's tables (built here from the synthetic
draft model of test_draft_tree) drive `replay` to the accepted lengths the engine's procedure gives, round by round;
the rounds carry the draft forwards the step-cost model charges; which studies simulate-first covers and which
points the draft replay must cover."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_study
from pipeline.search.draft_replay import draft_plan, tables_of
from pipeline.search.space import load_space
from pipeline.search.strategy import resolve_strategy
from pipeline.simulate.cost import CostModel, RoundTable
from pipeline.simulate.drafts import DraftCurve, DraftTables, draft_curve
from pipeline.simulate.replay import Answer, ClosedLoop, Phase, replay
from serve.ngram.drafttree import accepted_drafts
from serve.spec import StandaloneSpec
from tests.unit.test_draft_tree import expansion, full_build, replayed

ROOT = Path(__file__).resolve().parents[2]
POINTS = [(1, 1, 2), (3, 1, 4), (2, 2, 3), (3, 2, 5), (4, 4, 6), (4, 4, 16), (2, 4, 9)]


def answers() -> list[Answer]:
    """Target outputs that mostly follow the synthetic draft's argmax, with a detour every few tokens."""
    out = []
    for seed, prompt in enumerate([(1, 2, 3), (4, 4, 4, 8), (7,), (2, 5, 1, 1, 6)]):
        tokens: list[int] = []
        for i in range(14):
            top = expansion(prompt + tuple(tokens), 2)
            tokens.append(top[1][0] if (i + seed) % 5 == 4 else top[0][0])
        out.append(Answer(prompt, tuple(tokens)))
    return out


def tables(max_steps: int = 4, topks: tuple[int, ...] = (1, 2, 4)) -> DraftTables:
    """What the draft replay's JSON holds for the synthetic draft, through the pipeline's own reader."""
    per_answer = []
    for a in answers():
        per_answer.append({str(k): [replayed(a.prompt_ids + a.output_ids[:j], a.output_ids[j:], max_steps, k)[0].ranks()
                                    for j in range(1, len(a.output_ids))] for k in topks})
    return tables_of("draft", answers(), max_steps, {"answers": per_answer, "draft_cost": {"sizes": [1, 4, 16],
                                                                                          "ms": [2.0, 3.0, 9.0]},
                                                     "seconds": {"replay": 1.5}})


def engine_steps(answer: Answer, steps: int, topk: int, num_draft_tokens: int) -> list[int]:
    """Tokens each verify step keeps, by the engine's procedure (every tree built in full)."""
    kept, emitted = [], 1
    while emitted < len(answer.output_ids):
        build, _ = full_build(answer.prompt_ids + answer.output_ids[:emitted], steps, topk)
        tree, _ = build.prune(num_draft_tokens)
        n = min(accepted_drafts(tree, answer.output_ids[emitted:]) + 1, len(answer.output_ids) - emitted)
        kept.append(n)
        emitted += n
    return kept


@pytest.mark.parametrize("steps,topk,draft", POINTS)
def test_replayed_standalone_rounds_keep_what_the_engine_keeps(steps, topk, draft):
    spec = StandaloneSpec(draft_model="draft", num_steps=steps, topk=topk, num_draft_tokens=draft)
    result = replay(spec, [Phase("measure", tuple(answers()), ClosedLoop(2))], drafts=tables())
    for record, answer in zip(result.requests, answers()):
        assert record.accepted_lengths == engine_steps(answer, steps, topk, draft)
    verify_rounds = [r for r in result.rounds if r.batch]
    assert all(r.width == draft and set(r.trees) == {min(draft - 1, topk + (steps - 1) * topk * topk)}
               for r in verify_rounds)
    # each verify step: one catch-up forward (prompt + first token at a request's first step) and steps - 1 tree
    # forwards of topk nodes
    first = verify_rounds[0]
    assert first.drafts[:steps] == (len(answers()[0].prompt_ids) + 1,) + (topk,) * (steps - 1)
    assert all(len(r.drafts) == r.batch * steps for r in verify_rounds)
    assert all(r.drafts[0] in (1, 2) for r in verify_rounds[2:] if r.batch == 1)


def test_a_standalone_config_outside_the_replay_is_refused_by_name():
    spec = StandaloneSpec(draft_model="draft", num_steps=5, topk=1, num_draft_tokens=6)
    phases = [Phase("measure", tuple(answers()), ClosedLoop(1))]
    with pytest.raises(ValueError, match="num_steps=5"):
        replay(spec, phases, drafts=tables(max_steps=4))
    with pytest.raises(ValueError, match="'other'"):
        replay(spec.model_copy(update={"draft_model": "other", "num_steps": 2, "num_draft_tokens": 3}), phases,
               drafts=tables())
    with pytest.raises(ValueError, match="needs the draft replay"):
        replay(spec, phases)
    # warm-up answers the replay lacks are replayed without drafts; a missing measured one is an error
    unknown = Answer((9, 9), (1, 2, 3))
    spec = spec.model_copy(update={"num_steps": 2, "num_draft_tokens": 3})
    warm = replay(spec, [Phase("warmup", (unknown,), ClosedLoop(1)), *phases], drafts=tables())
    assert warm.phase("warmup")[0].accepted_lengths == [1, 1]
    with pytest.raises(ValueError, match="missing from the draft replay"):
        replay(spec, [Phase("measure", (unknown,), ClosedLoop(1))], drafts=tables())


def test_the_step_cost_charges_the_draft_forwards_of_a_round():
    table = RoundTable(batches=[1], widths=[1, 8], ms=[[10.0, 12.0]], lm_head_rows=[1, 8], lm_head_ms=[1.0, 1.0],
                       context_tokens=128, long_context_tokens=512, short_context_ms=10.0, long_context_ms=10.0)
    curve = draft_curve({"sizes": [1, 4], "ms": [2.0, 5.0]})
    assert curve == DraftCurve(sizes=[1, 4], ms=[2.0, 5.0]) and curve.forward_ms(2) == 3.0
    assert curve.forward_ms(10) == 11.0  # linear past the last measured size (a draft prefill)
    spec = StandaloneSpec(draft_model="draft", num_steps=3, topk=1, num_draft_tokens=4)
    rounds = replay(spec, [Phase("measure", tuple(answers()[:1]), ClosedLoop(1))], drafts=tables()).rounds
    plain = CostModel(shape="measured", table=table, k=1.0)
    drafted = plain.model_copy(update={"draft": curve})
    for r in rounds[1:]:
        assert drafted.shape_of(r) - plain.shape_of(r) == pytest.approx(sum(curve.forward_ms(n) for n in r.drafts))
        assert drafted.shape_of(r) > plain.shape_of(r)


def test_simulate_first_covers_standalone_on_the_cpu_engine_only_and_never_eagle(tmp_path):
    standalone = load_space(ROOT / "search_spaces" / "standalone.yaml")
    study = load_study(None, {"model.drafts": {"standalone": "smollm2-135m"}})
    assert resolve_strategy(study, standalone).name == "simulate-first"
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("algorithms: [none, ngram, standalone]\nbranches:\n  ngram:\n"
                     "    num_draft_tokens: {type: int, low: 2, high: 8}\n  standalone:\n"
                     "    num_steps: {type: int, low: 1, high: 3}\n    topk: {type: categorical, choices: [1, 2]}\n"
                     "    num_draft_tokens: {type: int, low: num_steps + 1, high: num_steps * topk + 1}\n")
    assert resolve_strategy(study, load_space(mixed)).name == "simulate-first"
    on_sglang = load_study(None, {"model.drafts": {"standalone": "d"}, "engine.kind": "sglang"})
    reason = resolve_strategy(on_sglang, standalone).reason
    assert "falls back to tpe" in reason and "standalone" in reason and "CPU engine" in reason
    eagle = tmp_path / "eagle.yaml"
    eagle.write_text("algorithms: [none, standalone, eagle]\n")
    reason = resolve_strategy(load_study(None, {"model.drafts": {"standalone": "d", "eagle": "h"}}),
                              load_space(eagle)).reason
    assert "hidden states" in reason
    sampled = resolve_strategy(load_study(None, {"model.drafts": {"standalone": "d"}, "workload.temperature": 0.7}),
                               standalone)
    assert sampled.name == "tpe" and "temperature" in sampled.reason
    # the draft replay covers the deepest num_steps and every topk of the space's STANDALONE points
    assert draft_plan(standalone, study) == {"smollm2-135m": (6, (1, 2, 4))}
    assert draft_plan(load_space(mixed), study) == {"smollm2-135m": (3, (1, 2))}

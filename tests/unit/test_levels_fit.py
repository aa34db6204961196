"""Issue 59: a split across concurrency levels runs two engines at once (`serve.serving`: EngineBackend and
EngineBackendHigh, each of the replica's tp_size GPUs). At tp 8 on an 8-GPU node the two do not fit, so the decision
serves one config at every level and the headline says why; where production has room for both, the split stands."""

from __future__ import annotations

import pytest

from pipeline.config import PromotionPolicy, load_study
from pipeline.decide.headline import Deploy, levels_headline
from pipeline.decide.levels import BASELINE, Candidate, LevelInput, RunFigures, decide_levels, routing_policy
from pipeline.study.served import engine_gpus, serving_room
from serve.engines.base import ReplicaConfig
from serve.spec import NgramSpec

DEPLOY = Deploy("/out/deploy/engine_command.sh")


def runs(*tputs: float) -> tuple[RunFigures, ...]:
    return tuple(RunFigures(tput_tok_s=t) for t in tputs)


def seed_levels(fast_at_8: tuple[float, ...]) -> list[LevelInput]:
    """The seed study's shape (concurrency [8, 1]): 'fast' wins at 1 in flight, not at 8."""
    return [LevelInput(level=8, baseline=runs(100, 101, 99),
                       candidates=(Candidate(id="fast", runs=runs(*fast_at_8), equivalent=True, draft_tokens=4),)),
            LevelInput(level=1, baseline=runs(10, 10.1, 9.9),
                       candidates=(Candidate(id="fast", runs=runs(15, 15.2, 14.8), equivalent=True, draft_tokens=4),))]


def tp8(spec=None) -> ReplicaConfig:
    return ReplicaConfig(engine="sglang", device="cuda", model="m", tp_size=8, attention_backend="triton",
                         **({"spec": spec} if spec else {}))


def test_one_engine_holds_its_tp_size_gpus():
    assert engine_gpus(tp8()) == 8  # what each of the split's two Serve deployments asks Ray for


def test_a_split_at_tp_8_on_an_8_gpu_node_is_never_produced_and_the_headline_says_why():
    room = serving_room(None, engine_gpus(tp8()), node_gpus=8)
    decision = decide_levels(seed_levels((80, 81, 79)), PromotionPolicy(), room=room, labels={"fast": "ngram fast"})
    policy = decision.policy
    # 'fast' is 0.80x at 8 in flight: served everywhere it would be slower than the baseline there
    assert (policy.config, policy.up_to, policy.above) == (None, None, None)
    assert policy.unsplit and "need 16 GPUs and the serving side has 8" in policy.unsplit
    routing = routing_policy(decision, {BASELINE: tp8(), "fast": tp8(NgramSpec())})
    assert routing.switch_above is None and routing.high is None  # one engine: nothing for a second deployment
    head = levels_headline(decision, DEPLOY)
    assert head.kind == "keep_baseline"
    assert head.decision.startswith("keep the baseline at every level: one engine only, because the levels call for "
                                    "a second one and two engines (one per concurrency range) of 8 GPUs each need 16 "
                                    "GPUs and the serving side has 8")
    assert "engine.serving_gpus" in head.decision
    (at_1,) = [line for line in head.levels if line.startswith("1 in flight")]
    assert "'ngram fast' 1.50x" in at_1 and "one config serves every level" in at_1


def test_the_single_config_is_the_winner_where_it_is_slower_nowhere():
    room = serving_room(None, 8, node_gpus=8)
    decision = decide_levels(seed_levels((99, 100, 101)), PromotionPolicy(), room=room, labels={"fast": "ngram fast"})
    assert decide_levels(seed_levels((99, 100, 101)), PromotionPolicy()).policy.up_to == 1  # the split it replaces
    assert (decision.policy.config, decision.policy.up_to) == ("fast", None)
    head = levels_headline(decision, DEPLOY)
    assert head.kind == "promote"
    assert head.decision.startswith("serve 'ngram fast' at every measured level (1.50x at 1, 1.00x at 8): one "
                                    "engine only")
    assert [line.split(":")[0] for line in head.levels] == ["1 in flight", "8 in flight"]
    assert all("'ngram fast'" in line for line in head.levels)  # served at both levels


@pytest.mark.parametrize("serving_gpus, node_gpus", [(16, None), (None, 16)])
def test_the_split_stands_where_production_has_room_for_both(serving_gpus, node_gpus):
    decision = decide_levels(seed_levels((80, 81, 79)), PromotionPolicy(),
                             room=serving_room(serving_gpus, 8, node_gpus))
    assert (decision.policy.config, decision.policy.up_to, decision.policy.unsplit) == ("fast", 1, None)
    routing = routing_policy(decision, {BASELINE: tp8(), "fast": tp8(NgramSpec())})
    assert routing.switch_above == 1 and routing.high_source == BASELINE


def test_unknown_room_assumes_one_engine_and_cpu_engines_always_fit():
    assert serving_room(None, 8, None).split_problem() is not None  # nothing known: a split needs 2 x tp GPUs
    assert serving_room(None, 0, None).split_problem() is None  # engines without GPUs


def test_the_study_key_is_typed_and_named_in_its_error():
    study = load_study(None, {"engine.kind": "sglang", "engine.tp_size": 8, "engine.serving_gpus": 16})
    assert study.engine.serving_gpus == 16 and load_study(None, {}).engine.serving_gpus is None
    with pytest.raises(Exception, match="serving_gpus"):
        load_study(None, {"engine.serving_gpus": 0})


def test_the_single_config_never_breaks_a_limit_the_split_kept_it_from():
    from pipeline.config import SlaConstraint

    # 'fast' is as fast as the baseline at 8 but breaks the ttft limit there: one engine serves the baseline
    limit = SlaConstraint(metric="ttft_p99_ms", max_ms=200.0, concurrency=8)
    levels = [LevelInput(level=8, baseline=tuple(RunFigures(tput_tok_s=t, ttft_p99_ms=100.0) for t in (100, 100, 100)),
                         candidates=(Candidate(id="fast", equivalent=True, draft_tokens=4, runs=tuple(
                             RunFigures(tput_tok_s=t, ttft_p99_ms=300.0) for t in (101, 101, 101))),)),
              LevelInput(level=1, baseline=runs(10, 10, 10),
                         candidates=(Candidate(id="fast", runs=runs(15, 15, 15), equivalent=True, draft_tokens=4),))]
    split = decide_levels(levels, PromotionPolicy(), [limit])
    assert (split.policy.config, split.policy.up_to) == ("fast", 1)
    one = decide_levels(levels, PromotionPolicy(), [limit], room=serving_room(None, 8, 8))
    assert (one.policy.config, one.policy.up_to) == (None, None) and one.policy.unsplit

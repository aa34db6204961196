"""simulate-first on the driver (`search.strategy`, pipeline/config/search.py): the state between Tune's questions
"what next?" and its answers "this trial ended", with the MLflow reads and writes that needs.

1. The first suggestion is the enqueued baseline (as in every study). Nothing else is suggested until it has ended.
2. When it completed: its requests (all phases: warm-up, measurement and `reference`, the rest of the warm-up split)
   and `/server_info` are read from its MLflow run; a space with STANDALONE points has its draft model replayed over
   the measured answers (`draft_replay`, its time on the study run as `simulate_draft_replay_s`); the simulator
   (pipeline/simulate) is built on its answers -- with the engine's prefix cache when its `/server_info` says it
   runs one (SGLang's radix cache: prefills are then charged for the tokens it did not hold) -- the cost model
   fitted to it, and the space explored on the predictions (`simulated.explore`), printed in one line.
   If the baseline failed, or its records cannot be replayed, the rest of the study is today's search (TPE), said so.
3. Each further suggestion is the best predicted config not yet launched, kept apart from the launched ones
   (`simulated.pick`), enqueued in the Optuna study with its prediction as a user attribute.
4. When a launch completes, its prediction (every predicted figure, `predicted_<figure>`) and its relative error on
   the first objective (`prediction_error`) go on its MLflow run; the cost model is refitted on every completed
   launch and the remaining configs re-ranked; if the median error exceeds `error_threshold`, the study says so and
   adds `widen_by` launches (never past budget.max_trials). A launch stopped early (PRUNED) counts as a prediction
   that missed; one that measured nothing (a failed launch, a refused config) is replaced by the next best. The
   study's parent run carries `simulate/predictions.json` (predicted vs measured per launch, the cost model),
   `simulate/space_predictions.jsonl` (every predicted point under the last cost model, best first) and
   `simulate_median_error`.
After the launches the searcher answers FINISHED: Tune ends, and the study finalizes as usual on measured trials.

The plan pickles small (Tune checkpoints its searcher): the simulator, records and replays are rebuilt from MLflow
on first use after a restore.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.console_log import detail, say
from pipeline.records.gaps import missing
from pipeline.measure.load import target_tokenizer
from pipeline.records.tracking import SPACE_PREDICTIONS
from pipeline.records.trial_runs import baseline_trial, run_requests, run_server_info
from pipeline.search.draft_replay import draft_tables
from pipeline.search.simulated import Explored, Predicted, explore, misses, pick, point_key, rank
from pipeline.search.space import BASELINE_ATTR, SearchSpace, baseline_point, resolve
from pipeline.search.whole_space import explore_whole
from pipeline.simulate.cost import CostModel
from pipeline.simulate.predict import PREDICTION_ATTR
from pipeline.simulate.prefix import PrefixCache, prefix_cache_of
from pipeline.simulate.simulator import Simulator, base_cost, relative_error
from pipeline.simulate.workload import Unsimulable, answers_of, corpus_automaton
from pipeline.trial.context import TrialContext
from pipeline.trial.corpus import corpus_for_trial
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.report import TrialReport
from serve.ngram.sam import SuffixAutomaton
from serve.spec import NgramSpec

__all__ = ["PREDICTION_ATTR", "SPACE_PREDICTIONS", "SimulateFirstPlan"]



class SimulateFirstPlan:
    """Driver-side state of a simulate-first search."""

    def __init__(self, ctx: TrialContext, space: SearchSpace) -> None:
        self.ctx = ctx
        self.space = space
        settings = ctx.study.search.simulate
        self.budget = min(settings.launches + 1, ctx.study.budget.max_trials)  # launches, the baseline included
        self.suggested: list[str] = []  # Tune trial ids, in order (the baseline first)
        self.predicted: dict[str, dict[str, Any]] = {}  # trial id -> {"params", "figures"}
        self.outcomes: dict[str, dict[str, Any]] = {}  # trial id -> {"outcome", "run_id", "measured", "error"}
        self.fallback: str | None = None  # why the rest of the study is TPE
        self.widened = 0
        self.explored_note = ""
        self._cache: dict[str, Any] = {}  # simulator, cost, ranking, records: rebuilt after a restore

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    # ------------------------------------------------------------------ Tune's questions

    @property
    def baseline_id(self) -> str | None:
        return self.suggested[0] if self.suggested else None

    def waiting(self) -> bool:
        """True while the baseline runs: nothing else can be predicted yet."""
        return self.baseline_id is not None and self.baseline_id not in self.outcomes

    def exhausted(self) -> bool:
        return self.fallback is None and len(self.suggested) >= self.budget

    def running(self) -> bool:
        """A launch has not ended yet (it may still widen the budget)."""
        return any(t not in self.outcomes for t in self.suggested)

    def next_launch(self) -> Predicted | None:
        """The next config to launch (None: nothing left worth launching); builds the simulator on first call."""
        if not self._ready():
            return None
        settings = self.ctx.study.search.simulate
        taken = [self.predicted[t]["params"] for t in self.suggested[1:] if t in self.predicted]
        chosen = pick(self._cache["ranked"], 1, settings.min_distance, taken, same=self._signature_of)
        return chosen[0] if chosen else None

    def _signature_of(self, params: dict[str, Any]) -> str:
        """The replay signature of an explored point (configs that share one are one config to the cost model);
        its own key for any other."""
        key = point_key(params)
        classes = self._cache.get("classes")
        if classes is None:
            whole = _whole(self._cache["explored"])  # a space predicted whole knows its rows' signatures
            classes = self._cache["classes"] = whole.signatures() if whole is not None else {}
            for p in self._cache["explored"].predicted if whole is None else ():
                try:
                    classes[p.key] = self._cache["simulator"].signature(p.config)
                except (Unsimulable, ValueError, OSError):
                    continue
        return classes.get(key, key)

    def on_suggested(self, trial_id: str, launch: Predicted | None) -> None:
        self.suggested.append(trial_id)
        if launch is not None:
            self.predicted[trial_id] = {"params": launch.params, "figures": launch.figures,
                                        "cost_launches": self._cache["cost"].launches,
                                        "levels": self._at_levels(launch)}
            metric = self.ctx.study.objective.metrics[0]
            say(f"[simulate-first] launching {_describe(launch.params)}: predicted {metric}="
                f"{launch.figures.get(metric, float('nan')):.2f}"
                + (f", accept length {launch.figures['accept_len']:.2f}" if "accept_len" in launch.figures else ""))

    def on_complete(self, trial_id: str, result: dict[str, Any] | None) -> None:
        # what the trial's report says (an error leaves none: NO_REPORT), kept as the record says it
        report = TrialReport.from_tune(result)
        said, outcome = report.said, report.outcome
        metric = self.ctx.study.objective.metrics[0]
        entry: dict[str, Any] = {"outcome": said, "run_id": report.run_id, "measured": report.metric(metric)
                                 if outcome is Outcome.COMPLETE else None, "error": None,
                                 "noise": report.tput_noise if metric == "tput_tok_s" else None}
        self.outcomes[trial_id] = entry
        if trial_id == self.baseline_id:
            if outcome is not Outcome.COMPLETE:
                self._fall_back(f"the baseline ended {said}: nothing to replay")
            return
        if trial_id not in self.predicted or self.fallback is not None:
            return
        predicted = self.predicted[trial_id]["figures"]
        # stopped early: it provably could not beat the baseline, a prediction that missed
        if outcome is Outcome.PRUNED:
            entry["measured"] = report.metric(metric)
            entry["error"] = relative_error(predicted.get(metric), entry["measured"])
            self._log_launch(trial_id, predicted, entry)
            self._judge(metric)
            self._log_study()
            return
        if outcome is not Outcome.COMPLETE:  # nothing measured (failed launch, refused config): the next best instead
            room = self.ctx.study.budget.max_trials - self.budget
            if room > 0:
                self.budget += 1
                say(f"[simulate-first] {_describe(self.predicted[trial_id]['params'])} ended {said}: "
                    "launching the next predicted config in its place")
            return
        entry["error"] = relative_error(predicted.get(metric), entry["measured"])
        self._log_launch(trial_id, predicted, entry)
        if report.measurement_flag == "disturbed":
            # other work held the CPU in every window it measured: its figure neither judges the predictions nor
            # refits the cost model (either would learn the machine's load, not the config)
            entry["disturbed"] = True
            say(f"[simulate-first] {_describe(self.predicted[trial_id]['params'])}: its measurement was disturbed "
                "in every window: not used to judge or refit the predictions")
            self._log_study()
            return
        self._refit(trial_id)
        self._judge(metric)
        self._log_study()

    def adopt(self, ot_study: Any) -> bool:
        """A resumed study whose baseline (and maybe launches) another driver ran: take them over from the Optuna
        study (their predictions count for the error; their records are not refitted). True if there was one."""
        # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
        from optuna.trial import TrialState

        trials = ot_study.get_trials(deepcopy=False)
        base = next((t for t in trials if t.user_attrs.get(BASELINE_ATTR) and t.state == TrialState.COMPLETE), None)
        if base is None:
            return False
        metric = self.ctx.study.objective.metrics[0]
        self.suggested.append(f"previous-{base.number}")
        self.outcomes[self.suggested[-1]] = {"outcome": Outcome.COMPLETE.value, "run_id": "", "measured": base.value,
                                             "error": None}
        for t in trials:
            figures = t.user_attrs.get(PREDICTION_ATTR)
            if not isinstance(figures, dict) or t.state not in (TrialState.COMPLETE, TrialState.FAIL,
                                                                 TrialState.PRUNED):
                continue
            key = f"previous-{t.number}"
            self.suggested.append(key)
            self.predicted[key] = {"params": dict(t.params), "figures": figures, "cost_launches": 0}
            measured = t.values[0] if t.state == TrialState.COMPLETE and t.values else None
            self.outcomes[key] = {"outcome": t.state.name, "run_id": "", "measured": measured,
                                  "error": relative_error(figures.get(metric), measured)}
        say(f"[simulate-first] resumed: the baseline and {len(self.suggested) - 1} launch(es) ran before")
        return True

    # ------------------------------------------------------------------ building

    def _ready(self) -> bool:
        if self.fallback is not None:
            return False
        if "ranked" in self._cache:
            return True
        try:
            self._build()
        except (Unsimulable, ValueError, OSError) as exc:
            self._fall_back(f"the baseline's answers cannot be replayed: {exc}")
            return False
        return True

    def _fall_back(self, reason: str) -> None:
        self.fallback = reason
        say(f"[simulate-first] falls back to tpe for the rest of the budget: {reason}")

    def _build(self) -> None:
        started = time.monotonic()
        ctx, study = self.ctx, self.ctx.study
        run = baseline_trial(ctx.tracker, ctx.parent_run_id)
        if run is None:
            raise ValueError("no COMPLETE baseline run in MLflow")
        records = run_requests(ctx.tracker, run.run_id, phase=None)
        server_info = run_server_info(ctx.tracker, run.run_id)
        answers = answers_of(records)
        drafts, curve, draft_note = draft_tables(ctx, self.space, answers)
        prefix = prefix_cache_of(server_info)
        simulator = Simulator(answers, ctx.warmup, ctx.measure, arrival=study.workload.arrival,
                              seed=study.seed, corpora=self._corpora, lag=study.search.simulate.lag_rounds,
                              drafts=drafts, prefix=prefix)
        base = base_cost(records, server_info.verify_cost if server_info else None, study.search_concurrency, prefix=prefix,
                         flushed_after_warmup=simulator.flushed_after_warmup)
        if curve is not None:
            base = base.model_copy(update={"draft": curve})
        baseline_config = resolve(self.space, {"algorithm": "none", **baseline_point(self.space)}, study).config
        launched = [(baseline_config, records)]
        self._cache.update(simulator=simulator, base=base, launched=launched)
        self._cache["cost"] = simulator.fitted(base, launched)
        for trial_id in self.suggested[1:]:  # after a restore: the launches that completed since
            self._remember_launch(trial_id)
        settings = study.search.simulate
        explored = explore(self.space, study, self._predict, points=settings.points, seconds=settings.seconds,
                           prepare=lambda configs, deadline: simulator.prepare(configs, deadline=deadline),
                           whole=lambda started, seconds: explore_whole(self.space, study, simulator,
                                                                        self._cache["cost"], self._predict, started,
                                                                        seconds))
        self._cache["explored"] = explored
        self._cache["explore_s"] = explored.seconds
        self._cache["ranked"] = rank(explored.predicted, study)
        self.explored_note = _explored_line(explored, self._cache["cost"], prefix) + draft_note
        # the one-off prediction as a whole: the baseline's records read back, the space replayed and ranked
        self._cache["build_s"] = time.monotonic() - started
        # the cost model's coefficients explain a prediction, not the search: the log file keeps them
        simulated, _, fit = _explored_line(explored, self._cache["cost"], prefix).partition("; step cost: ")
        say(f"[simulate-first] {simulated}{draft_note}")
        detail(f"[simulate-first] step cost: {fit}")

    def _at_levels(self, launch: Predicted) -> dict[str, float]:
        """The launched config's predicted throughput and median e2e at the study's other concurrency levels (where
        its finalist re-runs measure it), as `c<level>_<figure>`."""
        out: dict[str, float] = {}
        for level in self.ctx.study.concurrency[1:]:
            figures = self._predict(launch.config.model_copy(update={"concurrency": level}))
            out.update({f"c{level}_{k}": v for k, v in figures.items() if k in ("tput_tok_s", "e2e_p50_ms")})
        return out

    def _predict(self, config: Any) -> dict[str, float]:
        try:
            return self._cache["simulator"].predict(config, self._cache["cost"])
        except (Unsimulable, ValueError, OSError):
            return {}

    def _corpora(self, trial: Any) -> tuple[SuffixAutomaton, ...]:
        """The corpus a config's engine would load, as the engine loads it (cached per file)."""
        study = self.ctx.study
        folder = Path(self.ctx.output_dir) / "simulate"
        resolved, corpus = corpus_for_trial(trial, self.ctx.warmup, folder, target=study.model.target)
        if corpus is None:
            return ()
        sams = self._cache.setdefault("sams", {})
        if corpus.path not in sams:
            tokenizer = self._cache.get("tokenizer") or target_tokenizer(study.model.target)
            self._cache["tokenizer"] = tokenizer
            spec: NgramSpec = resolved.spec
            sams[corpus.path] = corpus_automaton(corpus.path, lambda text: tokenizer.encode(
                text, add_special_tokens=False), spec.external_corpus_max_tokens)
        return (sams[corpus.path],)

    # ------------------------------------------------------------------ after a launch

    def _remember_launch(self, trial_id: str) -> None:
        entry = self.outcomes.get(trial_id)
        if (entry is None or Outcome.read(entry["outcome"]) is not Outcome.COMPLETE or not entry["run_id"]
                or trial_id not in self.predicted or entry.get("disturbed")):
            return
        config = resolve(self.space, self.predicted[trial_id]["params"], self.ctx.study).config
        records = run_requests(self.ctx.tracker, entry["run_id"], phase=None)
        self._cache["launched"].append((config, records))

    def _refit(self, trial_id: str) -> None:
        if "ranked" not in self._cache:  # after a restore: the build remembers every completed launch
            self._ready()
            return
        self._remember_launch(trial_id)
        cache = self._cache
        cache["cost"] = cache["simulator"].fitted(cache["base"], cache["launched"])
        explored: Explored = cache["explored"]
        if _whole(explored) is not None:  # re-priced from its replays, each class once
            repredicted = explored.whole.predictions(cache["cost"])
        else:
            repredicted = [Predicted(p.params, p.config, self._predict(p.config)) for p in explored.predicted]
        cache["ranked"] = rank(repredicted, self.ctx.study)

    def _judge(self, metric: str) -> None:
        settings = self.ctx.study.search.simulate
        judged = [e for t, e in self.outcomes.items() if t in self.predicted and not e.get("disturbed")]
        median, missed = misses([e["error"] for e in judged], settings.error_threshold,
                                [e.get("noise") for e in judged])
        if median is None:
            return
        room = self.ctx.study.budget.max_trials - self.budget
        if missed and settings.widen_by and room > 0:
            extra = min(settings.widen_by, room)
            self.budget += extra
            self.widened += extra
            say(f"[simulate-first] predictions miss: median |predicted - measured| / measured of {metric} = "
                f"{median:.1%}, beyond the measurements' own noise by more than {settings.error_threshold:.0%}; "
                f"launching {extra} more (now {self.budget} launches)")
        elif missed:
            say(f"[simulate-first] predictions miss: median error {median:.1%} > {settings.error_threshold:.0%}, "
                f"and the budget ({self.ctx.study.budget.max_trials} trials) leaves no launch to add")

    def _log_launch(self, trial_id: str, predicted: dict[str, float], entry: dict[str, Any]) -> None:
        if not entry["run_id"]:
            return
        try:
            levels = self.predicted[trial_id].get("levels") or {}
            metrics = {f"predicted_{k}": float(v) for k, v in {**predicted, **levels}.items()}
            if entry["error"] is not None:
                metrics["prediction_error"] = float(entry["error"])
            self.ctx.tracker.log_figures(entry["run_id"], metrics, tags={
                "simulate.cost_launches": str(self.predicted[trial_id]["cost_launches"])})
        except Exception as exc:  # noqa: BLE001 - bookkeeping must not end the search
            missing(f"the simulate-first prediction of {trial_id} (its run's predicted_* metrics)", exc)
        measured = entry["measured"]
        error = entry["error"]
        metric = self.ctx.study.objective.metrics[0]
        say(f"[simulate-first] {_describe(self.predicted[trial_id]['params'])}: predicted {metric}="
            f"{predicted.get(metric, float('nan')):.2f}, measured "
            + (f"{measured:.2f}" if isinstance(measured, (int, float)) else "-")
            + (f" ({error:.1%} off" if error is not None else "")
            + (f"; the measurement's own noise ±{entry['noise']:.1%})" if error is not None and entry.get("noise")
                 is not None else (")" if error is not None else "")))

    def summary(self) -> dict[str, Any]:
        """Predicted vs measured per launch, the median error, the cost model: what the study run records."""
        metric = self.ctx.study.objective.metrics[0]
        rows = [{"trial_id": t, "params": p["params"], "predicted": p["figures"], **self.outcomes.get(t, {})}
                for t, p in self.predicted.items()]
        judged = [r for r in rows if not r.get("disturbed")]  # each row keeps its own error, disturbed or not
        median, missed = misses([r.get("error") for r in judged], self.ctx.study.search.simulate.error_threshold,
                                [r.get("noise") for r in judged])
        cost: CostModel | None = self._cache.get("cost")
        simulator = self._cache.get("simulator")
        prefix: PrefixCache | None = getattr(simulator, "prefix", None)
        return {"metric": metric, "launches": rows, "median_error": median, "missed": missed,
                "widened": self.widened, "fallback": self.fallback, "explored": self.explored_note,
                "cost_model": cost.model_dump(mode="json") if cost is not None else None,
                "prefix_cache": prefix.model_dump(mode="json") if prefix is not None else None}

    def _log_study(self) -> None:
        summary = self.summary()
        metrics = {"simulate_launches": float(len(self.suggested))}
        if "explore_s" in self._cache:  # the whole space's prediction after the baseline (benchmarks/overhead.py)
            metrics["simulate_explore_s"] = float(self._cache["explore_s"])
        if "build_s" in self._cache:
            metrics["simulate_build_s"] = float(self._cache["build_s"])
        if summary["median_error"] is not None:
            metrics["simulate_median_error"] = float(summary["median_error"])
        texts = {"simulate/predictions.json": json.dumps(summary, indent=2, default=str)}
        if "ranked" in self._cache:  # every point's prediction under the last cost model, best first
            # a space predicted whole has a row per replay class (136,620 for `ngram`): the best `points` of them
            ranked, points = self._cache["ranked"], self.ctx.study.search.simulate.points
            shown = ranked if _whole(self._cache["explored"]) is None else ranked[:points]
            texts[SPACE_PREDICTIONS] = "".join(
                json.dumps({"rank": i, "params": p.params, "predicted": p.figures}, sort_keys=True, default=str) + "\n"
                for i, p in enumerate(shown))
        try:
            self.ctx.tracker.log_figures(self.ctx.parent_run_id, metrics, texts=texts)
        except Exception as exc:  # noqa: BLE001 - bookkeeping must not end the search
            missing(f"the simulate-first predictions (the study run's simulate/predictions.json, {SPACE_PREDICTIONS} "
                    f"and simulate_* metrics)", exc)


def _whole(explored: Any) -> Any:
    """The explored space's whole_space.WholeSpace, None when it was predicted point by point."""
    return getattr(explored, "whole", None)


def _describe(params: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in params.items() if k != "algorithm") or "baseline"


def _explored_line(explored: Explored, cost: CostModel, prefix: PrefixCache | None = None) -> str:
    shape = ("the engine's measured round table" if cost.shape == "measured"
             else f"the prior shape (1 + {cost.alpha} x (rows - 1))")
    tokens = "tokens" if prefix is None else "tokens its prefix cache did not hold"
    capped = not explored.complete and explored.method.startswith("every point")
    return (f"simulated {explored.evaluated} config(s) ({explored.method}"
            f"{f': {len(explored.predicted)} replay classes' if explored.whole is not None else ''}"
            f"{', stopped at the time cap' if capped else ''}) in "
            f"{explored.seconds:.1f} s; step cost: {shape}, k={cost.k:.3g}, o={cost.o_ms:.2f} ms per request-round, "
            f"prefill {cost.p0_ms:.1f} + {cost.p1_ms:.3f} x {tokens} ms, client gap {cost.gap_s * 1000:.1f} ms, "
            f"fitted to {cost.launches} launch(es)")

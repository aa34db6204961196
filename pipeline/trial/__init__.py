"""Trial: one configuration's life on an engine, top to bottom in `lifecycle`: validate, read what it needs of the
baseline trial once (`pipeline.records.trial_runs.read_baseline`), watch for early stopping (`pruning`, over the pure
rule `pipeline.decide.stopping`), measure one pass (`engine_pass`: start (or restart) the engine in the study's
reusable Serve replica (`replicas`), read its settings back, flush, load a corpus when the config names one
(`corpus`), warm up, measure), the passes the study's equivalence mode asks for (`gate`), judge it
(`pipeline.decide.equivalence.judge_pass`), record; what launches cost and share (`launches`); what every trial of a
study shares (`context`: `TrialContext`, its engine kind's `Engine` resolved once). Every ending is an `Outcome` with
its reason and logs: a failed trial is a recorded result, never a crashed study."""

__all__ = ["context", "corpus", "engine_pass", "gate", "launches", "lifecycle", "pruning", "replica_config", "replicas"]

"""Trial: one configuration's life on an engine. Validate, start (or restart) the engine in the study's reusable Serve
replica (`replicas`), read its settings back, flush, load a corpus when the config names one (`corpus`), warm up,
measure (early stopping of a search trial: `pruning`, over the pure rule `pipeline.decide.stopping`), compare with
the baseline by the study's equivalence mode (`gate`), record (`lifecycle`); what launches cost and share
(`launches`); what every trial of a study shares and what one pass measured (`context`: `TrialContext`,
`Measurement`). Every ending is an `Outcome` with its reason and logs:
a failed trial is a recorded result, never a crashed study."""

__all__ = ["context", "corpus", "engine_pass", "gate", "launches", "lifecycle", "pruning", "replica_config", "replicas"]

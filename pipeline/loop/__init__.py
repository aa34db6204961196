"""The closed loop (docs/loop.md): production notices its config went stale, re-tunes on its own traffic and rolls
the result out by canary. One module per job:
- `drift`     the sequential test "the config is no longer what was measured" (pure);
- `shift`     the workload-shift signal: length distributions and n-gram overlap (pure);
- `reference` the study's figures of a registered version (pure core; reads MLflow);
- `split`     a capture -> warm-up / measurement / corpus, no measured answer in the corpus (pure core);
- `seed`      production's config enqueued in the re-tune's study;
- `canary`    the canary decision: promote / roll back / go on (pure);
- `state`     the state file, the one-loop lock, the operator's commands;
- `client`    the endpoint's routes (`serve.closed_loop.live`, `serve.closed_loop.control`);
- `cycle`     the state machine, with its `settings`; `drift_check` the seeded simulation behind the drift test's
  stated rates;
- `retune`    one re-tune on the capture since the promotion, its result registered as alias `candidate`.
`python -m pipeline.loop` runs it; `python -m pipeline.retune` (a thin entry point over `retune`) is its re-tune step
alone.
"""

__all__ = ["canary", "client", "control", "cycle", "drift", "drift_check", "reference", "retune", "seed", "settings",
           "shift", "split", "state"]

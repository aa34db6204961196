"""Study: the driver that composes the stages. Ray + Serve up, the Optuna study (baseline first) run by Ray Tune
(`driver`), what makes a resume safe (`resume`), then the end of a study: finalists re-measured at every concurrency
level (`finalists`), the decision and the promotion action (`finalize`)."""

__all__ = ["driver", "finalists", "finalize", "resume"]

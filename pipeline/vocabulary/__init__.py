"""Vocabulary: the words every stage of a trial's data flow speaks, on the ground floor of `pipeline/` so that search,
records, decisions and the trial itself import them without circles. How a trial ended and what that means
(`outcome`: `Outcome`, `TrialFailure`), what the search hands a trial (`resolution`: `Resolution`), and a recorded
trial as the study's tables, plots and decision read it (`row`: `TrialRow`, built once from its MLflow run by
`pipeline.records.trial_runs`). Nothing here imports a room above it (records, trial, search, study)."""

__all__ = ["outcome", "resolution", "row"]

"""Records: what a study leaves behind. MLflow runs (one experiment per study, a parent run, a child run per trial,
`tracking`), the model registry and its aliases (`registry`), the study report's plots and HTML page (`plots`,
`report`) with the corpus-vs-none table (`corpus_table`), what a served config was tuned on (`provenance`), the
configs' readable names (`labels`), the console lines a study prints (`console`) and the closed loop's cycle runs
(`cycles`). MLflow I/O lives here and nowhere else in the pipeline."""

__all__ = ["console", "corpus_table", "cycles", "labels", "plots", "provenance", "registry", "report", "tracking"]

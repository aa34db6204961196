"""Records: what a study leaves behind. MLflow runs (one experiment per study, a parent run, a child run per trial,
`tracking`), the model registry and its aliases (`registry`), and the study report's plots and HTML page
(`report`). MLflow I/O lives here and nowhere else in the pipeline."""

__all__ = ["registry", "report", "tracking"]

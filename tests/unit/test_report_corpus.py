"""The report's corpus plot: NGRAM trials grouped by their external corpus, `none` first, means per group."""

from pipeline.records.plots import corpus_label, figure, plot_corpus_vs_accept
from pipeline.records.report import write_report
from pipeline.vocabulary.outcome import Outcome
from tests.rows import trial_row


def _row(name, corpus, accept, tput, algorithm="ngram"):
    return trial_row(name, algorithm, params={"spec.external_corpus": str(corpus), "spec.num_draft_tokens": "8"},
                     tput_tok_s=tput, tput_ci_low=tput, tput_ci_high=tput, accept_len=accept, ttft_p50_ms=1.0)


def test_corpus_plot_shows_none_first_and_group_means(tmp_path):
    rows = [_row("t1", "/x/corpora/warmup-abc.jsonl", 3.0, 30.0), _row("t2", None, 1.5, 20.0),
            _row("t3", "/x/corpora/warmup-abc.jsonl", 2.0, 26.0), _row("t0", None, 1.0, 25.0, algorithm="none")]
    fig, ax = figure()
    assert plot_corpus_vs_accept(ax, rows)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["none", "warmup-abc"]
    assert [round(p.get_height(), 2) for p in ax.patches] == [1.5, 2.5]  # the baseline is not an NGRAM trial
    assert "28.0 tok/s\n2 trial(s)" in [t.get_text() for t in ax.texts]
    names = {p.name for p in write_report(tmp_path, title="t", rows=rows, decision="d")}
    assert "corpus_vs_accept.png" in names


def test_no_corpus_plot_for_a_study_that_searched_no_corpus():
    fig, ax = figure()
    assert not plot_corpus_vs_accept(ax, [_row("t2", None, 1.5, 20.0), _row("t0", None, 1.0, 25.0, "none")])


def test_corpus_labels():
    assert corpus_label(None) == corpus_label("None") == "none"
    assert corpus_label("/data/support-tickets.jsonl") == "support-tickets"


def _ngram(name, corpus, draft, tput, accept, budget=None, load_s=None, outcome=Outcome.COMPLETE):
    params = {"spec.num_draft_tokens": str(draft), "trial.warmup_requests": "8" if name == "c" else "0"}
    if corpus is not None:
        params.update({"spec.external_corpus": corpus, "spec.external_sam_budget": str(budget)})
    return trial_row(name, outcome=outcome, params=params, vs_baseline=round(tput / 20.0, 4), tput_tok_s=tput,
                     tput_ci_low=tput, tput_ci_high=tput, accept_len=accept, ttft_p50_ms=1.0, corpus_load_s=load_s)


def test_corpus_comparison_takes_the_best_trial_per_corpus_at_equal_draft_tokens():
    from pipeline.records.corpus_table import corpus_comparison

    rows = [_ngram("a", "warmup", 8, 30.0, 2.5, budget=2, load_s=0.4), _ngram("b", None, 8, 25.0, 1.9),
            _ngram("c", "warmup", 8, 33.0, 2.1, budget=3, load_s=0.5), _ngram("d", None, 4, 40.0, 1.7),
            _ngram("e", None, 8, 99.0, 3.0, outcome=Outcome.NOT_EQUIVALENT), _row("base", None, 1.0, 20.0, "none")]
    cells = corpus_comparison(rows)
    assert [(c.draft_tokens, c.corpus, c.trials, c.best) for c in cells] == [
        (4, "none", 1, "d"), (8, "none", 1, "b"), (8, "warmup", 2, "c")]
    warm = cells[2]
    assert (warm.tput_tok_s, warm.accept_len, warm.sam_budget, warm.warmup_requests, warm.load_s,
            warm.vs_baseline) == (33.0, 2.1, 3, 8, 0.5, 1.65)


def test_corpus_table_is_only_in_reports_of_studies_that_searched_a_corpus(tmp_path):
    from pipeline.records.corpus_table import corpus_comparison, format_corpus_table

    without = [_ngram("a", None, 8, 25.0, 1.9), _ngram("b", None, 6, 24.0, 1.8)]
    assert corpus_comparison(without) == []
    write_report(tmp_path / "plain", title="t", rows=without, decision="d")
    assert "External corpus vs none" not in (tmp_path / "plain" / "report.html").read_text()

    rows = [*without, _ngram("c", "warmup", 8, 30.0, 2.5, budget=2, load_s=0.25)]
    table = format_corpus_table(corpus_comparison(rows))
    lines = table.splitlines()
    assert "warmup" in lines[3] and "30.00" in lines[3] and "2.50" in lines[3] and "0.25" in lines[3]
    assert "no other corpus setting" in lines[1] and "no other corpus setting" not in lines[3]
    write_report(tmp_path / "corpus", title="t", rows=rows, decision="d")
    page = (tmp_path / "corpus" / "report.html").read_text()
    assert "External corpus vs none (at equal draft tokens)" in page and "30.00" in page

"""The report's corpus plot: NGRAM trials grouped by their external corpus, `none` first, means per group."""

from pipeline.report import _figure, corpus_label, plot_corpus_vs_accept, write_report


def _row(name, corpus, accept, tput, algorithm="ngram"):
    return {"name": name, "algorithm": algorithm, "outcome": "COMPLETE", "reason": "", "tput_tok_s": tput,
            "tput_ci_low": tput, "tput_ci_high": tput, "accept_len": accept, "ttft_p50_ms": 1.0,
            "params": {"spec.external_corpus": str(corpus)}, "baseline": algorithm == "none", "vs_baseline": None}


def test_corpus_plot_shows_none_first_and_group_means(tmp_path):
    rows = [_row("t1", "/x/corpora/warmup-abc.jsonl", 3.0, 30.0), _row("t2", None, 1.5, 20.0),
            _row("t3", "/x/corpora/warmup-abc.jsonl", 2.0, 26.0), _row("t0", None, 1.0, 25.0, algorithm="none")]
    fig, ax = _figure()
    plot_corpus_vs_accept(ax, rows)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["none", "warmup-abc"]
    assert [round(p.get_height(), 2) for p in ax.patches] == [1.5, 2.5]  # the baseline is not an NGRAM trial
    assert "28.0 tok/s\n2 trial(s)" in [t.get_text() for t in ax.texts]
    names = {p.name for p in write_report(tmp_path, title="t", rows=rows, decision="d")}
    assert "corpus_vs_accept.png" in names


def test_corpus_labels():
    assert corpus_label(None) == corpus_label("None") == "none"
    assert corpus_label("/data/support-tickets.jsonl") == "support-tickets"

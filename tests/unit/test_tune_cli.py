"""The CLI surface: --help documents every option, --dry-run works per bundled space, bad input exits non-zero."""

import subprocess
import sys

import pytest

from pipeline.config import SEARCH_SPACES_DIR
from pipeline.tune import build_parser, main


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"


@pytest.mark.parametrize("path", sorted(SEARCH_SPACES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_dry_run_exits_zero_for_every_bundled_space(path, capsys):
    assert main(["--dry-run", "--samples", "4", "--search-space", path.name]) == 0
    out = capsys.readouterr().out
    assert "# resolved study" in out and "#0   VALID    none" in out


def test_dry_run_misspelled_space_key_exits_non_zero_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n    max_trie_dept: {type: int, low: 2, high: 8}\n")
    assert main(["--dry-run", "--search-space", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "branches.ngram.max_trie_dept" in err and "max_trie_depth" in err


def test_overrides_reach_the_resolved_study(tmp_path, capsys):
    study = tmp_path / "s.yaml"
    study.write_text("name: from-file\nbudget: {max_trials: 20}\n")
    assert main(["--dry-run", "--samples", "1", "--study", str(study), "--trials", "4",
                 "--set", "promotion.margin=0.1", "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "name: from-file" in out and "max_trials: 4" in out and "margin: 0.1" in out
    assert f"output_dir: {tmp_path / 'out'}" in out


def test_bad_set_syntax_is_reported(capsys):
    assert main(["--dry-run", "--set", "nonsense"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_dry_run_starts_no_ray():
    # A separate interpreter: the dry run must not even import ray or mlflow.
    code = ("import sys; from pipeline.tune import main; rc = main(['--dry-run', '--samples', '2']); "
            "assert 'ray' not in sys.modules and 'mlflow' not in sys.modules and 'torch' not in sys.modules; "
            "sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

"""The suite's file order under `-n 2 --dist loadfile` (tests/conftest.py): tiers in order, and within one the long
files first, each followed by a short one, never two long ones in a row (xdist queues the next file behind a
running one-test file on the same worker)."""

from __future__ import annotations

from tests.conftest import run_order


def test_long_files_lead_their_tier_each_followed_by_a_short_one():
    tiers = [["unit/a.py", "unit/b.py"], ["it/x.py", "it/slow2.py", "it/y.py", "it/slow1.py", "it/z.py"], []]
    order = run_order(tiers, ("slow1.py", "slow2.py"))
    assert order == ["unit/a.py", "unit/b.py", "it/slow1.py", "it/x.py", "it/slow2.py", "it/y.py", "it/z.py"]


def test_more_long_files_than_short_ones_keeps_every_file_once():
    order = run_order([["it/s1.py", "it/x.py", "it/s2.py", "it/s3.py"]], ("s1.py", "s2.py", "s3.py"))
    assert order == ["it/s1.py", "it/x.py", "it/s2.py", "it/s3.py"]


def test_a_run_names_the_tiers_its_paths_did_not_reach(tmp_path):
    from tests.conftest import left_out_tiers

    for tier, files in (("engines", 2), ("end_to_end", 3), ("integration", 1)):
        (tmp_path / "tests" / tier).mkdir(parents=True)
        for i in range(files):
            (tmp_path / "tests" / tier / f"test_{i}.py").write_text("")
    default = ["tests/unit", "tests/model", "tests/integration", "tests/gpu"]
    assert left_out_tiers(tmp_path, default) == {"engines": 2, "end_to_end": 3}
    assert left_out_tiers(tmp_path, ["tests"]) == {}
    assert left_out_tiers(tmp_path, [*default, "tests/engines/test_0.py::test_x"]) == {"end_to_end": 3}

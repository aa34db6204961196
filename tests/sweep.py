"""A seed sweep as one test: every seed runs, and a failure names the seeds that failed.

Hundreds of parametrized seed copies would count as hundreds of tests (and hundreds of skips where the sweep cannot
run) while checking one property; `sweep` keeps the count honest and still says which seed to look at."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable

import pytest

__all__ = ["sweep"]


def sweep(check: Callable[[int], None], seeds: Iterable[int]) -> int:
    """Call `check(seed)` for every seed (all of them, also after a failure); fail the test naming every failing seed
    with the first failure's message and traceback. Returns how many seeds ran. `check` failing with any exception
    (an assertion, a crashed oracle, a short output) counts as that seed failing."""
    failed: list[tuple[int, BaseException]] = []
    ran = 0
    for seed in seeds:
        ran += 1
        try:
            check(seed)
        except Exception as err:  # every kind of failure belongs to its seed; the test fails below with all of them
            failed.append((seed, err))
    if failed:
        seed, first = failed[0]
        shown = "".join(traceback.format_exception(first)).rstrip()
        pytest.fail(f"{len(failed)} of {ran} seeds failed: {[s for s, _ in failed]}\n"
                    f"first failing seed {seed}:\n{shown}", pytrace=False)
    return ran

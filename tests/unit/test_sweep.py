"""The seed-sweep helper the parity tests use: one test, every seed run, the failing seeds named."""

import pytest

from tests.sweep import sweep


def test_every_seed_runs_and_the_failing_ones_are_named_with_the_first_failure():
    ran: list[int] = []

    def check(seed: int) -> None:
        ran.append(seed)
        if seed in (3, 7):
            raise AssertionError(f"draft differs at seed {seed}")
        if seed == 5:
            raise IndexError("oracle output too short")

    with pytest.raises(pytest.fail.Exception) as failed:
        sweep(check, range(10))
    assert ran == list(range(10))  # a failure does not end the sweep
    message = str(failed.value)
    assert "3 of 10 seeds failed: [3, 5, 7]" in message
    assert "first failing seed 3:" in message and "draft differs at seed 3" in message
    assert "oracle output too short" not in message  # only the first failure's traceback is shown


def test_a_sweep_that_passes_says_how_many_seeds_ran():
    assert sweep(lambda seed: None, range(5, 9)) == 4

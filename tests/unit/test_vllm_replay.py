"""The replay of vLLM's n-gram proposer (pipeline/simulate/vllm_ngram.py) and the per-batch-size export
(serve/engines/vllm/dynamic.py), without vLLM. Their agreement with vLLM itself is tests/engines/test_vllm_engine.py."""

import pytest

from pipeline.simulate.vllm_ngram import propose, replay_request
from serve.engines.vllm.dynamic import per_batch_size, with_per_batch_size


def test_the_proposer_matches_vllms_own_example_and_edges():
    # vLLM's docstring: the last 3 tokens [4, 2, 3] match nothing earlier, [2, 3] does, and 3 tokens follow it
    assert propose([1, 2, 3, 4, 2, 3], 2, 3, 100, 4) == [4, 2, 3]
    assert propose([1, 2, 3, 4, 2, 3], 3, 3, 100, 4) == []  # no 3-gram repeats
    assert propose([1, 2], 3, 3, 100, 4) == []  # shorter than min_ngram
    assert propose([1, 2, 3, 4, 2, 3], 2, 3, 7, 4) == [4]  # never past max_model_len
    # among equally long matches the earliest occurrence drafts
    assert propose([5, 9, 1, 5, 9, 2, 5, 9], 2, 2, 100, 1) == [1]


def test_the_replay_walks_the_answer_and_counts_only_steps_with_a_draft():
    prompt = [1, 2, 3, 4, 1, 2]
    answer = [3, 4, 1, 2, 3, 4, 7]
    drafts = replay_request(prompt, answer, len(answer), 3, 2, 2, 1000)
    # after [.., 1, 2, 3] the suffix [2, 3] drafts [4, 1, 2]: all accepted, then the target's own 3
    assert drafts.steps[0] == (3, 3)
    assert drafts.num_accepted_tokens <= drafts.num_draft_tokens and drafts.num_spec_steps == len(drafts.steps)
    with pytest.raises(ValueError, match="fewer than"):
        replay_request(prompt, answer[:3], 5, 3, 2, 2, 1000)


def test_a_longer_continuation_makes_the_last_step_exact():
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    known = replay_request(prompt, [3, 1, 2], 3, 3, 2, 2, 1000)
    longer = replay_request(prompt, [3, 1, 2, 3, 1], 3, 3, 2, 2, 1000)
    assert known.steps == ((3, 2),) and longer.steps == ((3, 3),)  # vLLM accepts past the answer's end


def test_per_concurrency_decisions_become_vllms_batch_size_table():
    assert per_batch_size({1: 5, 8: 0}, 16) == [[1, 7, 5], [8, 16, 0]]
    assert per_batch_size({2: 3, 4: 3, 8: 1}, 8) == [[1, 7, 3], [8, 8, 1]]  # below the first level: its K
    config = with_per_batch_size({"method": "ngram", "num_speculative_tokens": 2}, {1: 4, 4: 0}, 4)
    assert config["num_speculative_tokens"] == 4 and config["num_speculative_tokens_per_batch_size"] == [
        [1, 3, 4], [4, 4, 0]]
    with pytest.raises(ValueError, match="max-num-seqs >= 8"):
        per_batch_size({8: 1}, 4)
    with pytest.raises(ValueError, match="K >= 0"):
        per_batch_size({1: -1}, 4)

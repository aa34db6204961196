"""Parity of `NgramCache` with SGLang 0.5.23's own C++ trie, compiled from the wheel's sources at test time
(see tests/unit/sglang_ngram_oracle.py for where the sources come from; skipped without them or g++).

This file drives `Trie` alone with a fresh `MatchState` per query (`NgramCache.draft` without a state): insert,
draft, eviction and reset on random single-sequence scenarios. test_ngram_schedule_parity.py drives the whole
`Ngram` object with several requests on the engine's schedule.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from serve.ngram.compiled import CompiledNgramCache, CompiledUnavailable, library
from serve.ngram.trie import DraftTree, NgramCache
from tests.sweep import sweep
from tests.unit.sglang_ngram_oracle import compile_harness, tree_paths as _tree_paths

_HARNESS = r"""
// Standard headers first: the private->public define below must only reach SGLang's trie.h.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <list>
#include <memory>
#include <new>
#include <queue>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>
#define private public
#include "trie.h"
#undef private

using namespace sglang::ngram;

static void dump(const TrieNode* node, std::vector<int32_t>& path) {
  for (auto& [tok, child] : node->child) {
    path.push_back(tok);
    std::cout << "P";
    for (auto t : path) std::cout << ' ' << t;
    std::cout << '\n';
    dump(child, path);
    path.pop_back();
  }
}

int main() {
  std::ios::sync_with_stdio(false);
  std::unique_ptr<Trie> trie;
  Param param{};
  size_t capacity = 0;
  std::string op;
  while (std::cin >> op) {
    if (op == "C") {
      int prob;
      std::cin >> capacity >> param.max_trie_depth >> param.min_bfs_breadth >> param.max_bfs_breadth >> prob
          >> param.draft_token_num;
      param.match_type = prob ? "PROB" : "BFS";
      trie = std::make_unique<Trie>(capacity, param);
    } else if (op == "I" || op == "Q") {
      size_t n;
      std::cin >> n;
      std::vector<int32_t> toks(n);
      for (auto& t : toks) std::cin >> t;
      if (op == "I") {
        trie->insert(toks.data(), toks.size());
        continue;
      }
      MatchState state;  // fresh: match recomputed from the context
      auto build = param.match_type == "PROB" ? &Trie::buildFrequency : &Trie::buildRecency;
      auto res = (trie.get()->*build)(toks.data(), n, toks.back(), param.draft_token_num - 1, param, state, n);
      int m = res.token.size();
      std::cout << "D";
      for (int i = 1; i < m; ++i) {
        int parent = 0;
        for (int j = i - 1; j >= 0; --j) {
          if (res.mask[i * m + j]) { parent = j; break; }
        }
        std::cout << ' ' << res.token[i] << ':' << parent - 1;
      }
      std::cout << '\n';
    } else if (op == "X") {
      trie->reset();
    } else if (op == "N") {
      std::cout << "N " << (capacity - trie->free_node_count_ - 1) << '\n';
      std::vector<int32_t> path;
      dump(trie->root_, path);
      std::cout << "E\n";
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    return compile_harness(tmp_path_factory.mktemp("ngram_oracle"), _HARNESS, ["trie.cpp", "result.cpp"])


def _ours_trie_paths(cache: NgramCache) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    root: tuple[int, ...] = ()
    stack = [(root, cache._root)]
    while stack:
        prefix, node = stack.pop()
        for tok, child in node.children.items():
            out.add(prefix + (tok,))
            stack.append((prefix + (tok,), child))
    return out


def _scenario(rng: random.Random) -> tuple[dict, list[tuple]]:
    depth = rng.choice([2, 3, 4, 5, 8, 18])
    min_b = rng.randint(1, 3)
    cfg = dict(
        max_trie_depth=depth,
        capacity=rng.choice([depth + 1, depth + 3, 30, 100, 100_000]),
        min_bfs_breadth=min_b,
        max_bfs_breadth=rng.randint(min_b, 10),
        match_type=rng.choice(["BFS", "PROB"]),
        num_draft_tokens=rng.choice([1, 2, 4, 8, 12, 24, 40]),
    )
    vocab = rng.choice([3, 5, 8, 16, 40])  # small vocabularies force shared prefixes and frequency ties
    history: list[list[int]] = []
    ops: list[tuple] = []
    # Half the scenarios fan out from a few shared stems: wide nodes where the breadth formula and ties decide.
    stems = [[rng.randrange(vocab) for _ in range(rng.randint(1, depth))] for _ in range(3)]
    fan = rng.random() < 0.5
    for _ in range(rng.randint(20, 120)):
        r = rng.random()
        if r < 0.45:
            seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
            if fan:
                seq = rng.choice(stems) + seq[: rng.randint(1, 4)]
            if history and rng.random() < 0.5:  # continue an earlier sequence, like a decode loop
                seq = history[rng.randrange(len(history))] + seq
            history.append(seq)
            ops.append(("I", seq))
        elif r < 0.93:
            if history and rng.random() < 0.7:
                base = history[rng.randrange(len(history))]
                ctx = base[: rng.randint(1, len(base))]
            elif fan:
                stem = rng.choice(stems)
                ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))] + stem[rng.randrange(len(stem)) :]
            else:
                ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
            ops.append(("Q", ctx))
        elif r < 0.96:
            ops.append(("X",))
        else:
            ops.append(("N",))
    ops.append(("N",))
    return cfg, ops


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_matches_sglang_cpp_trie(harness: Path, compiled: bool) -> None:
    if compiled:
        try:
            library()
        except CompiledUnavailable as exc:
            pytest.skip(f"the compiled trie does not build here: {exc}")
    sweep(lambda seed: _check_scenario(harness, seed, compiled), range(200))


def _check_scenario(harness: Path, seed: int, compiled: bool) -> None:
    cfg, ops = _scenario(random.Random(seed))
    ours = CompiledNgramCache(**cfg) if compiled else NgramCache(**cfg)
    lines = [f"C {cfg['capacity']} {cfg['max_trie_depth']} {cfg['min_bfs_breadth']} {cfg['max_bfs_breadth']} "
             f"{int(cfg['match_type'] == 'PROB')} {cfg['num_draft_tokens']}"]
    expected: list = []
    for op in ops:
        if op[0] == "I":
            # SGLang's worker hands the trie only the last max_trie_depth tokens; NgramCache cuts the window itself.
            window = op[1][-cfg["max_trie_depth"]:]
            lines.append(f"I {len(window)} " + " ".join(map(str, window)))
            ours.insert(op[1])
        elif op[0] == "Q":
            window = op[1][-cfg["max_trie_depth"]:]
            lines.append(f"Q {len(window)} " + " ".join(map(str, window)))
            tree = ours.draft(op[1])
            assert isinstance(tree, DraftTree) and len(tree.tokens) == cfg["num_draft_tokens"] - 1
            expected.append(("D", op[1], _tree_paths(tree.tokens, tree.parents)))
        elif op[0] == "X":
            lines.append("X")
            ours.reset()
        else:
            lines.append("N")
            # the compiled trie's nodes are not reachable from Python: its count, and its drafts above, are compared
            expected.append(("N", ours.num_nodes, None if compiled else _ours_trie_paths(ours)))
    out = subprocess.run([str(harness)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    pos = 0
    for kind, *payload in expected:
        if kind == "D":
            fields = out[pos].split()[1:]
            pos += 1
            pairs = [tuple(map(int, f.split(":"))) for f in fields]
            theirs = _tree_paths([p[0] for p in pairs], [p[1] for p in pairs])
            assert payload[1] == theirs, f"draft differs for context {payload[0]} under {cfg}"
        else:
            count = int(out[pos].split()[1])
            pos += 1
            paths = set()
            while out[pos] != "E":
                paths.add(tuple(map(int, out[pos].split()[1:])))
                pos += 1
            pos += 1
            assert payload[0] == count, f"node count differs under {cfg}"
            assert payload[1] is None or payload[1] == paths, f"trie contents differ under {cfg}"
    assert pos == len(out)

"""Parity of `NgramCache` with SGLang 0.5.23's own C++ trie, compiled from the wheel's sources at test time.

Runs where the sources can be found: `SGLANG_NGRAM_SRC` (the `ngram_corpus` folder holding trie.cpp), or an
installed sglang package. Skipped otherwise, and when g++ is missing. No SGLang code is kept in this repository: the
harness below only includes the wheel's headers and drives `Trie` the way `Ngram::batchMatch` does with a fresh
`MatchState` (i.e. recomputing the match from the context, which is NgramCache's contract).

To get the sources: `pip download --no-deps sglang==0.5.23 -d /tmp/sgl && cd /tmp/sgl && unzip -q sglang-*.whl
'sglang/kernels/jit/csrc/ngram_corpus/*'`, then `SGLANG_NGRAM_SRC=/tmp/sgl/sglang/kernels/jit/csrc/ngram_corpus`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import random
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from serve.engines.cpu.ngram import DraftTree, NgramCache

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


def _source_dir() -> Path | None:
    env = os.environ.get("SGLANG_NGRAM_SRC")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None
    if version != "0.5.23":  # the harness uses 0.5.23's Trie internals, and 0.5.23 is the semantics we promise
        pytest.skip(f"installed sglang is {version}, the parity oracle needs 0.5.23 (or set SGLANG_NGRAM_SRC)")
    return Path(next(iter(spec.submodule_search_locations))) / "kernels" / "jit" / "csrc" / "ngram_corpus"


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    src = _source_dir()
    if src is None or not (src / "trie.cpp").is_file():
        pytest.skip("SGLang's ngram_corpus C++ sources not found (set SGLANG_NGRAM_SRC or install sglang==0.5.23)")
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    build = tmp_path_factory.mktemp("ngram_oracle")
    (build / "harness.cpp").write_text(_HARNESS)
    exe = build / "harness"
    # Same language level and optimisation as SGLang's JIT build (DEFAULT_CFLAGS), no -march: no FMA contraction.
    cmd = ["g++", "-std=c++20", "-O3", f"-I{src}", str(build / "harness.cpp"), str(src / "trie.cpp"),
           str(src / "result.cpp"), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return exe


def _tree_paths(tokens, parents) -> Counter:
    """Multiset of root-to-node token paths: equal for equal trees whatever the sibling order."""
    paths: list[tuple[int, ...]] = []
    for tok, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
    return Counter(paths)


def _ours_trie_paths(cache: NgramCache) -> set[tuple[int, ...]]:
    out = set()
    stack = [((), cache._root)]
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


@pytest.mark.parametrize("seed", range(200))
def test_matches_sglang_cpp_trie(harness: Path, seed: int) -> None:
    cfg, ops = _scenario(random.Random(seed))
    ours = NgramCache(**cfg)
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
            expected.append(("N", ours.num_nodes, _ours_trie_paths(ours)))
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
            assert payload[1] == paths, f"trie contents differ under {cfg}"
    assert pos == len(out)

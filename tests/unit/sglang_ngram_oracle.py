"""SGLang 0.5.23's NGRAM C++ (`sglang/kernels/jit/csrc/ngram_corpus`), compiled at test time as a parity oracle.

The sources come from `SGLANG_NGRAM_SRC` (the `ngram_corpus` folder holding trie.cpp), else an installed sglang==0.5.23:
this interpreter's, else the SGLang CPU venv's (`bash infra/install-sglang-cpu.sh`). Tests that need them are skipped
otherwise, and when g++ is missing, with the command that enables them. No SGLang code is kept in this repository: the
harnesses only include the wheel's headers and drive its classes.

To get the sources: `pip download --no-deps sglang==0.5.23 -d /tmp/sgl && cd /tmp/sgl && unzip -q sglang-*.whl
'sglang/kernels/jit/csrc/ngram_corpus/*'`, then `SGLANG_NGRAM_SRC=/tmp/sgl/sglang/kernels/jit/csrc/ngram_corpus`.

`NGRAM_HARNESS` drives the whole `Ngram` object the way `NGRAMWorker` does (one line per command on stdin):
  C capacity max_trie_depth min_bfs max_bfs prob(0/1) draft_token_num external_sam_budget
  M k  then k times: state_id total_len n tok...   -> synchronize(); batchMatch; one "D tok:parent ..." line per
                                                      request (parent -1 = the root; pads included)
  I k  then k times: n tok...                       -> asyncInsert (lands before the next M or N, as in SGLang)
  E k state_id...                                   -> eraseMatchState
  X                                                 -> reset (trie and match states; corpora stay)
  N                                                 -> synchronize; "N count", one "P tok..." per trie path, "E"
  L corpus_id n tok...                              -> start/append/finishExternalCorpusLoad; "OK" or "ERR message"
  V corpus_id                                       -> removeExternalCorpus
  Q                                                 -> "Q count", one "S corpus_id token_count" per corpus
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

NGRAM_HARNESS = r"""
// Standard headers first: the private->public define below must only reach SGLang's own headers.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <new>
#include <queue>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>
#define private public
#include "ngram.h"
#undef private

using namespace sglang::ngram;

// Ngram::trie_ is private by default (before any `private:`), which the define cannot reach: take it the standard
// way, through an explicit instantiation (which may name private members).
template <typename Tag, typename Tag::type Member>
struct Expose {
  friend typename Tag::type get(Tag) { return Member; }
};
struct NgramTrie {
  using type = std::unique_ptr<Trie> Ngram::*;
  friend type get(NgramTrie);
};
template struct Expose<NgramTrie, &Ngram::trie_>;

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

static std::vector<int32_t> read_tokens() {
  size_t n;
  std::cin >> n;
  std::vector<int32_t> toks(n);
  for (auto& t : toks) std::cin >> t;
  return toks;
}

int main() {
  std::ios::sync_with_stdio(false);
  std::unique_ptr<Ngram> ngram;
  size_t capacity = 0;
  size_t draft = 0;
  std::string op;
  while (std::cin >> op) {
    if (op == "C") {
      Param param{};
      int prob;
      std::cin >> capacity >> param.max_trie_depth >> param.min_bfs_breadth >> param.max_bfs_breadth >> prob
          >> param.draft_token_num >> param.external_sam_budget;
      param.enable = true;
      param.match_type = prob ? "PROB" : "BFS";
      draft = param.draft_token_num;
      ngram = std::make_unique<Ngram>(capacity, param);
    } else if (op == "M") {
      size_t k;
      std::cin >> k;
      std::vector<int64_t> ids(k);
      std::vector<std::vector<int32_t>> toks(k);
      std::vector<size_t> totals(k);
      for (size_t i = 0; i < k; ++i) {
        std::cin >> ids[i] >> totals[i];
        toks[i] = read_tokens();
      }
      ngram->synchronize();
      auto res = ngram->batchMatch(ids, toks, totals);
      const size_t n = draft;
      for (size_t b = 0; b < k; ++b) {
        std::cout << "D";
        for (size_t i = 1; i < n; ++i) {
          int parent = 0;
          for (int j = int(i) - 1; j >= 0; --j) {
            if (res.mask[b * n * n + i * n + j]) { parent = j; break; }
          }
          std::cout << ' ' << res.token[b * n + i] << ':' << parent - 1;
        }
        std::cout << '\n';
      }
    } else if (op == "I") {
      size_t k;
      std::cin >> k;
      std::vector<std::vector<int32_t>> toks(k);
      for (auto& t : toks) t = read_tokens();
      ngram->asyncInsert(std::move(toks));
    } else if (op == "E") {
      size_t k;
      std::cin >> k;
      std::vector<int64_t> ids(k);
      for (auto& id : ids) std::cin >> id;
      ngram->eraseMatchState(ids);
    } else if (op == "X") {
      ngram->synchronize();
      ngram->reset();
    } else if (op == "N") {
      ngram->synchronize();
      const auto& trie = (*ngram).*get(NgramTrie());
      std::cout << "N " << (capacity - trie->free_node_count_ - 1) << '\n';
      std::vector<int32_t> path;
      dump(trie->root_, path);
      std::cout << "E\n";
    } else if (op == "L") {
      std::string id;
      std::cin >> id;
      auto toks = read_tokens();
      try {
        ngram->startExternalCorpusLoad();
        ngram->appendExternalCorpusTokens(toks);
        ngram->finishExternalCorpusLoad(id);
        std::cout << "OK\n";
      } catch (const std::exception& err) {
        ngram->resetStagingSam();
        std::cout << "ERR " << err.what() << '\n';
      }
    } else if (op == "Q") {
      auto entries = ngram->listExternalCorpora();
      std::cout << "Q " << entries.size() << '\n';
      for (auto& [id, count] : entries) std::cout << "S " << id << ' ' << count << '\n';
    } else if (op == "V") {
      std::string id;
      std::cin >> id;
      ngram->removeExternalCorpus(id);
    }
  }
  return 0;
}
"""


# What installs the sources where `source_dir` looks (named in the skip reason, so a run says how to enable it).
ENABLE = "bash infra/install-sglang-cpu.sh"
_NGRAM_SRC = ("kernels", "jit", "csrc", "ngram_corpus")


def _installed_sglang() -> tuple[Path, str] | None:
    """(package dir, version) of sglang in this interpreter, else in the SGLang CPU venv (`serve.engines.sglang.cpu`)."""
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        try:
            return Path(next(iter(spec.submodule_search_locations))), importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        from serve.engines.sglang.cpu import venv_dir
    except ImportError:  # a tree without the SGLang CPU runtime
        return None
    for info in sorted(venv_dir().glob("lib/python3*/site-packages/sglang-*.dist-info")):
        package = info.parent / "sglang"
        if package.is_dir():
            return package, info.name.removeprefix("sglang-").removesuffix(".dist-info")
    return None


def source_dir() -> Path | None:
    env = os.environ.get("SGLANG_NGRAM_SRC")
    if env:
        return Path(env)
    found = _installed_sglang()
    if found is None:
        return None
    package, version = found
    if version != "0.5.23":  # the harnesses use 0.5.23's internals, and 0.5.23 is the semantics we promise
        pytest.skip(f"installed sglang is {version}, the parity oracle needs 0.5.23: {ENABLE} "
                    "(or set SGLANG_NGRAM_SRC)")
    return package.joinpath(*_NGRAM_SRC)


def compile_harness(build: Path, source: str, units: list[str]) -> Path:
    """Compile `source` against the wheel's ngram_corpus sources `units` (e.g. ["trie.cpp"]); skip if impossible."""
    src = source_dir()
    if src is None or not (src / "trie.cpp").is_file():
        pytest.skip(f"SGLang-parity tests need SGLang 0.5.23's ngram_corpus C++ sources: {ENABLE} "
                    "(or set SGLANG_NGRAM_SRC)")
    if shutil.which("g++") is None:
        pytest.skip("SGLang-parity tests compile SGLang's C++ with g++, not on PATH: apt-get install g++")
    (build / "harness.cpp").write_text(source)
    exe = build / "harness"
    # Same language level and optimisation as SGLang's JIT build (DEFAULT_CFLAGS), no -march: no FMA contraction.
    cmd = ["g++", "-std=c++20", "-O3", "-pthread", f"-I{src}", str(build / "harness.cpp"),
           *(str(src / unit) for unit in units), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the SGLang oracle failed: {' '.join(cmd)}\n{done.stderr[-4000:]}")
    return exe


def run(exe: Path, lines: list[str]) -> list[str]:
    return subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120,
                          check=True).stdout.splitlines()


def tree_paths(tokens, parents) -> Counter:
    """Multiset of root-to-node token paths: equal for equal trees whatever the sibling order."""
    paths: list[tuple[int, ...]] = []
    for tok, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
    return Counter(paths)


def parse_draft(line: str) -> tuple[list[int], list[int]]:
    """A harness "D tok:parent ..." line as (tokens, parents)."""
    pairs = [tuple(map(int, f.split(":"))) for f in line.split()[1:]]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def parse_trie(out: list[str], pos: int) -> tuple[int, set[tuple[int, ...]], int]:
    """An "N" block starting at out[pos]: (node count, trie paths, position after the block)."""
    count = int(out[pos].split()[1])
    pos += 1
    paths = set()
    while out[pos] != "E":
        paths.add(tuple(map(int, out[pos].split()[1:])))
        pos += 1
    return count, paths, pos + 1

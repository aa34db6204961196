// serve/ngram/trie.py's NgramCache in C++, for the acceptance simulator's replays (pipeline/simulate/replay.py
// replays every config of a space through the trie; in Python that is most of a study's one-off prediction).
// Same semantics, decision for decision: suffix inserts with touch stamps, eviction of the least recently touched
// node (always a leaf), per-request match states advanced or rebuilt as SGLang 0.5.23's Trie::match does, BFS and
// PROB tree building (PROB's ties pop in std::priority_queue's order, the order SGLang's own build gets from the same
// standard library). trie.py's docstring is the specification; tests/unit/test_ngram_compiled.py drives both with
// the same random streams and compares every tree.
//
// A plain C ABI for ctypes (serve/ngram/compiled.py): no Python headers, so it builds in a few seconds with g++.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kShift = int64_t(1) << 32;  // PROB rank key: token - freq * kShift sorts (freq desc, token asc)
constexpr int64_t kTokenMask = kShift - 1;

uint64_t next_epoch() {  // unique over every cache of the process: a state never looks current to another cache
  // atomic: the simulator replays a space's configs on several threads at once (sdt_replay_solo)
  static std::atomic<uint64_t> epoch{0};
  return ++epoch;
}

struct Node;

// Every node's children in one open-addressing table keyed by (parent id, token), for the whole trie: a child lookup
// is a probe or two, and a node costs no allocation of its own (a std::unordered_map per node allocated one per
// child, and allocation was most of a replay's time). Linear probing, backward-shift deletion, at most half full.
struct ChildMap {
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  std::vector<uint64_t> keys;
  std::vector<Node*> values;
  int32_t bits = 0;
  size_t mask = 0, size = 0;

  static uint64_t key(int32_t parent, int32_t token) { return (uint64_t(uint32_t(parent)) << 32) | uint32_t(token); }
  size_t home(uint64_t k) const { return size_t((k * 0x9E3779B97F4A7C15ull) >> (64 - bits)); }
  void clear() {
    bits = 10;
    keys.assign(size_t(1) << bits, kEmpty);
    values.assign(size_t(1) << bits, nullptr);
    mask = (size_t(1) << bits) - 1;
    size = 0;
  }
  Node* find(uint64_t k) const {
    for (size_t i = home(k);; i = (i + 1) & mask) {
      if (keys[i] == k) return values[i];
      if (keys[i] == kEmpty) return nullptr;
    }
  }
  void put(uint64_t k, Node* value) {  // k absent
    if ((size + 1) * 2 > mask + 1) grow();
    size_t i = home(k);
    while (keys[i] != kEmpty) i = (i + 1) & mask;
    keys[i] = k;
    values[i] = value;
    ++size;
  }
  void erase(uint64_t k) {  // k present
    size_t i = home(k);
    while (keys[i] != k) i = (i + 1) & mask;
    for (size_t j = (i + 1) & mask; keys[j] != kEmpty; j = (j + 1) & mask) {
      const size_t h = home(keys[j]);
      // the entry at j may fill the hole at i unless its home lies cyclically in (i, j]
      const bool stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
      if (!stays) {
        keys[i] = keys[j];
        values[i] = values[j];
        i = j;
      }
    }
    keys[i] = kEmpty;
    values[i] = nullptr;
    --size;
  }
  void grow() {
    std::vector<uint64_t> old_keys;
    std::vector<Node*> old_values;
    old_keys.swap(keys);
    old_values.swap(values);
    ++bits;
    keys.assign(size_t(1) << bits, kEmpty);
    values.assign(size_t(1) << bits, nullptr);
    mask = (size_t(1) << bits) - 1;
    for (size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] == kEmpty) continue;
      size_t at = home(old_keys[i]);
      while (keys[at] != kEmpty) at = (at + 1) & mask;
      keys[at] = old_keys[i];
      values[at] = old_values[i];
    }
  }
};

struct Node {
  int32_t token;
  Node* parent;
  int32_t id;      // its number in the trie's pool: its children's keys in the ChildMap
  ChildMap* map;   // the trie's
  // the children in recency order, most recent last (trie.py's dict order): an intrusive list
  Node* first = nullptr;
  Node* last = nullptr;
  Node* prev = nullptr;
  Node* next = nullptr;
  int64_t freq = 1;
  int64_t stamp = 0;
  bool alive = true;
  uint64_t logged = 0;  // the undo log's checkpoint that last recorded this node (Cache::undo)
  bool ranks = false;                                  // PROB, every node but the root
  std::vector<int64_t> ranked;                         // rank keys of the children, ascending
  bool offers_valid = false;
  std::vector<std::pair<double, Node*>> offers;        // (freq / sum_freq, child) of the top children

  Node(int32_t t, Node* p, bool r, int32_t i, ChildMap* m) : token(t), parent(p), id(i), map(m), ranks(r) {}

  void unlink(Node* child) {
    (child->prev ? child->prev->next : first) = child->next;
    (child->next ? child->next->prev : last) = child->prev;
    child->prev = child->next = nullptr;
  }
  void insert_after(Node* before, Node* child) {  // before == nullptr: first
    child->prev = before;
    child->next = before ? before->next : first;
    (child->next ? child->next->prev : last) = child;
    (before ? before->next : first) = child;
  }
  void append(Node* child) {
    child->prev = last;
    child->next = nullptr;
    (last ? last->next : first) = child;
    last = child;
  }
  Node* find(int32_t t) const { return first ? map->find(ChildMap::key(id, t)) : nullptr; }
  void adopt(Node* child) { map->put(ChildMap::key(id, child->token), child); }
  void disown(Node* child) { map->erase(ChildMap::key(id, child->token)); }
};

void rank_insert(std::vector<int64_t>& ranked, int64_t key) {
  ranked.insert(std::lower_bound(ranked.begin(), ranked.end(), key), key);
}

void rank_erase(std::vector<int64_t>& ranked, int64_t key) {
  ranked.erase(std::lower_bound(ranked.begin(), ranked.end(), key));
}

struct State {
  uint64_t epoch = 0;
  int64_t processed_total_len = 0;
  std::vector<Node*> anchors;  // nullptr: that suffix was not in the trie
};

struct Tree {  // the tree under construction, position 0 the root; its buffers kept from tree to tree
  std::vector<int32_t> tokens, parents;

  void start(int32_t root) {
    tokens.assign(1, root);
    parents.assign(1, -1);
  }
  // the child of `parent` holding `token`, -1 if none (children come after their parent; a tree has a few dozen
  // nodes at most, so a scan costs less than keeping per-node child lists)
  int32_t child(int32_t parent, int32_t token) const {
    for (int32_t pos = parent + 1; pos < int32_t(tokens.size()); ++pos)
      if (parents[pos] == parent && tokens[pos] == token) return pos;
    return -1;
  }
  // trie.py's drafttree.place: merged with an equal sibling, else appended at the cursor
  int32_t place(int32_t token, int32_t parent, int32_t& cursor) {
    const int32_t found = child(parent, token);
    if (found >= 0) return found;
    tokens.push_back(token);
    parents.push_back(parent);
    return cursor++;
  }
};

// The insert windows queued in a round, flat (no allocation per window), each with where it came from: the
// sequence and the end of the window in it (nullptr: a window given by itself, serve.ngram's `queue`).
struct Pending {
  std::vector<int32_t> tokens, lens;
  std::vector<const int32_t*> seqs;
  std::vector<int64_t> ends;

  void push(const int32_t* window, int32_t n, const int32_t* seq, int64_t end) {
    tokens.insert(tokens.end(), window, window + n);
    lens.push_back(n);
    seqs.push_back(seq);
    ends.push_back(end);
  }
  void clear() {
    tokens.clear();
    lens.clear();
    seqs.clear();
    ends.clear();
  }
};

struct Cache {
  int32_t depth;
  int64_t capacity;
  int32_t min_breadth, max_breadth;
  bool prob;
  int32_t num_draft_tokens;
  uint64_t epoch = 0;
  std::deque<Node> pool;  // every node since the last reset (evicted ones too: states may hold them); never moved
  ChildMap children;
  Node* root = nullptr;
  int64_t nodes = 0;
  int64_t clock = 0;
  bool heap_built = false;
  std::vector<std::pair<int64_t, Node*>> heap;  // min-heap on stamp (std::greater), stale entries skipped
  Tree tree;
  Pending pending;  // queued insert windows, in draft order (copies)
  // Scratch buffers reused from step to step (a replay runs a million steps: allocations were much of its time).
  std::vector<Node*> scratch_anchors, scratch_next;
  std::vector<std::pair<Node*, int32_t>> matched;
  std::deque<std::tuple<int32_t, double, Node*>> bfs;
  std::vector<std::tuple<double, int32_t, Node*>> best;
  // The nodes of the substrings the last inserts of one sequence walked: memo[(a % depth) * depth + j] is the node of
  // seq[a .. a + j], valid while memo_start[a % depth] == a, a + j < memo_end[a % depth] and the node is alive (a
  // node never changes its path; an evicted one is dead, and the pool keeps it). Consecutive windows of a request
  // overlap in all but the tokens it accepted since, so an insert looks up only the substrings that end in those,
  // instead of walking every suffix of its window down from the root (a depth-24 window: 300 lookups a step).
  const int32_t* memo_seq = nullptr;
  std::vector<Node*> memo;
  std::vector<int64_t> memo_start, memo_end;
  // The undo log of sdt_replay_solo's checkpoints: while `logging`, the first change an insert makes to a node is
  // recorded (its state before the checkpoint) so that `undo` puts the trie back as it was (one warm-up replayed once
  // serves every warm-up count of a space, each followed by its measurement). An eviction is not undoable: `evicted`
  // says one happened while logging.
  struct Change {
    Node* node;
    Node* prev;  // its sibling before it in the recency list, before the change
    int64_t stamp, freq;
    bool made;  // a node the insert created (else one it touched)
  };
  bool logging = false;
  uint64_t checkpoint = 0;  // incremented at each `log_from_here`
  bool evicted = false;
  std::vector<Change> changes;

  void queue(const int32_t* window, int32_t n, const int32_t* seq = nullptr, int64_t end = 0) {
    pending.push(window, n, seq, end);
  }

  void land() {
    size_t at = 0;
    for (size_t w = 0; w < pending.lens.size(); ++w) {
      insert(pending.tokens.data() + at, pending.lens[w], pending.seqs[w], pending.ends[w]);
      at += size_t(pending.lens[w]);
    }
    pending.clear();
  }

  Cache(int32_t d, int64_t cap, int32_t lo, int32_t hi, bool p, int32_t n)
      : depth(d), capacity(cap), min_breadth(lo), max_breadth(hi), prob(p), num_draft_tokens(n) {
    memo.assign(size_t(d) * size_t(d), nullptr);
    memo_start.assign(size_t(d), -1);
    memo_end.assign(size_t(d), -1);
    reset();
  }

  void reset() {  // the queued inserts too (a flush drops them)
    pending.clear();
    memo_seq = nullptr;  // the pool's nodes go: nothing may point at them
    pool.clear();
    children.clear();
    pool.emplace_back(-1, nullptr, false, 0, &children);  // the root keeps no ranking (trie.py: nothing reads it)
    root = &pool.back();
    nodes = 0;
    clock = 0;
    heap_built = false;
    heap.clear();
    epoch = next_epoch();
  }

  Node* make(int32_t token, Node* parent) {
    // every node but the root ranks its children
    pool.emplace_back(token, parent, prob, int32_t(pool.size()), &children);
    return &pool.back();
  }

  void heap_push(int64_t stamp, Node* node) {
    heap.emplace_back(stamp, node);
    std::push_heap(heap.begin(), heap.end(), std::greater<>());
  }

  void rebuild_heap() {
    heap.clear();
    std::vector<Node*> stack;
    for (Node* c = root->first; c; c = c->next) stack.push_back(c);
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      heap.emplace_back(node->stamp, node);
      for (Node* c = node->first; c; c = c->next) stack.push_back(c);
    }
    std::make_heap(heap.begin(), heap.end(), std::greater<>());
  }

  void squeeze(int64_t count) {
    if (logging) evicted = true;
    if (!heap_built || int64_t(heap.size()) > 4 * nodes + 64) {
      rebuild_heap();
      heap_built = true;
    }
    while (count) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      auto [stamp, node] = heap.back();
      heap.pop_back();
      if (!node->alive) continue;
      if (node->stamp != stamp) {  // touched since: its place in the LRU is later
        heap_push(node->stamp, node);
        continue;
      }
      --count;
      --nodes;
      node->alive = false;
      Node* parent = node->parent;
      parent->disown(node);
      parent->unlink(node);
      if (parent->ranks) {
        parent->offers_valid = false;
        rank_erase(parent->ranked, node->token - node->freq * kShift);
      }
    }
  }

  // `seq`/`end`: the window is seq[end - n .. end) (nullptr: unknown; no memo)
  void insert(const int32_t* window, int32_t n, const int32_t* seq = nullptr, int64_t end = 0) {
    const int64_t room = capacity - 1;  // the root takes one slot
    if (seq != nullptr && seq != memo_seq) {
      memo_seq = seq;
      std::fill(memo_start.begin(), memo_start.end(), -1);
    }
    for (int32_t start = 0; start < n; ++start) {
      const int64_t length = n - start;
      const int64_t free = room - nodes;
      if (length > free) squeeze(length - free);
      // parents end up more recent than their children: depth i of this suffix gets clock + length - 1 - i
      int64_t stamp = clock + length;
      clock = stamp;
      Node* cursor = root;
      const int64_t a = end - n + start;  // where this suffix starts in seq
      Node** row = nullptr;
      int64_t known = a;  // the memo row holds the nodes of seq[a .. b] for b < known
      if (seq != nullptr) {
        const size_t r = size_t(a % depth);
        row = memo.data() + r * size_t(depth);
        if (memo_start[r] != a) {
          memo_start[r] = a;
          memo_end[r] = a;
        }
        known = memo_end[r];
        memo_end[r] = std::max(known, end);
      }
      for (int32_t i = start; i < n; ++i) {
        const int32_t token = window[i];
        --stamp;
        Node* node = nullptr;
        if (row != nullptr && a + (i - start) < known) {
          node = row[i - start];
          if (!node->alive) node = nullptr;
        }
        if (node == nullptr) node = cursor->find(token);
        if (node == nullptr) {
          node = make(token, cursor);
          if (logging) {
            node->logged = checkpoint;
            changes.push_back({node, nullptr, 0, 0, true});
          }
          cursor->adopt(node);
          cursor->append(node);
          ++nodes;
          node->stamp = stamp;
          if (heap_built) heap_push(stamp, node);
          if (cursor->ranks) {
            cursor->offers_valid = false;
            rank_insert(cursor->ranked, token - kShift);
          }
        } else {
          if (logging && node->logged != checkpoint) {
            node->logged = checkpoint;
            changes.push_back({node, node->prev, node->stamp, node->freq, false});
          }
          node->stamp = stamp;
          if (cursor->last != node) {  // the most recent child goes last
            cursor->unlink(node);
            cursor->append(node);
          }
          if (cursor->ranks) {
            cursor->offers_valid = false;
            const int64_t old = token - node->freq * kShift;
            rank_erase(cursor->ranked, old);
            rank_insert(cursor->ranked, old - kShift);
          }
          ++node->freq;
        }
        if (row != nullptr) row[i - start] = node;
        cursor = node;
      }
    }
  }

  void log_from_here() {
    ++checkpoint;
    changes.clear();
    logging = true;
    evicted = false;
  }

  // Every logged node put back, latest first. A touched node was still in its parent's untouched front (its
  // recorded neighbour before it too) when first touched, and every node first touched after it is back in place
  // by then: re-inserting it after that neighbour restores the order, as each touch only moves a node to the end.
  // Its stamp and count go back to their values before the checkpoint (its parent's ranking with them). Nodes the
  // log created stay in the pool, dead (nothing holds them: the replay's match states end with their requests);
  // the eviction heap is rebuilt on its next use, from the live nodes (evictions pop by stamp, unique, so any heap
  // agrees).
  void undo() {
    for (auto it = changes.rbegin(); it != changes.rend(); ++it) {
      Node* node = it->node;
      Node* parent = node->parent;
      if (it->made) {
        parent->disown(node);
        parent->unlink(node);
        if (parent->ranks) {
          parent->offers_valid = false;
          rank_erase(parent->ranked, node->token - node->freq * kShift);
        }
        node->alive = false;
        --nodes;
      } else {
        if (parent->ranks) {
          parent->offers_valid = false;
          rank_erase(parent->ranked, node->token - node->freq * kShift);
          rank_insert(parent->ranked, node->token - it->freq * kShift);
        }
        node->freq = it->freq;
        node->stamp = it->stamp;
        parent->unlink(node);
        parent->insert_after(it->prev, node);
      }
    }
    changes.clear();
    heap_built = false;
    heap.clear();
  }

  // ---------------------------------------------------------------- match state (Trie::match)

  void rebuild(const int32_t* window, int32_t n, State& state, int64_t total_len) {
    state.anchors.clear();
    for (int32_t d = 1; d <= std::min(n, depth); ++d) {
      Node* cursor = root;
      for (int32_t i = n - d; i < n && cursor; ++i) cursor = cursor->find(window[i]);
      state.anchors.push_back(cursor);
    }
    state.epoch = epoch;
    state.processed_total_len = total_len;
  }

  bool advance(State& state, const int32_t* appended, int64_t count, int64_t total_len) {
    for (Node* node : state.anchors)
      if (node && !node->alive) return false;
    std::vector<Node*>& anchors = scratch_anchors;
    std::vector<Node*>& next = scratch_next;
    anchors.assign(state.anchors.begin(), state.anchors.end());
    for (int64_t k = 0; k < count; ++k) {
      const int32_t token = appended[k];
      next.clear();
      next.push_back(root->find(token));
      const size_t top = std::min(anchors.size() + 1, size_t(depth));
      for (size_t d = 1; d < top; ++d) next.push_back(anchors[d - 1] ? anchors[d - 1]->find(token) : nullptr);
      anchors.swap(next);
    }
    state.anchors.assign(anchors.begin(), anchors.end());
    state.processed_total_len = total_len;
    return true;
  }

  const std::vector<std::pair<Node*, int32_t>>& match(const int32_t* window, int32_t n, State& state,
                                                      int64_t total_len) {
    const int64_t processed = state.processed_total_len;
    const bool forward = total_len >= processed;
    const int64_t appended = forward ? total_len - processed : 0;
    const bool can_advance = state.epoch == epoch && forward && appended <= n &&
                             int64_t(state.anchors.size()) == std::min<int64_t>(processed, depth);
    if (!(can_advance && advance(state, window + n - appended, appended, total_len)))
      rebuild(window, n, state, total_len);
    std::vector<std::pair<Node*, int32_t>>& out = matched;
    out.clear();
    for (size_t d = state.anchors.size(); d > 0; --d) {
      Node* node = state.anchors[d - 1];
      if (node && node->first) out.emplace_back(node, int32_t(d));
    }
    return out;
  }

  // ---------------------------------------------------------------- tree construction

  void build_recency(const std::vector<std::pair<Node*, int32_t>>& anchors, int32_t budget) {
    const int32_t max_match_depth = std::max(1, depth - 1);
    const double scale = double(max_breadth - min_breadth) / max_match_depth;
    int32_t cursor = 1;
    auto& queue = bfs;
    for (auto [anchor, d] : anchors) {
      if (cursor > budget) break;
      queue.clear();
      queue.emplace_back(0, (max_match_depth - d) * scale + min_breadth, anchor);
      while (!queue.empty() && cursor <= budget) {
        auto [parent, cur_breadth, node] = queue.front();
        queue.pop_front();
        const int32_t breadth = std::max(1, int32_t(cur_breadth));
        const double child_breadth = cur_breadth - scale;
        int32_t taken = 0;
        for (Node* child = node->last; child; child = child->prev) {  // most recent first
          if (taken >= breadth || cursor > budget) break;
          ++taken;
          const int32_t pos = tree.place(child->token, parent, cursor);
          if (child->first) queue.emplace_back(pos, child_breadth, child);
        }
      }
    }
  }

  const std::vector<std::pair<double, Node*>>& offers_of(Node* node) {
    if (!node->offers_valid) {
      node->offers.clear();
      double sum_freq = 0.0;
      const size_t k = std::min(node->ranked.size(), size_t(max_breadth));
      for (size_t i = 0; i < k; ++i) sum_freq += double(node->find(int32_t(node->ranked[i] & kTokenMask))->freq);
      if (sum_freq <= 0) sum_freq = 1.0;
      for (size_t i = 0; i < k; ++i) {
        Node* child = node->find(int32_t(node->ranked[i] & kTokenMask));
        node->offers.emplace_back(double(child->freq) / sum_freq, child);
      }
      node->offers_valid = true;
    }
    return node->offers;
  }

  void build_frequency(const std::vector<std::pair<Node*, int32_t>>& anchors, int32_t budget) {
    struct ByProb {
      bool operator()(const std::tuple<double, int32_t, Node*>& a, const std::tuple<double, int32_t, Node*>& b) const {
        return std::get<0>(a) < std::get<0>(b);
      }
    };
    int32_t cursor = 1;
    // std::priority_queue's own push and pop (push_heap / pop_heap on its vector), on a vector kept between builds
    auto& heap = best;
    const ByProb less;
    auto push = [&](double p, int32_t parent, Node* node) {
      heap.emplace_back(p, parent, node);
      std::push_heap(heap.begin(), heap.end(), less);
    };
    for (auto [anchor, d] : anchors) {
      if (cursor > budget) break;
      heap.clear();
      for (auto& [ratio, child] : offers_of(anchor)) push(ratio * 1.0, 0, child);
      while (!heap.empty() && cursor <= budget) {
        auto [p, parent, node] = heap.front();
        std::pop_heap(heap.begin(), heap.end(), less);
        heap.pop_back();
        const int32_t pos = tree.place(node->token, parent, cursor);
        if (node->first)
          for (auto& [ratio, child] : offers_of(node)) push(ratio * p, pos, child);
      }
    }
  }

  // the tree for `window` (its last token the root) in `tree`; returns its size, the root included
  int32_t build(const int32_t* window, int32_t n, State& state, int64_t total_len, int32_t budget) {
    const auto& anchors = match(window, n, state, total_len);
    tree.start(window[n - 1]);
    if (prob)
      build_frequency(anchors, budget);
    else
      build_recency(anchors, budget);
    return int32_t(tree.tokens.size());
  }

  // draft nodes a greedy verifier accepts along `cont` (replay.py's accepted_drafts on the laid-out tree: the pads,
  // token 0 under the root, follow the real nodes)
  int32_t accepted(const int32_t* cont, int32_t cont_n, int32_t budget) const {
    const int32_t real = int32_t(tree.tokens.size()) - 1;
    int32_t node = 0, count = 0;
    for (int32_t i = 0; i < cont_n; ++i) {
      const int32_t child = tree.child(node, cont[i]);
      if (child < 0) {
        if (node == 0 && cont[i] == 0 && real < budget) ++count;  // a pad: it has no children
        break;
      }
      node = child;
      ++count;
    }
    return count;
  }
};

}  // namespace

extern "C" {

void* sdt_cache_new(int32_t depth, int64_t capacity, int32_t min_breadth, int32_t max_breadth, int32_t prob,
                    int32_t num_draft_tokens) {
  return new Cache(depth, capacity, min_breadth, max_breadth, prob != 0, num_draft_tokens);
}

void sdt_cache_free(void* cache) { delete static_cast<Cache*>(cache); }

void sdt_cache_reset(void* cache) { static_cast<Cache*>(cache)->reset(); }

int64_t sdt_cache_nodes(void* cache) { return static_cast<Cache*>(cache)->nodes; }

void sdt_cache_insert(void* cache, const int32_t* window, int32_t n) { static_cast<Cache*>(cache)->insert(window, n); }

void* sdt_state_new() { return new State(); }

void sdt_state_free(void* state) { delete static_cast<State*>(state); }

// The tree (position 0 the root, every parent before its children) into out_tokens/out_parents (room for
// budget + 1); returns its size.
int32_t sdt_cache_build(void* cache, const int32_t* window, int32_t n, void* state, int64_t total_len,
                        int32_t budget, int32_t* out_tokens, int32_t* out_parents) {
  auto* c = static_cast<Cache*>(cache);
  const int32_t size = c->build(window, n, *static_cast<State*>(state), total_len, budget);
  std::copy(c->tree.tokens.begin(), c->tree.tokens.end(), out_tokens);
  std::copy(c->tree.parents.begin(), c->tree.parents.end(), out_parents);
  return size;
}

// One replayed verify step of a request whose whole sequence (prompt + every output token) is seq[0..end) and of
// which `length` tokens are out: land the queued inserts first when `land` (a round began since), draft from the
// window ending at seq[length - 1] (total_len = length), walk the tree along seq[length..] and queue the window's
// insert (serve/ngram/schedule.py's schedule). Returns the accepted drafts, the tree's real nodes in *num_real.
int32_t sdt_cache_step(void* cache, const int32_t* seq, int32_t length, int32_t end, void* state, int32_t land,
                       int32_t* num_real) {
  auto* c = static_cast<Cache*>(cache);
  if (land) c->land();
  const int32_t n = std::min(length, c->depth);
  const int32_t budget = c->num_draft_tokens - 1;
  *num_real = c->build(seq + length - n, n, *static_cast<State*>(state), length, budget) - 1;
  c->queue(seq + length - n, n, seq, length);
  return c->accepted(seq + length, std::min(budget, end - length), budget);
}

// Every remaining verify step of a request that runs alone in its rounds (each step a round of its own, so each
// lands the previous one's insert; the first lands only when `land`): sdt_cache_step from `length` on, each step
// keeping its accepted drafts and the bonus token (cut at the sequence's end), until the sequence is out. The kept
// tokens and real nodes of step i go to out_kept[i] / out_real[i] (room for end - length steps); returns the steps.
int32_t sdt_cache_run(void* cache, const int32_t* seq, int32_t length, int32_t end, void* state, int32_t land,
                      int32_t* out_kept, int32_t* out_real) {
  int32_t steps = 0;
  while (length < end) {
    int32_t real = 0;
    const int32_t drafts = sdt_cache_step(cache, seq, length, end, state, steps == 0 ? land : 1, &real);
    const int32_t kept = std::min(drafts + 1, end - length);
    out_kept[steps] = kept;
    out_real[steps] = real;
    ++steps;
    length += kept;
  }
  return steps;
}

// One request of a closed loop at concurrency 1 (pipeline/simulate/replay.py's schedule with one client): its
// prefill round drafts nothing, then it is alone in every round to its end, so its steps are sdt_cache_run's from
// one token out, the first landing what the request before it queued. Kept tokens and real nodes go to kept/real;
// returns the steps.
static int32_t solo_request(void* cache, const int32_t* seq, int32_t end, int32_t prompt_len, int16_t* kept,
                            int16_t* real, std::vector<int32_t>& k32, std::vector<int32_t>& r32) {
  const int32_t length = prompt_len + 1;
  if (length >= end) return 0;  // the prefill emitted the whole output
  State state;
  k32.resize(size_t(end - length));
  r32.resize(size_t(end - length));
  const int32_t steps = sdt_cache_run(cache, seq, length, end, &state, 1, k32.data(), r32.data());
  for (int32_t i = 0; i < steps; ++i) {
    kept[i] = int16_t(k32[i]);
    real[i] = int16_t(r32[i]);
  }
  return steps;
}

// A config replayed over every warm-up count of a space at once, closed loop at concurrency 1: the requests are the
// sequences tokens[offsets[s] .. offsets[s + 1]) (prompt_lens[s] of them the prompt); `warm` lists the warm-up
// requests in order (warmup_requests of them go first), `measure` the measurement's; `counts` the warm-up counts,
// ascending, each at most n_warm. The warm-up is replayed once; at each count the measurement runs on the trie as
// the warm-up left it, and the undo log puts it back (after an eviction, which the log cannot take back, the trie is
// rebuilt by replaying the warm-up again). The warm-up requests' steps (kept tokens, real nodes) go to warm_kept /
// warm_real in order and each request's step count to warm_steps (counts[n_counts - 1] requests); each count's
// measurement's to meas_kept / meas_real, count after count, and meas_steps (n_measure per count); out_nodes[i] is
// the trie's nodes after the measurement at counts[i]. `cache` is a fresh (or reset) cache with the config's
// parameters. Returns the measurement steps written, -1 on bad arguments.
int64_t sdt_replay_solo(void* cache, const int32_t* tokens, const int64_t* offsets, const int32_t* prompt_lens,
                        const int32_t* warm, int32_t n_warm, const int32_t* measure, int32_t n_measure,
                        const int32_t* counts, int32_t n_counts, int16_t* warm_kept, int16_t* warm_real,
                        int32_t* warm_steps, int16_t* meas_kept, int16_t* meas_real, int32_t* meas_steps,
                        int64_t* out_nodes) {
  auto* c = static_cast<Cache*>(cache);
  std::vector<int32_t> k32, r32;
  std::vector<int16_t> scratch_k, scratch_r;
  int64_t warm_written = 0, written = 0;
  int32_t done = 0;  // warm-up requests replayed into the trie
  c->changes.reserve(size_t(1) << 15);  // a measurement's inserts: kept from count to count
  auto run = [&](int32_t s, int16_t* kept, int16_t* real) {
    const int32_t* seq = tokens + offsets[s];
    return solo_request(cache, seq, int32_t(offsets[s + 1] - offsets[s]), prompt_lens[s], kept, real, k32, r32);
  };
  for (int32_t i = 0; i < n_counts; ++i) {
    if (counts[i] < done || counts[i] > n_warm) return -1;
    for (; done < counts[i]; ++done) {
      const int32_t steps = run(warm[done], warm_kept + warm_written, warm_real + warm_written);
      warm_steps[done] = steps;
      warm_written += steps;
    }
    const int64_t clock = c->clock;
    const auto pending = c->pending;
    c->log_from_here();
    for (int32_t m = 0; m < n_measure; ++m) {
      const int32_t steps = run(measure[m], meas_kept + written, meas_real + written);
      meas_steps[i * n_measure + m] = steps;
      written += steps;
    }
    out_nodes[i] = c->nodes;
    c->logging = false;
    if (i + 1 == n_counts) break;  // nothing replays after the last measurement
    if (!c->evicted) {
      c->undo();
      c->clock = clock;
      c->pending = pending;
    } else {  // the same warm-up again, from an empty trie: the same decisions, the same trie
      c->changes.clear();
      c->reset();
      for (int32_t w = 0; w < done; ++w) {
        const int32_t end = int32_t(offsets[warm[w] + 1] - offsets[warm[w]]);
        scratch_k.resize(size_t(std::max(end, 1)));
        scratch_r.resize(size_t(std::max(end, 1)));
        run(warm[w], scratch_k.data(), scratch_r.data());
      }
    }
  }
  return written;
}

// The timelines of bulk replays that share a warm-up count (pipeline/simulate/solo.py `price_rows`): row r's `total`
// requests (its warm-up, then the measurement from request `count` on) have per_request[r * total + j] steps, whose
// kept tokens and real nodes are kept/real[row_off[r] ..], in order; widths[r] is its verify width. The clock runs
// as pipeline/simulate/predict.py's `timed` runs it, in the same double operations in the same order: a request's
// client gap (not the first request's: it arrives at 0), its prefill round (prefill_s[j]), then one round per step,
// whose seconds are cells[width * reals + real] with the prior (mode 0), else (mode 1)
// (k * cells[..] * (1.0 + per_token * (context - ctx0)) + o) / 1000.0 with context the prompt and the output so far
// less one (CostModel.seconds of a one-request round over RoundTable.verify_ms's cell). Each measured request's
// arrival, first token and finish go to arrival/first/finished[r * (total - count) + m], the gaps between its rounds'
// ends (its ITLs) to itl from itl_off[r] on.
void sdt_price_solo(int32_t rows, int32_t total, int32_t count, const int64_t* per_request, const int16_t* kept,
                    const int16_t* real, const int64_t* row_off, const int32_t* widths, int32_t reals,
                    const int64_t* prompt_lens, const double* prefill_s, double gap, int32_t mode, const double* cells,
                    double per_token, int64_t ctx0, double k, double o, const int64_t* itl_off, double* arrival,
                    double* first, double* finished, double* itl) {
  const int32_t measured = total - count;
  for (int32_t r = 0; r < rows; ++r) {
    const double* cell = cells + int64_t(widths[r]) * reals;
    int64_t s = row_off[r], at = itl_off[r];
    double now = 0.0;
    for (int32_t j = 0; j < total; ++j) {
      double arrived = 0.0;
      if (j > 0) {
        now = now + gap;
        arrived = now;
      }
      now = now + prefill_s[j];
      const bool timed = j >= count;
      const int64_t slot = int64_t(r) * measured + (j - count);
      if (timed) {
        arrival[slot] = arrived;
        first[slot] = now;
      }
      int64_t context = prompt_lens[j];
      double previous = now;
      for (int64_t t = per_request[int64_t(r) * total + j]; t > 0; --t, ++s) {
        double seconds;
        if (mode == 0) {
          seconds = cell[real[s]];
        } else {
          const double shape = cell[real[s]] * (1.0 + per_token * (double(context) - double(ctx0)));
          seconds = (k * shape + o) / 1000.0;
        }
        now = now + seconds;
        if (timed) {
          itl[at++] = now - previous;
          previous = now;
        }
        context += kept[s];
      }
      if (timed) finished[slot] = now;
    }
  }
}

void sdt_cache_queue(void* cache, const int32_t* window, int32_t n) { static_cast<Cache*>(cache)->queue(window, n); }

void sdt_cache_land(void* cache) { static_cast<Cache*>(cache)->land(); }

}  // extern "C"

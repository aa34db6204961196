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
  static uint64_t epoch = 0;
  return ++epoch;
}

struct Node {
  int32_t token;
  Node* parent;
  std::unordered_map<int32_t, Node*> children;
  // the children in recency order, most recent last (trie.py's dict order): an intrusive list
  Node* first = nullptr;
  Node* last = nullptr;
  Node* prev = nullptr;
  Node* next = nullptr;
  int64_t freq = 1;
  int64_t stamp = 0;
  bool alive = true;
  bool ranks = false;                                  // PROB, every node but the root
  std::vector<int64_t> ranked;                         // rank keys of the children, ascending
  bool offers_valid = false;
  std::vector<std::pair<double, Node*>> offers;        // (freq / sum_freq, child) of the top children

  Node(int32_t t, Node* p, bool r) : token(t), parent(p), ranks(r) {}

  void unlink(Node* child) {
    (child->prev ? child->prev->next : first) = child->next;
    (child->next ? child->next->prev : last) = child->prev;
    child->prev = child->next = nullptr;
  }
  void append(Node* child) {
    child->prev = last;
    child->next = nullptr;
    (last ? last->next : first) = child;
    last = child;
  }
  Node* find(int32_t t) const {
    auto it = children.find(t);
    return it == children.end() ? nullptr : it->second;
  }
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

struct Tree {  // the tree under construction, position 0 the root
  std::vector<int32_t> tokens, parents;
  std::vector<std::vector<std::pair<int32_t, int32_t>>> next;  // per position: (token, position) of its children

  void start(int32_t root) {
    tokens.assign(1, root);
    parents.assign(1, -1);
    next.assign(1, {});
  }
  // trie.py's drafttree.place: merged with an equal sibling, else appended at the cursor
  int32_t place(int32_t token, int32_t parent, int32_t& cursor) {
    for (auto& [t, pos] : next[parent])
      if (t == token) return pos;
    next[parent].emplace_back(token, cursor);
    tokens.push_back(token);
    parents.push_back(parent);
    next.emplace_back();
    return cursor++;
  }
};

struct Cache {
  int32_t depth;
  int64_t capacity;
  int32_t min_breadth, max_breadth;
  bool prob;
  int32_t num_draft_tokens;
  uint64_t epoch = 0;
  std::deque<std::unique_ptr<Node>> pool;  // every node since the last reset (evicted ones too: states may hold them)
  Node* root = nullptr;
  int64_t nodes = 0;
  int64_t clock = 0;
  bool heap_built = false;
  std::vector<std::pair<int64_t, Node*>> heap;  // min-heap on stamp (std::greater), stale entries skipped
  Tree tree;
  std::vector<std::vector<int32_t>> pending;  // queued insert windows, in draft order (copies)

  void queue(const int32_t* window, int32_t n) { pending.emplace_back(window, window + n); }

  void land() {
    for (auto& window : pending) insert(window.data(), int32_t(window.size()));
    pending.clear();
  }

  Cache(int32_t d, int64_t cap, int32_t lo, int32_t hi, bool p, int32_t n)
      : depth(d), capacity(cap), min_breadth(lo), max_breadth(hi), prob(p), num_draft_tokens(n) {
    reset();
  }

  void reset() {  // the queued inserts too (a flush drops them)
    pending.clear();
    pool.clear();
    pool.emplace_back(new Node(-1, nullptr, false));  // the root keeps no ranking (trie.py: nothing reads it)
    root = pool.back().get();
    nodes = 0;
    clock = 0;
    heap_built = false;
    heap.clear();
    epoch = next_epoch();
  }

  Node* make(int32_t token, Node* parent) {
    pool.emplace_back(new Node(token, parent, prob));  // every node but the root ranks its children
    return pool.back().get();
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
      parent->children.erase(node->token);
      parent->unlink(node);
      if (parent->ranks) {
        parent->offers_valid = false;
        rank_erase(parent->ranked, node->token - node->freq * kShift);
      }
    }
  }

  void insert(const int32_t* window, int32_t n) {
    const int64_t room = capacity - 1;  // the root takes one slot
    for (int32_t start = 0; start < n; ++start) {
      const int64_t length = n - start;
      const int64_t free = room - nodes;
      if (length > free) squeeze(length - free);
      // parents end up more recent than their children: depth i of this suffix gets clock + length - 1 - i
      int64_t stamp = clock + length;
      clock = stamp;
      Node* cursor = root;
      for (int32_t i = start; i < n; ++i) {
        const int32_t token = window[i];
        --stamp;
        Node* node = cursor->find(token);
        if (node == nullptr) {
          node = make(token, cursor);
          cursor->children.emplace(token, node);
          cursor->append(node);
          ++nodes;
          node->stamp = stamp;
          if (heap_built) heap_push(stamp, node);
          if (cursor->ranks) {
            cursor->offers_valid = false;
            rank_insert(cursor->ranked, token - kShift);
          }
        } else {
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
        cursor = node;
      }
    }
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
    std::vector<Node*> anchors = state.anchors, next;
    for (int64_t k = 0; k < count; ++k) {
      const int32_t token = appended[k];
      next.clear();
      next.push_back(root->find(token));
      const size_t top = std::min(anchors.size() + 1, size_t(depth));
      for (size_t d = 1; d < top; ++d) next.push_back(anchors[d - 1] ? anchors[d - 1]->find(token) : nullptr);
      anchors.swap(next);
    }
    state.anchors.swap(anchors);
    state.processed_total_len = total_len;
    return true;
  }

  std::vector<std::pair<Node*, int32_t>> match(const int32_t* window, int32_t n, State& state, int64_t total_len) {
    const int64_t processed = state.processed_total_len;
    const bool forward = total_len >= processed;
    const int64_t appended = forward ? total_len - processed : 0;
    const bool can_advance = state.epoch == epoch && forward && appended <= n &&
                             int64_t(state.anchors.size()) == std::min<int64_t>(processed, depth);
    if (!(can_advance && advance(state, window + n - appended, appended, total_len)))
      rebuild(window, n, state, total_len);
    std::vector<std::pair<Node*, int32_t>> out;
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
    std::deque<std::tuple<int32_t, double, Node*>> queue;
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
    for (auto [anchor, d] : anchors) {
      if (cursor > budget) break;
      std::priority_queue<std::tuple<double, int32_t, Node*>, std::vector<std::tuple<double, int32_t, Node*>>, ByProb>
          heap;
      for (auto& [ratio, child] : offers_of(anchor)) heap.emplace(ratio * 1.0, 0, child);
      while (!heap.empty() && cursor <= budget) {
        auto [p, parent, node] = heap.top();
        heap.pop();
        const int32_t pos = tree.place(node->token, parent, cursor);
        if (node->first)
          for (auto& [ratio, child] : offers_of(node)) heap.emplace(ratio * p, pos, child);
      }
    }
  }

  // the tree for `window` (its last token the root) in `tree`; returns its size, the root included
  int32_t build(const int32_t* window, int32_t n, State& state, int64_t total_len, int32_t budget) {
    auto anchors = match(window, n, state, total_len);
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
      int32_t child = -1;
      for (auto& [t, pos] : tree.next[node])
        if (t == cont[i]) {
          child = pos;
          break;
        }
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
  c->queue(seq + length - n, n);
  return c->accepted(seq + length, std::min(budget, end - length), budget);
}

void sdt_cache_queue(void* cache, const int32_t* window, int32_t n) { static_cast<Cache*>(cache)->queue(window, n); }

void sdt_cache_land(void* cache) { static_cast<Cache*>(cache)->land(); }

}  // extern "C"

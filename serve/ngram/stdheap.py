"""libstdc++'s `std::priority_queue` (push_heap / pop_heap), compared on the first item of each tuple only.

SGLang's PROB drafting (`Trie::buildFrequency`, `SuffixAutomaton::buildFrequency`) pops equal probabilities in
the order libstdc++'s heap pops them. Python's `heapq` breaks such ties differently, and the tie order decides which
nodes fill the budget, so the drafts would differ. These two functions reproduce libstdc++ exactly.
"""

from __future__ import annotations

__all__ = ["heap_pop", "heap_push"]


def heap_push(heap: list, item: tuple) -> None:
    """`std::push_heap` of a max-heap keyed on item[0]."""
    heap.append(item)
    _sift_up(heap, len(heap) - 1, 0, item)


def heap_pop(heap: list) -> tuple:
    """`std::pop_heap` + `pop_back`: remove and return the top (a largest item[0])."""
    top = heap[0]
    last = heap.pop()
    n = len(heap)
    if n == 0:
        return top
    # std::__adjust_heap: walk the hole down to a leaf along the larger child, then sift `last` up from there.
    hole = 0
    child = 0
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if heap[child][0] < heap[child - 1][0]:
            child -= 1
        heap[hole] = heap[child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        heap[hole] = heap[child - 1]
        hole = child - 1
    _sift_up(heap, hole, 0, last)
    return top


def _sift_up(heap: list, hole: int, top: int, item: tuple) -> None:
    value = item[0]
    parent = (hole - 1) // 2
    while hole > top and heap[parent][0] < value:
        heap[hole] = heap[parent]
        hole = parent
        parent = (hole - 1) // 2
    heap[hole] = item

"""A token-level radix tree over the KV pool, after SGLang's `mem_cache/radix_cache.py`.

What is taken from SGLang: nodes keyed by their first token (page size 1); a match splits the
node it ends inside, so a matched prefix is always a whole path; every node carries a lock
count, a locked node (an ancestor of a running request's last node) is never evicted; the
tree's tokens are `evictable` (lock count 0) or `protected`; eviction removes the least recently
used unlocked leaves, whole, until enough tokens are free, then their parents when they become
leaves. The tree shares the KV pool with the running requests: a token in the tree occupies a
slot of the pool whether or not a request uses it.

Left out: pages larger than one token, extra keys (LoRA, cache salt), host (hierarchical) cache.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class Node:
    """One edge of the tree: a run of tokens, its children by first token, its lock count."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "uid")

    def __init__(self, key: list[int], parent: Node | None, uid: int) -> None:
        """A node holding key below parent."""
        self.key = key
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.uid = uid


def _common_prefix(key: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix of key and tokens[start:]."""
    end = start + len(key)
    if tokens[start:end] == key:
        return len(key)
    n = 0
    for a, b in zip(key, itertools.islice(tokens, start, None), strict=False):
        if a != b:
            break
        n += 1
    return n


class RadixCache:
    """Cached token sequences sharing prefixes; sizes in tokens."""

    def __init__(self) -> None:
        """An empty tree."""
        self._uids = itertools.count()
        self._tick = 0
        self.reset()

    def reset(self) -> None:
        """Forget everything (POST /flush_cache; only while nothing holds a lock)."""
        self.root = Node([], None, next(self._uids))
        self.root.lock_ref = 1  # the root is never evicted
        self.total_size = 0
        self.evictable_size = 0
        # (last_access, uid, node) of leaves that may be evictable; stale entries are skipped.
        self._heap: list[tuple[int, int, Node]] = []

    @property
    def protected_size(self) -> int:
        """Tokens locked by running requests."""
        return self.total_size - self.evictable_size

    def match_prefix(self, tokens: Sequence[int]) -> tuple[int, Node]:
        """Length of the longest cached prefix of tokens and the node it ends at."""
        ids = tokens if isinstance(tokens, list) else list(tokens)
        self._tick += 1
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            child.last_access = self._tick
            n = _common_prefix(child.key, ids, i)
            if n < len(child.key):
                node = self._split(child, n)
                i += n
                break
            node, i = child, i + n
        return i, node

    def _split(self, child: Node, n: int) -> Node:
        """Cut child after n tokens; the new upper node takes its lock count, as in SGLang."""
        assert child.parent is not None
        upper = Node(child.key[:n], child.parent, next(self._uids))
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def insert(self, tokens: Sequence[int]) -> tuple[int, Node]:
        """Add tokens; returns how many were new (the rest were cached) and their last node."""
        length, node = self.match_prefix(tokens)
        if length == len(tokens):
            return 0, node
        leaf = Node(list(tokens[length:]), node, next(self._uids))
        leaf.last_access = self._tick
        node.children[leaf.key[0]] = leaf
        self.total_size += len(leaf.key)
        self.evictable_size += len(leaf.key)
        self._push(leaf)
        return len(leaf.key), leaf

    def lock(self, node: Node) -> None:
        """Protect node and its ancestors from eviction (a running request uses them)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one lock(node); nodes nobody uses any more become evictable."""
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                if not node.children:
                    self._push(node)
            assert node.parent is not None
            node = node.parent

    def evict(self, tokens: int) -> int:
        """Remove least recently used unlocked leaves until `tokens` are freed; returns freed."""
        freed = 0
        while freed < tokens and self._heap:
            access, _, node = heapq.heappop(self._heap)
            if node.parent is None or node.children or node.lock_ref:
                continue  # evicted already, no longer a leaf, or in use
            if access != node.last_access:
                self._push(node)  # touched since it was queued: queue it by its new time
                continue
            freed += self._remove(node)
        return freed

    def _remove(self, node: Node) -> int:
        """Delete an unlocked leaf; its parent becomes a candidate when it is left childless."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[0]]
        node.parent = None
        self.total_size -= len(node.key)
        self.evictable_size -= len(node.key)
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self._push(parent)
        return len(node.key)

    def _push(self, node: Node) -> None:
        """Queue a leaf for eviction by its last access."""
        heapq.heappush(self._heap, (node.last_access, node.uid, node))

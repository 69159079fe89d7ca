"""The prompt cache's index: token sequences in a radix tree, so that the one
sharing the longest prefix with a prompt, one that begins with it and those
it begins with are found by walking the prompt once -- in time that grows
with the prompt's length, not with how many sequences are kept (a scan of
256 two-thousand-token entries took 36 ms an admission).

Each edge holds a run of tokens (a tuple) and leads to a node; a sequence
ends at the node its last token reaches (``Node.end`` holds it). A node that
no sequence ends at has two or more edges, but for the root: removing a
sequence prunes the nodes it leaves empty and joins a node left with one
edge to its parent's. Runs are compared as tuples (in C), token by token
only where they part.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ...decode.prefix import prefix_length


class Node:
    __slots__ = ("edges", "end")

    def __init__(self):
        self.edges: Dict[int, List] = {}  # first token -> [run of tokens (tuple), child Node]
        self.end: Optional[tuple] = None  # the sequence that ends here


class TokenTrie:
    """A set of token sequences (tuples) indexed by their prefixes."""

    def __init__(self):
        self.root = Node()

    def __bool__(self) -> bool:
        return bool(self.root.edges) or self.root.end is not None

    def _walk(self, seq: tuple) -> Iterator[Tuple[Node, int, Optional[List]]]:
        """(node, i, edge) along ``seq``: a node reached after ``i`` tokens (edge None), then, where the
        walk stops inside an edge, (that edge's node, the tokens matched, the edge)."""
        node, i = self.root, 0
        while True:
            yield node, i, None
            edge = node.edges.get(seq[i]) if i < len(seq) else None
            if edge is None:
                return
            run, child = edge
            if seq[i:i + len(run)] != run:
                yield node, i + prefix_length(run, seq[i:i + len(run)]), edge
                return
            node, i = child, i + len(run)

    def longest(self, seq: Sequence[int]) -> Tuple[int, Optional[tuple]]:
        """(n, s): the most leading tokens of ``seq`` a kept sequence ``s`` shares (s None when none is kept)."""
        *_, (node, n, edge) = self._walk(tuple(seq))
        if edge is not None:
            node = edge[1]
        return n, self._any_below(node)

    def covering(self, seq: Sequence[int]) -> Optional[tuple]:
        """A kept sequence that begins with ``seq`` (``seq`` itself included), if any."""
        n, s = self.longest(seq)
        return s if n == len(seq) else None

    def prefixes(self, seq: Sequence[int]) -> List[tuple]:
        """The kept sequences that ``seq`` begins with (``seq`` itself included)."""
        return [node.end for node, _, edge in self._walk(tuple(seq)) if edge is None and node.end is not None]

    def add(self, seq: tuple) -> None:
        node, i = self.root, 0
        while i < len(seq):
            edge = node.edges.get(seq[i])
            if edge is None:
                node.edges[seq[i]] = [seq[i:], Node()]
                node = node.edges[seq[i]][1]
                break
            run, child = edge
            m = len(run) if seq[i:i + len(run)] == run else prefix_length(run, seq[i:i + len(run)])
            if m < len(run):  # the run parts from seq: a node where it does
                middle = Node()
                middle.edges[run[m]] = [run[m:], child]
                edge[0], edge[1] = run[:m], middle
                child = middle
            node, i = child, i + m
        node.end = seq

    def remove(self, seq: tuple) -> None:
        path = [(self.root, None)]  # (node, the token of the edge from its parent)
        node, i = self.root, 0
        while i < len(seq):
            run, node = node.edges[seq[i]]
            path.append((node, seq[i]))
            i += len(run)
        node.end = None
        while len(path) > 1 and node.end is None and not node.edges:  # prune what it leaves empty
            _, token = path.pop()
            node = path[-1][0]
            del node.edges[token]
        if len(path) > 1 and node.end is None and len(node.edges) == 1:  # join a node left with one edge
            parent, token = path[-2][0], path[-1][1]
            (run, child), = node.edges.values()
            parent.edges[token] = [parent.edges[token][0] + run, child]

    @staticmethod
    def _any_below(node: Node) -> Optional[tuple]:
        while node.end is None and node.edges:
            node = next(iter(node.edges.values()))[1]
        return node.end

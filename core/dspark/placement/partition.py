"""Fusing adjacent same-target ops into partitions without creating cycles."""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx

from dspark.graph.model import Graph


def fuse(graph: Graph, target_of: Callable[[str], str | None]) -> list[list[str]]:
    """Group ops into partitions: maximal runs along edges between ops of one target.

    Two groups merge across an edge when they share a target and the merged
    group would not both feed and depend on another group (a cycle between
    partitions, the classic partitioner bug). Ops whose target is None stay
    alone. Returns partitions in a dependency order, ops in graph order.
    """
    group = {op.name: i for i, op in enumerate(graph.ops)}
    members: dict[int, list[str]] = {i: [op.name] for i, op in enumerate(graph.ops)}
    dag = nx.DiGraph()
    dag.add_nodes_from(members)
    edges = graph.edges()
    for u, v, _ in edges:
        if group[u] != group[v]:
            dag.add_edge(group[u], group[v])
    for u, v, _ in edges:
        a, b = group[u], group[v]
        if a == b or target_of(u) is None or target_of(u) != target_of(v):
            continue
        if _creates_cycle(dag, a, b):
            continue
        # Contract b into a.
        for p in list(dag.predecessors(b)):
            if p != a:
                dag.add_edge(p, a)
        for s in list(dag.successors(b)):
            if s != a:
                dag.add_edge(a, s)
        dag.remove_node(b)
        for name in members.pop(b):
            group[name] = a
            members[a].append(name)
    order = {op.name: i for i, op in enumerate(graph.ops)}
    return [sorted(members[g], key=order.__getitem__) for g in nx.lexicographical_topological_sort(dag)]


def _creates_cycle(dag: nx.DiGraph, a: int, b: int) -> bool:
    """Would merging a and b close a cycle through a third group?"""
    for x, y in ((a, b), (b, a)):
        for s in dag.successors(x):
            if s != y and nx.has_path(dag, s, y):
                return True
    return False

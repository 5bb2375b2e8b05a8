"""Data-flow helpers of the attention analysis, on hand-built fx graphs."""

from torch import fx

from hfrewrite.analyze.dataflow import reaches


def diamond():
    """a -> b -> d and a -> c -> d."""
    g = fx.Graph()
    a = g.placeholder("a")
    b = g.call_function(abs, (a,))
    c = g.call_function(abs, (a,))
    d = g.call_function(max, (b, c))
    g.output(d)
    return a, b, c, d


def test_reaches_through_allowed_nodes_only():
    a, b, c, d = diamond()
    assert reaches(a, d, {a, b})  # a -> b -> d
    assert reaches(a, d, {a, c})  # a -> c -> d
    assert reaches(a, b, {a})  # a direct use
    assert not reaches(b, c, {a, b, c})  # no path from b to c
    assert not reaches(a, d, {b, c})  # the source itself must be allowed


def test_blocked_when_every_path_leaves_the_allowed_set():
    a, b, c, d = diamond()
    g = a.graph
    e = g.call_function(abs, (d,))
    assert not reaches(a, e, {a, b, c})  # d, on every path, is not allowed
    assert reaches(a, e, {a, b, d})

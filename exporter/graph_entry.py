"""A graph's manifest entry: `graphs.span_graph.GraphSpec` (what the graph computes) as the
runtime's `GraphEntry`, the one place that derives a graph's I/O names (docs/architecture.md
section 3). graphs/ imports nothing of the project, so the names live with the manifest's
reader, and the exporter, which sees both, copies the fields across (`manifest_graph` one way,
`spec_of_entry` the other) and traces with the entry's names.
"""

from __future__ import annotations

from dataclasses import fields, replace

from adaptive_export.graphs.span_graph import GraphSpec
from adaptive_export.runtimes.manifest import GraphEntry

_GRAPH_FIELDS = tuple(f.name for f in fields(GraphSpec))
if set(_GRAPH_FIELDS) != {f.name for f in fields(GraphEntry)} - {"inputs", "outputs"}:  # pragma: no cover
    raise RuntimeError("graphs.span_graph.GraphSpec and runtimes.manifest.GraphEntry declare different fields")


def manifest_graph(graph: GraphSpec) -> GraphEntry:
    """The manifest's typed entry of a graph: the same fields, and the I/O names the entry derives
    (the names the exporter traces the graph with)."""
    entry = GraphEntry(**{name: getattr(graph, name) for name in _GRAPH_FIELDS})
    return replace(entry, inputs=tuple(entry.input_names()), outputs=tuple(entry.output_names()))


def spec_of_entry(entry: GraphEntry) -> GraphSpec:
    """The other way: a bundle's graph as the GraphSpec the PyTorch reference builds (`check`).
    The manifest checked every field on reading (a config may be None: the manifest names none)."""
    return GraphSpec(**{name: getattr(entry, name) for name in _GRAPH_FIELDS})

"""Stage 2: the operator graph (networkx) with shapes, dtypes, FLOPs and bytes per node."""

from autotp.graph.opgraph import OpGraph, OpNode, TensorMeta, build_opgraph

__all__ = ["OpGraph", "OpNode", "TensorMeta", "build_opgraph"]

"""Analysis: dimension maps, ParallelBlocks and segments (CFP §3-4) over the captured graph."""

from autopar.analysis.blocks import BlockGraph, ParallelBlock, build_blocks, is_leader
from autopar.analysis.dims import Dim, Linearity, OpDims, Split, dim_rule, op_dims
from autopar.analysis.segments import Segment, find_segments

__all__ = [
    "BlockGraph",
    "Dim",
    "Linearity",
    "OpDims",
    "ParallelBlock",
    "Segment",
    "Split",
    "build_blocks",
    "dim_rule",
    "find_segments",
    "is_leader",
    "op_dims",
]

"""Compiler passes over the Graph IR, run in order by `optimize`."""
from __future__ import annotations

from ..graph import Graph, toposort
from .constant_folding import fold_constants, fold_to_fixpoint
from .recurrent_loops import rewrite_recurrent_loops
from .dce import eliminate_dead_nodes
from .fusion import fold_scale_into_softmax, fuse
from .blocked import to_blocked
from .layout import to_nhwc
from .siblings import merge_sibling_matmuls
from .strides import hoist_strides
from .squeeze_excite import fuse_squeeze_excite
from .chains import chain_dense_layers
from .attention import fuse_attention
from .affine import fold_affine_chains
from .concat_chains import grow_concat_chains
from .conv_pool import fuse_conv_max_pool, pool_before_pointwise
from . import quantization
from .shape_inference import infer_shapes
from .views import collapse_views, matmul_operands_as_views

PIPELINE = ("infer_shapes", "quantization.prepare", "fold_constants", "rewrite_recurrent_loops", "fuse", "hoist_strides", "quantization.requantize", "merge_sibling_matmuls",
            "fold_scale_into_softmax", "to_nhwc",
            "collapse_views", "fuse_attention", "matmul_operands_as_views", "chain_dense_layers", "fuse_squeeze_excite", "fold_affine_chains", "fuse_conv_max_pool", "pool_before_pointwise", "to_blocked", "eliminate_dead_nodes", "infer_shapes", "grow_concat_chains")


def optimize(graph: Graph, fusion: bool = True, layout: bool = True) -> Graph:
    """All passes in order. `layout=False` keeps NCHW (device runtimes whose kernels are NCHW)."""
    infer_shapes(graph)
    quantization.prepare(graph)  # before folding turns int8 weights back into float ones
    fold_to_fixpoint(graph)
    if fusion:
        rewrite_recurrent_loops(graph)
        infer_shapes(graph)
        hoist_strides(toposort(fuse(graph)))
    quantization.requantize(graph)  # also clears what prepare noted for it
    if fusion and layout:  # host kernels: device runtimes keep their matmuls as they are
        merge_sibling_matmuls(graph)
        fold_scale_into_softmax(graph)
        infer_shapes(graph)
        toposort(to_nhwc(graph))
    if fusion:
        infer_shapes(graph)
        collapse_views(graph)
    if fusion and layout:
        fuse_attention(eliminate_dead_nodes(graph))  # collapsed views leave their first reshapes unread
        matmul_operands_as_views(graph)
        chain_dense_layers(graph)
        fuse_squeeze_excite(graph)
        fold_affine_chains(graph)
        infer_shapes(graph)
        fuse_conv_max_pool(graph)  # reads the convolutions' result shapes
        pool_before_pointwise(graph)
        infer_shapes(graph)
        to_blocked(graph)
    eliminate_dead_nodes(graph)
    infer_shapes(graph)
    if fusion and layout:
        grow_concat_chains(graph)  # last: its views' readers are final
    return graph


__all__ = ["optimize", "fold_constants", "rewrite_recurrent_loops", "fuse", "hoist_strides", "merge_sibling_matmuls", "chain_dense_layers", "fuse_squeeze_excite", "fold_affine_chains", "fuse_conv_max_pool", "pool_before_pointwise", "grow_concat_chains", "fuse_attention", "fold_scale_into_softmax", "to_nhwc", "to_blocked", "collapse_views", "matmul_operands_as_views", "eliminate_dead_nodes", "infer_shapes", "PIPELINE"]

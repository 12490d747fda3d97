"""A convolution and the pooling that is its one reader, made cheaper together (NHWC ops: runs
after the layout pass, and before the blocked one, which leaves pooled convolutions NHWC).

fuse_conv_max_pool: a 3x3 convolution's 2x2 max pooling made in its Winograd tiles
(kernels/winograd.py),

    FusedConvNHWC(x) -> MaxPoolNHWC(2x2, stride 2, no padding)

becomes one FusedConvNHWC marked MAX_POOL_2X2. Why: the convolution's results are four times the
pooling's, written out and read back for one pass of maxima (a VGG-style block's last layer, a
small CNN's); the tiles hold each 2x2 square when they are made. Taken only where the convolution
runs on Winograd's form at every batch (its layer shape has even sides and enough tiles at batch
1): elsewhere the pooling would run after the convolution in the same step, and leave the chains
that run the two as one call.

pool_before_pointwise: an unpadded average pooling of a 1x1 convolution's results (DenseNet's
transition layers) runs first, on the convolution's input. A 1x1 convolution maps each pixel on
its own, by the same affine map, so it commutes with averaging pixels: the convolution then
computes a quarter of the pixels (a 2x2 pooling's), for a pooling pass over its input channels
instead of its output channels. Results are within float32's rounding of the other order.
"""
from __future__ import annotations

from ..graph import Graph, Node, unique_name
from ..kernels import onednn, winograd
from ..kernels.nhwc import MAX_POOL_2X2
from .fusion import ConsumerIndex, explicit_pads


def _unpadded(node: Node) -> bool:
    """A node whose windows lie inside the image: no padding (auto_pad NOTSET or VALID)."""
    return node.attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID") and not any(explicit_pads(node))


def _whole_windows(node: Node) -> bool:
    """A pooling of whole windows inside the image: unpadded, floor mode, no dilation, one output."""
    a = node.attrs
    return len(node.outputs) == 1 and _unpadded(node) and all(d == 1 for d in a.get("dilations") or ()) and not a.get("ceil_mode", 0)


def _pools_2x2(node: Node) -> bool:
    """A max pooling of 2x2 windows, stride 2, unpadded and in floor mode, with no indices output."""
    return (node.op == "MaxPoolNHWC" and _whole_windows(node) and list(node.attrs.get("kernel_shape") or ()) == [2, 2]
            and list(node.attrs.get("strides") or ()) == [2, 2])


def _on_winograd_tiles(graph: Graph, conv: Node) -> bool:
    """Whether `conv` runs on Winograd's form with its pooling in the tiles at every batch."""
    if conv.attrs.get(MAX_POOL_2X2) or len(conv.inputs) > 3 and conv.inputs[3]:
        return False
    w = graph.constants.get(conv.inputs[1])
    act = onednn.activation_post_op(conv.attrs.get("activation")) if onednn.AVAILABLE else False
    if (not winograd.ENABLED or w is None or w.ndim != 4 or isinstance(act, bool)
            or not winograd.applies(w, conv.attrs.get("group", 1), list(conv.attrs.get("strides") or [1, 1]),
                                    list(conv.attrs.get("dilations") or [1, 1]), act, False)):
        return False
    info = graph.values.get(conv.outputs[0])
    shape = None if info is None else info.shape
    if info is None or shape is None or len(shape) != 4 or str(info.dtype) != "float32":
        return False
    oh, ow = int(shape[1]), int(shape[2])
    return oh > 0 and ow > 0 and winograd.pools(oh, ow) and winograd.tiles_of(1, oh, ow) >= winograd.MIN_TILES


def _conv_read_only_by(idx: ConsumerIndex, producers: dict[str, Node], pool: Node) -> Node | None:
    """The FusedConvNHWC whose result `pool` alone reads; None where there is none."""
    conv = producers.get(pool.inputs[0])
    if conv is None or conv.op != "FusedConvNHWC" or idx.sole_user(conv.outputs[0]) is not pool:
        return None
    return conv


def _pointwise(graph: Graph, conv: Node) -> bool:
    """A float32 1x1 convolution of stride 1, unpadded, with no activation and no residual sum:
    the same affine map of each pixel alone."""
    a = conv.attrs
    w = graph.constants.get(conv.inputs[1])
    info = graph.values.get(conv.inputs[0])
    return (w is not None and w.ndim == 4 and w.shape[2:] == (1, 1) and not a.get("activation") and not a.get(MAX_POOL_2X2)
            and not (len(conv.inputs) > 3 and conv.inputs[3]) and all(s == 1 for s in a.get("strides") or ())
            and _unpadded(conv) and info is not None and str(info.dtype) == "float32")


def pool_before_pointwise(graph: Graph) -> Graph:
    idx, producers, taken = ConsumerIndex(graph), graph.producers(), graph.value_names()
    for pool in [n for n in graph.nodes if n.op == "AveragePoolNHWC" and _whole_windows(n)]:
        conv = _conv_read_only_by(idx, producers, pool)
        if conv is None or not _pointwise(graph, conv):
            continue
        pooled = unique_name(f"{pool.outputs[0]}/before_{conv.name}", taken)
        graph.values.pop(conv.outputs[0], None)
        pool.inputs, pool.outputs, conv.inputs[0], conv.outputs = [conv.inputs[0]], [pooled], pooled, list(pool.outputs)
        i, j = graph.nodes.index(conv), graph.nodes.index(pool)
        graph.nodes[i], graph.nodes[j] = pool, conv  # the pool reads what the convolution read: it goes where that was
        idx.users = graph.consumers()
    return graph


def fuse_conv_max_pool(graph: Graph) -> Graph:
    idx, producers = ConsumerIndex(graph), graph.producers()
    for pool in [n for n in graph.nodes if _pools_2x2(n)]:
        conv = _conv_read_only_by(idx, producers, pool)
        if conv is None or not _on_winograd_tiles(graph, conv):
            continue
        graph.values.pop(conv.outputs[0], None)
        conv.attrs = {**conv.attrs, MAX_POOL_2X2: 1}
        idx.bypass(pool, conv)
    return graph


__all__ = ["fuse_conv_max_pool", "pool_before_pointwise"]

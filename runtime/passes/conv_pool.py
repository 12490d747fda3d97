"""A 3x3 convolution's 2x2 max pooling made in its Winograd tiles (kernels/winograd.py): in NHWC,

    FusedConvNHWC(x) -> MaxPoolNHWC(2x2, stride 2, no padding)

becomes one FusedConvNHWC marked MAX_POOL_2X2, where the pooling is the convolution's one reader.
Why: the convolution's results are four times the pooling's, written out and read back for one
pass of maxima (a VGG-style block's last layer, a small CNN's); the tiles hold each 2x2 square
when they are made. Taken only where the convolution runs on Winograd's form at every batch
(its layer shape has even sides and enough tiles at batch 1): elsewhere the pooling would run
after the convolution in the same step, and leave the chains that run the two as one call.
Runs after the layout pass (the pattern is in its NHWC ops) and before the blocked one, which
leaves pooled convolutions NHWC.
"""
from __future__ import annotations

from typing import Any

from ..graph import Graph, Node
from ..kernels import onednn, winograd
from ..kernels.nhwc import MAX_POOL_2X2


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pools_2x2(node: Node) -> bool:
    """A max pooling of 2x2 windows, stride 2, unpadded and in floor mode, with no indices output."""
    a = node.attrs
    return (node.op == "MaxPoolNHWC" and len(node.outputs) == 1 and list(a.get("kernel_shape") or ()) == [2, 2]
            and list(a.get("strides") or ()) == [2, 2] and not any(a.get("pads") or ())
            and all(d == 1 for d in a.get("dilations") or ()) and not a.get("ceil_mode", 0)
            and _text(a.get("auto_pad", "NOTSET")) in ("NOTSET", "VALID", ""))


def _on_winograd_tiles(graph: Graph, conv: Node) -> bool:
    """Whether `conv` runs on Winograd's form with its pooling in the tiles at every batch."""
    if conv.op != "FusedConvNHWC" or conv.attrs.get(MAX_POOL_2X2) or len(conv.inputs) > 3 and conv.inputs[3]:
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


def fuse_conv_max_pool(graph: Graph) -> Graph:
    users, outputs, producers = graph.consumers(), graph.output_names(), graph.producers()
    for pool in [n for n in graph.nodes if _pools_2x2(n)]:
        conv = producers.get(pool.inputs[0])
        if conv is None or conv.outputs[0] in outputs or len(users.get(conv.outputs[0], [])) != 1:
            continue
        if not _on_winograd_tiles(graph, conv):
            continue
        graph.values.pop(conv.outputs[0], None)
        conv.outputs = list(pool.outputs)
        conv.attrs = {**conv.attrs, MAX_POOL_2X2: 1}
        graph.nodes.remove(pool)
    return graph


__all__ = ["fuse_conv_max_pool"]

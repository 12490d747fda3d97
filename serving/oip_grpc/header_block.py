"""HPACK (RFC 7541) decoding of a connection's request header blocks, and the one literal form
answers are written in.

Why not `hpack.Decoder`: a gRPC call's block is a dozen table references and one new grpc-timeout,
and that decoder spends tens of microseconds on it (a tuple type, a log call and a unicode check per
field), a tenth of a small model's whole call. This one reads the same blocks into a dict of bytes;
the static table and the Huffman code are the `hpack` package's.
"""
from __future__ import annotations

import collections

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

STATIC = HeaderTable.STATIC_TABLE
ENTRY_OVERHEAD = 32  # what RFC 7541 counts per entry on top of its name and value
DEFAULT_TABLE_SIZE = 4096  # SETTINGS_HEADER_TABLE_SIZE: this server announces no other
HUFFMAN_MEMO = 512  # Huffman strings remembered decoded (a call's values repeat from call to call)


class HeaderBlockError(ValueError):
    """A block that does not decode: the connection's table can no longer be trusted."""


def _integer(block: bytes, at: int, bits: int) -> tuple[int, int]:
    limit = (1 << bits) - 1
    value = block[at] & limit
    at += 1
    if value < limit:
        return value, at
    shift = 0
    while True:
        b = block[at]
        at += 1
        value += (b & 0x7F) << shift
        if not b & 0x80:
            return value, at
        shift += 7
        if shift > 28:
            raise HeaderBlockError("an HPACK integer longer than 4 bytes")


class HeaderDecoder:
    """One connection's decoding state: its dynamic table, in the order the client's encoder filled it."""

    def __init__(self, max_list_size: int) -> None:
        self.table: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self.size = 0
        self.max_size = DEFAULT_TABLE_SIZE
        self.max_list_size = max_list_size
        self._huffman: dict[bytes, bytes] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """A header block's fields, in order."""
        fields: list[tuple[bytes, bytes]] = []
        at, n, listed = 0, len(block), 0
        try:
            while at < n:
                b = block[at]
                if b & 0x80:  # indexed field
                    index, at = _integer(block, at, 7)
                    name, value = self._entry(index)
                elif b & 0xC0 == 0x40:  # literal, added to the table
                    index, at = _integer(block, at, 6)
                    name, at = (self._entry(index)[0], at) if index else self._string(block, at)
                    value, at = self._string(block, at)
                    self._add(name, value)
                elif b & 0xE0 == 0x20:  # the table's new size, only before the block's first field
                    if fields:
                        raise HeaderBlockError("a table size update after a header field")
                    size, at = _integer(block, at, 5)
                    if size > DEFAULT_TABLE_SIZE:
                        raise HeaderBlockError(f"a table size of {size}, past the {DEFAULT_TABLE_SIZE} this server announced")
                    self.max_size = size
                    self._evict()
                    continue
                else:  # literal, never or not added to the table
                    index, at = _integer(block, at, 4)
                    name, at = (self._entry(index)[0], at) if index else self._string(block, at)
                    value, at = self._string(block, at)
                listed += len(name) + len(value) + ENTRY_OVERHEAD
                if listed > self.max_list_size:
                    raise HeaderBlockError(f"a header list past {self.max_list_size} bytes, the most this server takes")
                fields.append((name, value))
        except IndexError:
            raise HeaderBlockError("a header block cut short") from None
        return fields

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= len(STATIC):
            return STATIC[index - 1]
        at = index - len(STATIC) - 1
        if 0 <= at < len(self.table):
            return self.table[at]
        raise HeaderBlockError(f"table index {index}, past the {len(STATIC) + len(self.table)} entries there are")

    def _string(self, block: bytes, at: int) -> tuple[bytes, int]:
        huffman = block[at] & 0x80
        length, at = _integer(block, at, 7)
        end = at + length
        if end > len(block):
            raise IndexError
        raw = block[at:end]
        if not huffman:
            return raw, end
        plain = self._huffman.get(raw)
        if plain is None:
            try:
                plain = decode_huffman(raw)
            except Exception as e:  # hpack raises its own error type for a bad code
                raise HeaderBlockError(f"a Huffman string that does not decode: {e}") from None
            if len(self._huffman) >= HUFFMAN_MEMO:
                self._huffman.clear()
            self._huffman[raw] = plain
        return plain, end

    def _add(self, name: bytes, value: bytes) -> None:
        self.table.appendleft((name, value))
        self.size += len(name) + len(value) + ENTRY_OVERHEAD
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.table:
            name, value = self.table.pop()
            self.size -= len(name) + len(value) + ENTRY_OVERHEAD


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal_header(name: bytes, value: bytes) -> bytes:
    """One field as an HPACK literal never added to the table, its name and value plain strings:
    answers written this way leave the client's table as it was, whatever size it has."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value

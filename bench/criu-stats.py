#!/usr/bin/env python3
"""Prints CRIU's own dump statistics (the `stats-dump` image) as JSON, in milliseconds.

    bench/criu-stats.py <image-dir>

freezing: CRIU freezing the tree; frozen: from frozen to thawed (the dump proper); memdump:
draining the pages into pipes (vmsplice); memwrite: writing those pipes to the image files.
Decodes the protobuf by hand (criu/images/stats.proto), so no crit is needed.
"""
import json
import struct
import sys

FIELDS = {1: "freezing_ms", 2: "frozen_ms", 3: "memdump_ms", 4: "memwrite_ms",
          5: "pages_scanned", 7: "pages_written"}
TIMES = {"freezing_ms", "frozen_ms", "memdump_ms", "memwrite_ms"}


def varint(b, i):
    n = shift = 0
    while True:
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return n, i


def fields(b):
    i, out = 0, {}
    while i < len(b):
        tag, i = varint(b, i)
        num, wire = tag >> 3, tag & 7
        if wire == 0:
            v, i = varint(b, i)
        elif wire == 2:
            n, i = varint(b, i)
            v, i = b[i:i + n], i + n
        elif wire == 5:
            v, i = b[i:i + 4], i + 4
        elif wire == 1:
            v, i = b[i:i + 8], i + 8
        else:
            raise ValueError(f"wire type {wire}")
        out[num] = v
    return out


def main():
    data = open(sys.argv[1] + "/stats-dump", "rb").read()
    first = struct.unpack_from("<I", data, 0)[0]
    off = 8 if first in (0x54564319, 0x55105940) else 4
    size = struct.unpack_from("<I", data, off)[0]
    dump = fields(fields(data[off + 4:off + 4 + size])[1])
    out = {}
    for num, name in FIELDS.items():
        v = dump.get(num, 0)
        out[name] = round(v / 1000, 1) if name in TIMES else v
    print(json.dumps(out))


main()

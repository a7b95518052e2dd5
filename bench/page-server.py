#!/usr/bin/env python3
"""A page server for `runc checkpoint --page-server` that keeps the pages in memory faulted in
beforehand (bench/freeze-transport.sh): does CRIU's page server take the first-touch cost of the
image files out of the freeze?

    bench/page-server.py <port> <MiB of memory to fault in first>

Speaks the receiving side of CRIU's page-xfer protocol (criu/page-xfer.c): 32-byte
`page_server_iov {u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id}` headers; PS_IOV_OPEN2 is
answered with has_parent = 0, PS_IOV_PARENT with 0, PS_IOV_ADD_F with PE_PRESENT is followed by
its pages, PS_IOV_CLOSE is answered with status 0. The pagemaps are not kept (a measurement, not
a checkpoint). Prints "ready" once listening, then one JSON line when the dump closes.
"""
import json
import mmap
import socket
import struct
import sys
import time

PAGE = 4096
ADD, HOLE, OPEN, OPEN2, PARENT, ADD_F = 1, 2, 3, 4, 5, 6
CLOSE, FORCE_CLOSE = 0x1023, 0x1024
PE_PRESENT = 1 << 2


def main():
    port, mib = int(sys.argv[1]), int(sys.argv[2])
    buf = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    started = time.monotonic()
    for i in range(0, mib << 20, PAGE):
        buf[i] = 1
    fault_ms = (time.monotonic() - started) * 1000
    mem = memoryview(buf)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(1)
    print("ready", flush=True)
    sk, _ = ls.accept()
    sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    received = adds = 0
    first = None
    while True:
        head = sk.recv(32, socket.MSG_WAITALL)
        if len(head) < 32:
            sys.exit("page-server: the dump closed the connection without PS_IOV_CLOSE")
        cmd, nr_pages, _vaddr, _dst = struct.unpack("=I4xQQQ", head)
        op, flags = cmd & 0xFFFF, cmd >> 16
        first = first or time.monotonic()
        if op == OPEN2:
            sk.sendall(b"\0")
        elif op == PARENT:
            sk.sendall(struct.pack("=i", 0))
        elif op in (ADD, ADD_F) and (op == ADD or flags & PE_PRESENT):
            left = nr_pages * PAGE
            if received + left > len(buf):
                sys.exit(f"page-server: more than the {mib} MiB faulted in")
            adds += 1
            while left:
                n = sk.recv_into(mem[received:received + left], left)
                if n == 0:
                    sys.exit("page-server: the dump closed the connection mid-pages")
                received += n
                left -= n
        elif op in (CLOSE, FORCE_CLOSE):
            sk.sendall(struct.pack("=i", 0))
            break
        elif op not in (OPEN, HOLE, ADD_F):
            sys.exit(f"page-server: unknown command {cmd:#x}")
    print(json.dumps({"faulted_in_ms": round(fault_ms), "received_mib": received >> 20,
                      "adds": adds, "receive_ms": round((time.monotonic() - first) * 1000)}),
          flush=True)


if __name__ == "__main__":
    main()

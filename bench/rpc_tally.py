#!/usr/bin/env python3
"""A counting TCP relay for ONC RPC over TCP: listens on an ephemeral
127.0.0.1 port, relays every connection to TARGET_PORT and counts the calls
going to the server by (program, procedure), with WRITE3's stable_how. Used
to check what a client really sends (e.g. that libnfs's O_SYNC gives
FILE_SYNC writes, and how many RPCs one nfs_stat64 is).

Usage: bench/rpc_tally.py TARGET_PORT [MOUNT_TARGET_PORT]
Prints "listening on PORT [MOUNT_PORT]" (a second relay when the server's
MOUNT has a port of its own, as ganesha's), then the counts on SIGINT /
SIGTERM.
"""

import asyncio
import collections
import os
import signal
import struct
import sys

NFS3_PROCS = ["NULL", "GETATTR", "SETATTR", "LOOKUP", "ACCESS", "READLINK", "READ", "WRITE", "CREATE",
              "MKDIR", "SYMLINK", "MKNOD", "REMOVE", "RMDIR", "RENAME", "LINK", "READDIR", "READDIRPLUS",
              "FSSTAT", "FSINFO", "PATHCONF", "COMMIT"]
STABLE = {0: "UNSTABLE", 1: "DATA_SYNC", 2: "FILE_SYNC"}
counts = collections.Counter()


def tally_call(msg):
    xid, mtype = struct.unpack_from(">II", msg, 0)
    if mtype != 0:
        return
    _rpcvers, prog, vers, proc = struct.unpack_from(">IIII", msg, 8)
    pos = 24
    for _ in range(2):  # credential, verifier
        _flavor, length = struct.unpack_from(">II", msg, pos)
        pos += 8 + (length + 3) // 4 * 4
    if prog == 100003 and vers == 3:
        name = NFS3_PROCS[proc] if proc < len(NFS3_PROCS) else f"proc{proc}"
        if name == "WRITE":
            (fhlen,) = struct.unpack_from(">I", msg, pos)
            pos += 4 + (fhlen + 3) // 4 * 4
            _offset, _count, stable = struct.unpack_from(">QII", msg, pos)
            name += f" {STABLE.get(stable, stable)}"
        counts[name] += 1
    else:
        counts[f"prog{prog} v{vers} proc{proc}"] += 1


async def client_to_server(reader, writer):
    buf = b""
    frags = b""
    while True:
        data = await reader.read(1 << 20)
        if not data:
            break
        writer.write(data)
        buf += data
        while len(buf) >= 4:
            (mark,) = struct.unpack_from(">I", buf, 0)
            length = mark & 0x7FFFFFFF
            if len(buf) < 4 + length:
                break
            frags += buf[4:4 + length]
            buf = buf[4 + length:]
            if mark & 0x80000000:
                tally_call(frags)
                frags = b""
        await writer.drain()
    writer.close()


async def pipe(reader, writer):
    while True:
        data = await reader.read(1 << 20)
        if not data:
            break
        writer.write(data)
        await writer.drain()
    writer.close()


async def main(targets):
    def relay(target):
        return lambda cr, cw: handle(cr, cw, target)

    async def handle(cr, cw, target):
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", target)
            await asyncio.gather(client_to_server(cr, sw), pipe(sr, cw), return_exceptions=True)
        except (ConnectionError, asyncio.CancelledError):
            pass

    servers = [await asyncio.start_server(relay(t), "127.0.0.1", 0) for t in targets]
    print("listening on " + " ".join(str(s.sockets[0].getsockname()[1]) for s in servers), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for name, n in sorted(counts.items()):
        print(f"{name}: {n}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main([int(a) for a in sys.argv[1:]]))

#!/usr/bin/env python3
"""Writes the regression seeds of the request-handler fuzz targets under
fuzz/corpus-seeds/{scsi_command,nfs_call}.

They carry the values a hostile client sends where arithmetic can go
wrong: LBAs, offsets and cookies at and near 2^64, lengths at 2^32,
ranges that end past the volume or the file. `cargo nextest run --release
--lib corpus_seeds call_seeds` replays them through
src/frontend/iscsi/fuzzing.rs (`scsi_input`: each command against a
logical unit on an 8 MiB in-memory volume) and src/frontend/nfs/fuzzing.rs
(`call_sequence_input`: each call against a small tree in an in-memory
dataset).

scsi_command format: a sequence of
[CDB length - 1 (low 4 bits)][data-out length: u16 big-endian][CDB][data-out].
nfs_call format: a sequence of
[procedure][flags][arguments length: u16 big-endian][arguments]; the low 3
bits of flags put a handle before the arguments (1: the root, 2: the file
/f of 10,000 bytes, 3: the directory /d holding the file e, 4: the symbolic
link /l), bit 3 calls as uid 1000 instead of root.
"""
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus-seeds")
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
BLOCKS = (8 << 20) // 512  # the fuzz volume's capacity in blocks


def write(target, name, data):
    os.makedirs(os.path.join(ROOT, target), exist_ok=True)
    with open(os.path.join(ROOT, target, name), "wb") as f:
        f.write(data)


# SCSI commands.
def command(cdb, data=b""):
    assert 1 <= len(cdb) <= 16
    return bytes([len(cdb) - 1]) + struct.pack(">H", len(data)) + cdb + data


def cdb16(opcode, lba, blocks, flags=0):
    return struct.pack(">BBQIBB", opcode, flags, lba, blocks, 0, 0)


def cdb10(opcode, lba, blocks, flags=0):
    return struct.pack(">BBIBHB", opcode, flags, lba, 0, blocks, 0)


READ10, WRITE10, READ16, WRITE16 = 0x28, 0x2A, 0x88, 0x8A
SYNC16, PREFETCH16, WRITE_SAME16, VERIFY16 = 0x91, 0x90, 0x93, 0x8F


def unmap(descriptors):
    body = b"".join(struct.pack(">QII", lba, blocks, 0) for lba, blocks in descriptors)
    params = struct.pack(">HHI", 6 + len(body), len(body), 0) + body
    cdb = struct.pack(">BBIBHB", 0x42, 0, 0, 0, len(params), 0)
    return command(cdb, params)


def get_lba_status(lba):
    return command(struct.pack(">BBQIBB", 0x9E, 0x12, lba, 32, 0, 0))


def compare_and_write(lba, blocks, data):
    return command(struct.pack(">BBQBBBBBB", 0x89, 0, lba, 0, 0, 0, blocks, 0, 0), data)


block = bytes(range(256)) * 2
scsi = {
    # The byte offset of these LBAs does not fit in 64 bits.
    "read16-lba-u64-max": command(cdb16(READ16, U64_MAX, 1)),
    "read16-lba-offset-wraps-to-zero": command(cdb16(READ16, 1 << 55, 8)),
    "sync-cache16-lba-u64-max": command(cdb16(SYNC16, U64_MAX, 0)),
    "prefetch16-lba-u64-max": command(cdb16(PREFETCH16, U64_MAX, U32_MAX)),
    "get-lba-status-lba-u64-max": get_lba_status(U64_MAX) + get_lba_status(BLOCKS - 1) + get_lba_status(BLOCKS),
    "write16-lba-u64-max": command(cdb16(WRITE16, U64_MAX, 1), block),
    "write-same16-unmap-lba-near-max": command(cdb16(WRITE_SAME16, U64_MAX - 3, 8, flags=0x08), bytes(512)),
    "verify16-bytchk-lba-u64-max": command(cdb16(VERIFY16, U64_MAX, 1, flags=0x02), block),
    # Ranges that end just past the volume, and just inside it.
    "write16-ends-past-the-volume": command(cdb16(WRITE16, BLOCKS - 1, 2), block * 2)
    + command(cdb16(WRITE16, BLOCKS - 1, 1), block)
    + command(cdb16(READ16, BLOCKS - 1, 1)),
    "unmap-descriptor-overflows": unmap([(U64_MAX - 1, 16)]) + unmap([(BLOCKS - 4, 8), (0, 8)]),
    "compare-and-write-at-the-end": compare_and_write(BLOCKS - 1, 1, bytes(1024))
    + compare_and_write(U64_MAX, 1, bytes(1024)),
    # Data-out shorter and longer than the CDB asks for (fitted as the
    # connection fits it), then read back.
    "write10-short-and-long-data": command(cdb10(WRITE10, 0, 8), block)
    + command(cdb10(WRITE10, 8, 1), block * 3)
    + command(cdb10(READ10, 0, 16)),
    "read10-lba-u32-max": command(cdb10(READ10, U32_MAX, 0xFFFF)),
}
for name, data in scsi.items():
    write("scsi_command", name, data)


# NFS calls.
READ, WRITE, SETATTR, REMOVE, READDIR, READDIRPLUS, COMMIT, LOOKUP, CREATE = 6, 7, 2, 12, 16, 17, 21, 3, 8
ROOT_FH, FILE_FH, DIR_FH, LINK_FH, USER = 1, 2, 3, 4, 8


def call(procedure, flags, args):
    return bytes([procedure, flags]) + struct.pack(">H", len(args)) + args


def string(text):
    return struct.pack(">I", len(text)) + text + bytes(-len(text) % 4)


def readdir(fh, cookie, count=4096):
    return call(READDIR, fh, struct.pack(">Q8sI", cookie, bytes(8), count))


def readdirplus(fh, cookie):
    return call(READDIRPLUS, fh, struct.pack(">Q8sII", cookie, bytes(8), 4096, 65536))


def sattr_size(size):
    # mode, uid, gid unset; size set; atime, mtime unchanged; no guard.
    return struct.pack(">IIIIQIII", 0, 0, 0, 1, size, 0, 0, 0)


nfs = {
    "null-and-a-procedure-past-commit": call(0, 0, b"") + call(0, ROOT_FH, b"\x00" * 3) + call(22, ROOT_FH, b""),
    # A cookie no listing gave out: nothing follows it, and the listing
    # never starts over.
    "readdir-cookie-u64-max": readdir(ROOT_FH, U64_MAX) + readdir(DIR_FH, U64_MAX),
    "readdirplus-cookie-u64-max": readdirplus(ROOT_FH, U64_MAX) + readdirplus(ROOT_FH, U64_MAX - 1),
    "readdir-from-the-start-and-past-the-end": readdir(ROOT_FH, 0)
    + readdir(ROOT_FH, 3)
    + readdir(ROOT_FH, 1 << 40)
    + readdir(ROOT_FH, 0, count=8),
    "read-offset-near-u64-max": call(READ, FILE_FH, struct.pack(">QI", U64_MAX, 4096))
    + call(READ, FILE_FH, struct.pack(">QI", 9_990, U32_MAX))
    + call(READ, FILE_FH, struct.pack(">QI", U64_MAX - 4095, U32_MAX)),
    "write-offset-near-u64-max": call(WRITE, FILE_FH, struct.pack(">QII", U64_MAX - 10, 16, 2) + string(bytes(16)))
    + call(WRITE, FILE_FH, struct.pack(">QII", (1 << 63) - 8, 16, 0) + string(bytes(16)))
    + call(WRITE, FILE_FH | USER, struct.pack(">QII", 10_000, 3, 1) + string(b"abc")),
    "commit-range-past-u64-max": call(COMMIT, FILE_FH, struct.pack(">QI", U64_MAX, U32_MAX))
    + call(COMMIT, FILE_FH, struct.pack(">QI", U64_MAX - 100, 4096)),
    "setattr-size-u64-max": call(SETATTR, FILE_FH, sattr_size(U64_MAX))
    + call(SETATTR, FILE_FH, sattr_size((1 << 63) + 1))
    + call(SETATTR, FILE_FH, sattr_size(4097))
    + call(READ, FILE_FH, struct.pack(">QI", 0, 8192)),
    "remove-then-list": call(REMOVE, DIR_FH, string(b"e"))
    + call(REMOVE, DIR_FH, string(b"e"))
    + readdir(DIR_FH, 0)
    + call(LOOKUP, DIR_FH, string(b"e")),
    "create-and-remove-as-a-user": call(CREATE, DIR_FH | USER, string(b"mine") + struct.pack(">I", 0) + struct.pack(">IIIIII", 0, 0, 0, 0, 0, 0))
    + call(REMOVE, DIR_FH | USER, string(b"mine"))
    + call(REMOVE, ROOT_FH | USER, string(b"f")),
}
for name, data in nfs.items():
    write("nfs_call", name, data)

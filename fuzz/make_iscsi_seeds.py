#!/usr/bin/env python3
"""Writes the iSCSI regression seeds under fuzz/corpus-seeds/iscsi_{pdu,login,cdb}.

The seeds model inputs that broke other iSCSI targets (oversized CHAP_R and
CHAP_C, very long keys echoed back, huge data segment lengths, login PDU
variants, malformed CDBs). `cargo test --release --lib corpus_seeds` replays
them through src/frontend/iscsi/fuzzing.rs. Login seed names say how the login
must end: `ok-...` completes, `fail-XXXX-...` fails with status 0xXXXX.

Login seed format (what `fuzzing::login_input` reads): a sequence of
[48-byte BHS][u16 big-endian text length][text].
"""
import base64
import hashlib
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus-seeds")
RANDOM = 0x5A  # fuzzing::FUZZ_RANDOM_BYTE: the fixed "random" challenge byte
CHAP_USER, CHAP_SECRET = b"fuzzer", b"fuzz-secret-12"
MUTUAL_SECRET = b"fuzz-target-secret"


def write(target, name, data):
    os.makedirs(os.path.join(ROOT, target), exist_ok=True)
    with open(os.path.join(ROOT, target, name), "wb") as f:
        f.write(data)


def bhs(opcode, flags=0, data_len=0, itt=1, cmdsn=1, ahs_words=0, immediate=True, lun_or_isid=b"\x80\x00\x00\x00\x00\x01"):
    h = bytearray(48)
    h[0] = opcode | (0x40 if immediate else 0)
    h[1] = flags
    h[4] = ahs_words
    h[5:8] = data_len.to_bytes(3, "big")
    h[8:14] = lun_or_isid
    h[16:20] = itt.to_bytes(4, "big")
    h[24:28] = cmdsn.to_bytes(4, "big")
    return h


def login_step(flags, text, opcode=0x03):
    return bytes(bhs(opcode, flags, len(text))) + struct.pack(">H", len(text)) + text


def kv(*pairs):
    return b"".join(k + b"=" + v + b"\0" for k, v in pairs)


def hexv(data):
    return b"0x" + data.hex().encode()


def chap_answer(identifier, secret, challenge):
    return hashlib.md5(bytes([identifier]) + secret + challenge).digest()


OUR_CHALLENGE = bytes([RANDOM] * 16)
GOOD_R = hexv(chap_answer(RANDOM, CHAP_SECRET, OUR_CHALLENGE))
SEC_T, SEC, OP_T = 0x81, 0x01, 0x87  # security->operational, security, operational->full


def first(target, initiator=b"iqn.fuzz:i", auth=b"CHAP,None"):
    return login_step(SEC_T, kv((b"InitiatorName", initiator), (b"TargetName", target), (b"AuthMethod", auth)))


def chap_login(target, answer_pairs, operational=True):
    steps = first(target) + login_step(SEC, kv((b"CHAP_A", b"5")))
    steps += login_step(SEC_T, kv(*answer_pairs))
    if operational:
        steps += login_step(OP_T, kv((b"HeaderDigest", b"None"), (b"MaxRecvDataSegmentLength", b"65536")))
    return steps


# --- login -----------------------------------------------------------------
L = "iscsi_login"
write(L, "ok-chap-full-login", chap_login(b"iqn.fuzz:chap", [(b"CHAP_N", CHAP_USER), (b"CHAP_R", GOOD_R)]))
write(
    L,
    "ok-mutual-chap-full-login",
    chap_login(
        b"iqn.fuzz:mutual",
        [(b"CHAP_N", CHAP_USER), (b"CHAP_R", GOOD_R), (b"CHAP_I", b"7"), (b"CHAP_C", hexv(bytes(range(16))))],
    ),
)
write(
    L,
    "ok-no-auth-straight-to-operational",
    login_step(OP_T, kv((b"InitiatorName", b"iqn.fuzz:i"), (b"TargetName", b"iqn.fuzz:plain"))),
)
write(
    L,
    "ok-discovery-without-auth",
    login_step(OP_T, kv((b"InitiatorName", b"iqn.fuzz:i"), (b"SessionType", b"Discovery"))),
)
write(
    L,
    "fail-0201-wrong-secret",
    chap_login(b"iqn.fuzz:chap", [(b"CHAP_N", CHAP_USER), (b"CHAP_R", hexv(chap_answer(RANDOM, b"wrong-secret-1", OUR_CHALLENGE)))]),
)
write(L, "fail-0201-unknown-user", chap_login(b"iqn.fuzz:chap", [(b"CHAP_N", b"mallory"), (b"CHAP_R", GOOD_R)]))
write(
    L,
    "fail-0201-reflected-challenge",
    chap_login(
        b"iqn.fuzz:mutual",
        [(b"CHAP_N", CHAP_USER), (b"CHAP_R", GOOD_R), (b"CHAP_I", str(RANDOM).encode()), (b"CHAP_C", hexv(OUR_CHALLENGE))],
    ),
)
write(L, "fail-0201-mutual-required-not-asked", chap_login(b"iqn.fuzz:mutual", [(b"CHAP_N", CHAP_USER), (b"CHAP_R", GOOD_R)]))
write(
    L,
    "fail-0201-skip-security-on-chap-target",
    login_step(OP_T, kv((b"InitiatorName", b"iqn.fuzz:i"), (b"TargetName", b"iqn.fuzz:chap"))),
)
write(L, "fail-0201-auth-none-only-on-chap-target", first(b"iqn.fuzz:chap", auth=b"None"))
write(
    L,
    "fail-0201-no-md5-algorithm",
    first(b"iqn.fuzz:chap") + login_step(SEC, kv((b"CHAP_A", b"6,7,128"))),
)
# CVE-style: a CHAP_R far longer than any digest, within the text limits...
write(
    L,
    "fail-0200-oversized-chap-r-hex",
    chap_login(b"iqn.fuzz:chap", [(b"CHAP_N", CHAP_USER), (b"CHAP_R", b"0x" + b"ab" * 1000)]),
)
write(
    L,
    "fail-0200-oversized-chap-r-base64",
    chap_login(b"iqn.fuzz:chap", [(b"CHAP_N", CHAP_USER), (b"CHAP_R", b"0b" + base64.b64encode(b"\xff" * 1200))]),
)
# ...and beyond them (a 60000-byte value).
write(
    L,
    "fail-0200-huge-chap-r-value",
    chap_login(b"iqn.fuzz:chap", [(b"CHAP_N", CHAP_USER), (b"CHAP_R", b"0x" + b"f" * 60000)]),
)
write(
    L,
    "fail-0200-oversized-chap-c",
    chap_login(
        b"iqn.fuzz:mutual",
        [(b"CHAP_N", CHAP_USER), (b"CHAP_R", GOOD_R), (b"CHAP_I", b"1"), (b"CHAP_C", b"0b" + base64.b64encode(b"\x01" * 1100))],
    ),
)
write(
    L,
    "fail-0200-chap-i-out-of-range",
    chap_login(
        b"iqn.fuzz:mutual",
        [(b"CHAP_N", CHAP_USER), (b"CHAP_R", GOOD_R), (b"CHAP_I", b"99999999999"), (b"CHAP_C", hexv(bytes(16)))],
    ),
)
write(L, "fail-0207-missing-chap-r", chap_login(b"iqn.fuzz:chap", [(b"CHAP_N", CHAP_USER)]))
write(L, "fail-0207-missing-initiator-name", login_step(SEC_T, kv((b"TargetName", b"iqn.fuzz:plain"))))
write(
    L,
    "fail-0200-very-long-key-echo",
    login_step(SEC_T, kv((b"InitiatorName", b"iqn.fuzz:i"), (b"TargetName", b"iqn.fuzz:plain"), (b"K" * 5000, b"1"))),
)
write(
    L,
    "fail-0200-chap-keys-with-auth-none",
    first(b"iqn.fuzz:plain", auth=b"None") + login_step(SEC, kv((b"CHAP_A", b"5"))),
)
write(L, "fail-0202-initiator-not-on-acl", first(b"iqn.fuzz:acl", initiator=b"iqn.fuzz:other"))
write(
    L,
    "fail-020b-scsi-command-during-login",
    first(b"iqn.fuzz:plain", auth=b"None") + login_step(0x80, b"", opcode=0x01),
)
# Continuation (C bit) past the 64 KiB text bound.
cont = login_step(0x40, b"X" * 65535)
write(L, "fail-0200-continued-text-overflow", cont + cont)

# --- PDU framing ------------------------------------------------------------
P = "iscsi_pdu"
write(P, "huge-data-segment-length", bytes(bhs(0x03, 0x81, 0xFFFFFF)) + b"\0" * 64)
write(P, "max-ahs-length", bytes(bhs(0x01, 0x80, 16, ahs_words=255)) + b"\0" * 256)
text = kv((b"InitiatorName", b"iqn.fuzz:i"), (b"AuthMethod", b"CHAP"), (b"CHAP_R", b"0x" + b"ab" * 3000))
write(P, "login-pdu-oversized-chap-r", bytes(bhs(0x03, 0x81, len(text))) + text + b"\0" * (-len(text) % 4))
nop = bytes(bhs(0x00, 0x80, 5, immediate=True)) + b"ping!" + b"\0\0\0"
ok = kv((b"InitiatorName", b"iqn.fuzz:i"), (b"TargetName", b"iqn.fuzz:plain"))
write(P, "login-then-nop-with-padding", bytes(bhs(0x03, 0x87, len(ok))) + ok + b"\0" * (-len(ok) % 4) + nop)
write(P, "truncated-header", bytes(bhs(0x03, 0x81))[:20])
write(P, "data-segment-shorter-than-declared", bytes(bhs(0x05, 0x80, 4096)) + b"\x11" * 100)
write(P, "bad-digests", bytes(bhs(0x01, 0x80, 4)) + b"\xde\xad\xbe\xef" + b"abcd" + b"\0\0\0\0")

# --- CDBs -------------------------------------------------------------------
C = "iscsi_cdb"
write(C, "read16-max-lba-and-length", bytes([0x88, 0]) + b"\xff" * 8 + b"\xff" * 4 + b"\0\0")
write(C, "write16-max-length-fua", bytes([0x8A, 0x08]) + b"\0" * 7 + b"\x01" + b"\xff" * 4 + b"\0\0")
write(C, "write-same16-unmap-huge", bytes([0x93, 0x08]) + b"\xff" * 8 + b"\xff" * 4 + b"\0\0")
write(C, "compare-and-write-255-blocks", bytes([0x89, 0]) + b"\0" * 11 + b"\xff" + b"\0\0")
write(C, "report-opcodes-all-rctd", bytes([0xA3, 0x0C, 0x80, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0]))
write(C, "report-opcodes-one-bad-sa", bytes([0xA3, 0x0C, 0x03, 0x9E, 0xFF, 0xFF, 0, 0, 0x10, 0, 0, 0]))
write(C, "unmap-max-parameter-length", bytes([0x42, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0]))
write(C, "inquiry-unknown-vpd", bytes([0x12, 0x01, 0xEE, 0xFF, 0xFF, 0]))
write(C, "truncated-read10", bytes([0x28]))
write(C, "empty", b"")
write(C, "persistent-reserve-out-max", bytes([0x5F, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0]))
write(C, "get-lba-status-max", bytes([0x9E, 0x12]) + b"\xff" * 8 + b"\xff" * 4 + b"\0\0")

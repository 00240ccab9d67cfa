#!/usr/bin/env python3
"""Guest-side checks for tests/nfs_kernel.rs, run by the Linux guest's
python3-minimal against files on the NFS mount (standard library only).

  nfs_guest.py fsx FILE MODEL SEED OPS MAXLEN
      A data-integrity exerciser in the spirit of xfstests' fsx: OPS random
      operations on FILE (writes at random offsets and lengths, aligned or
      not, past EOF too; truncation up and down; reads; mmap reads and
      writes; fsync; close and reopen; dropping the file's cached pages so
      that reads come from the server), each checked against an in-memory
      model of the file. At the end the model is written to MODEL (a file
      outside the mount) for `verify`. A mismatch prints the seed, the
      failing operation, where the data differ and the operations that
      touched that place, and exits 1.
  nfs_guest.py verify FILE MODEL
      FILE must equal MODEL byte for byte (run it after a remount).
  nfs_guest.py posix DIR
      POSIX semantics a correct NFSv3 server must give the kernel client,
      in the empty directory DIR; must run as root (some checks run as
      uid/gid 1000 in a child process).
"""

import errno
import mmap
import os
import random
import stat
import sys
import time

PAGE = mmap.ALLOCATIONGRANULARITY


class Failure(Exception):
    pass


# ---------------------------------------------------------------- fsx


class Fsx:
    def __init__(self, path, seed, maxlen):
        self.path = path
        self.seed = seed
        self.rng = random.Random(seed)
        self.maxlen = maxlen
        self.maxio = min(maxlen, 64 * 1024)
        self.model = bytearray()
        self.log = []  # (op number, description, first byte, end) per op
        self.counts = {}
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    # -- helpers

    def fail(self, what, offset=None):
        lines = [
            f"fsx: FAILED at op {len(self.log)} (seed {self.seed}): {what}",
            f"fsx: reproduce with: nfs_guest.py fsx FILE MODEL {self.seed} "
            f"{len(self.log)} {self.maxlen}",
        ]
        if offset is not None:
            touched = [e for e in self.log if e[2] <= offset < e[3]]
            lines.append(f"fsx: the last operations that covered offset {offset}:")
            lines += [f"fsx:   op {n}: {d}" for n, d, _, _ in touched[-8:]]
        lines.append("fsx: the last 8 operations:")
        lines += [f"fsx:   op {n}: {d}" for n, d, _, _ in self.log[-8:]]
        raise Failure("\n".join(lines))

    def compare(self, got, offset, what):
        expected = bytes(self.model[offset : offset + len(got)])
        want = max(0, min(len(self.model) - offset, self.want_len))
        if len(got) != want:
            self.fail(f"{what}: read {len(got)} bytes, expected {want} (size {len(self.model)})")
        if got != expected:
            i = next(i for i in range(len(got)) if got[i] != expected[i])
            bad = sum(1 for a, b in zip(got, expected) if a != b)
            self.fail(
                f"{what}: {bad} bytes differ, the first at offset {offset + i}: "
                f"got {got[i:i + 16].hex()} expected {expected[i:i + 16].hex()}",
                offset + i,
            )

    def pick_range(self, within_size):
        """An offset and a length: unaligned mostly, page-aligned sometimes."""
        limit = len(self.model) if within_size else self.maxlen
        if limit <= 0:
            return 0, 0
        # Mostly short (the client sends them as they are, unaligned), one
        # in five up to maxio (several pages, a WRITE of many sectors).
        longest = self.maxio if self.rng.random() < 0.2 else 4096
        if self.rng.random() < 0.25 and limit >= 4096:
            off = self.rng.randrange(0, limit // 4096) * 4096
            n = self.rng.randint(1, max(1, longest // 4096)) * 4096
        else:
            off = self.rng.randrange(0, limit)
            n = self.rng.randint(1, longest)
        return off, max(1, min(n, limit - off))

    def note(self, desc, lo, hi):
        self.log.append((len(self.log) + 1, desc, lo, hi))
        name = desc.split()[0]
        self.counts[name] = self.counts.get(name, 0) + 1

    # -- operations

    def op_write(self):
        off, n = self.pick_range(False)
        data = self.rng.randbytes(n)
        self.note(f"write {off}..{off + n} (size {len(self.model)})", off, off + n)
        done = os.pwrite(self.fd, data, off)
        if done != n:
            self.fail(f"pwrite wrote {done} of {n} bytes")
        if off > len(self.model):
            self.model.extend(bytes(off - len(self.model)))
        self.model[off : off + n] = data

    def op_truncate(self):
        size = self.rng.randint(0, self.maxlen)
        old = len(self.model)
        self.note(f"truncate {old} -> {size}", min(old, size), max(old, size))
        os.ftruncate(self.fd, size)
        if size < old:
            del self.model[size:]
        else:
            self.model.extend(bytes(size - old))

    def op_read(self):
        # Reads past EOF too: they must come back short.
        off, n = self.pick_range(False)
        self.note(f"read {off}..{off + n} (size {len(self.model)})", off, off + n)
        self.want_len = n
        self.compare(os.pread(self.fd, n, off), off, "read")

    def mapped(self, off, n, writable):
        start = off - off % PAGE
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return start, mmap.mmap(self.fd, off + n - start, mmap.MAP_SHARED, prot, offset=start)

    def op_mapread(self):
        off, n = self.pick_range(True)
        if n == 0:
            return self.op_write()
        self.note(f"mapread {off}..{off + n} (size {len(self.model)})", off, off + n)
        start, m = self.mapped(off, n, False)
        try:
            got = m[off - start : off - start + n]
        finally:
            m.close()
        self.want_len = n
        self.compare(got, off, "mmap read")

    def op_mapwrite(self):
        off, n = self.pick_range(True)
        if n == 0:
            return self.op_write()
        data = self.rng.randbytes(n)
        sync = self.rng.random() < 0.5
        self.note(
            f"mapwrite {off}..{off + n} (size {len(self.model)}){' msync' if sync else ''}",
            off,
            off + n,
        )
        start, m = self.mapped(off, n, True)
        try:
            m[off - start : off - start + n] = data
            if sync:
                m.flush()
        finally:
            m.close()
        self.model[off : off + n] = data

    def op_fsync(self):
        self.note("fsync", 0, 0)
        os.fsync(self.fd)

    def op_reopen(self):
        self.note("reopen", 0, 0)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR)

    def op_invalidate(self):
        # Written back and committed, then this file's cached pages dropped:
        # the reads that follow come from the server.
        self.note("invalidate (fsync, drop cached pages)", 0, 0)
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def op_readall(self):
        self.note(f"readall (size {len(self.model)})", 0, len(self.model))
        self.want_len = len(self.model) + 1
        got = bytearray()
        while True:
            chunk = os.pread(self.fd, 1 << 20, len(got))
            if not chunk:
                break
            got += chunk
        self.compare(bytes(got), 0, "whole-file read")

    def run(self, ops):
        table = [
            (self.op_write, 30),
            (self.op_read, 25),
            (self.op_mapread, 8),
            (self.op_mapwrite, 8),
            (self.op_truncate, 8),
            (self.op_fsync, 4),
            (self.op_reopen, 4),
            (self.op_invalidate, 2),
            (self.op_readall, 1),
        ]
        funcs = [f for f, _ in table]
        weights = [w for _, w in table]
        reads = (self.op_read, self.op_mapread, self.op_readall)
        for _ in range(ops):
            op = self.rng.choices(funcs, weights)[0]
            op()
            # A read checks the size by where it ends; after the others ask
            # (a GETATTR, after the client wrote its dirty pages back).
            if op not in reads:
                size = os.fstat(self.fd).st_size
                if size != len(self.model):
                    self.fail(f"fstat says size {size}, the model {len(self.model)}")
        self.op_invalidate()
        self.op_readall()
        os.close(self.fd)


def cmd_fsx(path, model_path, seed, ops, maxlen):
    seed, ops, maxlen = int(seed), int(ops), int(maxlen)
    print(f"fsx: seed {seed}, {ops} operations, file up to {maxlen} bytes: {path}", flush=True)
    t0 = time.monotonic()
    fsx = Fsx(path, seed, maxlen)
    fsx.run(ops)
    with open(model_path, "wb") as f:
        f.write(fsx.model)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(fsx.counts.items()))
    print(f"fsx: {ops} operations ok in {time.monotonic() - t0:.1f} s, "
          f"final size {len(fsx.model)} ({counts})")


def cmd_verify(path, model_path):
    with open(model_path, "rb") as f:
        model = f.read()
    with open(path, "rb") as f:
        got = f.read()
    if len(got) != len(model):
        raise Failure(f"verify: {path} has {len(got)} bytes, the model {len(model)}")
    if got != model:
        i = next(i for i in range(len(got)) if got[i] != model[i])
        bad = sum(1 for a, b in zip(got, model) if a != b)
        raise Failure(
            f"verify: {path}: {bad} bytes differ, the first at offset {i}: "
            f"got {got[i:i + 16].hex()} expected {model[i:i + 16].hex()}"
        )
    print(f"fsx verify ok: {path}, {len(got)} bytes")


# ---------------------------------------------------------------- posix


def expect(cond, what):
    if not cond:
        raise Failure(what)


def expect_errno(fn, errnos, what):
    names = "/".join(errno.errorcode[e] for e in errnos)
    try:
        fn()
    except OSError as e:
        if e.errno in errnos:
            return
        raise Failure(f"{what}: failed with {errno.errorcode.get(e.errno, e.errno)}, expected {names}")
    raise Failure(f"{what}: succeeded, expected {names}")


def write_file(path, data, mode=0o644):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        expect(os.write(fd, data) == len(data), f"short write to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


def remove_tree(d):
    """Removes everything below d (not d itself)."""
    for top, dirs, files in os.walk(d, topdown=False):
        for n in files:
            os.unlink(os.path.join(top, n))
        for n in dirs:
            os.rmdir(os.path.join(top, n))


def drop_caches():
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def as_user(uid, checks):
    """Runs checks() as uid/gid `uid` with no supplementary groups in a
    child; a Failure there fails the parent with its message."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        status = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            checks()
        except BaseException as e:  # noqa: BLE001 - everything goes to the parent
            os.write(w, f"as uid {uid}: {e}".encode())
            status = 1
        os._exit(status)
    os.close(w)
    message = b""
    while chunk := os.read(r, 4096):
        message += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise Failure(message.decode() or f"the uid {uid} child ended with status {status}")


def check_exclusive_create(d):
    p = os.path.join(d, "excl")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    os.write(fd, b"first")
    os.close(fd)
    mode = stat.S_IMODE(os.stat(p).st_mode)
    expect(mode == 0o640, f"O_EXCL create: mode {mode:o}, expected 640")
    expect_errno(lambda: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640),
                 [errno.EEXIST], "a second O_EXCL create of the same name")
    os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o600))
    expect(read_file(p) == b"first", "O_CREAT without O_EXCL changed an existing file")
    expect(stat.S_IMODE(os.stat(p).st_mode) == 0o640, "O_CREAT changed an existing file's mode")


def check_unlink_open_file(d):
    sub = os.path.join(d, "silly")
    os.mkdir(sub)
    p = os.path.join(sub, "f")
    data = bytes(range(256)) * 64
    write_file(p, data)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.unlink(p)
        expect(not os.path.exists(p), "an unlinked open file's name still exists")
        # Its pages dropped: the data must come from the server (the client
        # renamed the file to .nfsXXXX instead of removing it).
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        drop_caches()
        expect(os.pread(fd, len(data) + 1, 0) == data,
               "an unlinked open file's data is not readable through its descriptor")
    finally:
        os.close(fd)
    # Closed: the client removes the silly-renamed file (asynchronously).
    deadline = time.monotonic() + 10
    while os.listdir(sub) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = os.listdir(sub)
    expect(not left, f"an unlinked file left {left} behind after its last close")
    os.rmdir(sub)


def check_rename_over_open_file(d):
    a, b = os.path.join(d, "ra"), os.path.join(d, "rb")
    write_file(a, b"A" * 5000)
    write_file(b, b"B" * 7000)
    ino_a = os.stat(a).st_ino
    fd = os.open(b, os.O_RDONLY)
    try:
        os.rename(a, b)
        expect(not os.path.exists(a), "rename left the source name")
        expect(os.stat(b).st_ino == ino_a, "rename: the target is not the source's file")
        expect(read_file(b) == b"A" * 5000, "rename: the target does not hold the source's data")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        expect(os.pread(fd, 8000, 0) == b"B" * 7000,
               "the file a rename replaced is not readable through a descriptor open on it")
    finally:
        os.close(fd)
    os.unlink(b)


def check_directories(d):
    full = os.path.join(d, "full")
    os.mkdir(full)
    write_file(os.path.join(full, "x"), b"x")
    expect_errno(lambda: os.rmdir(full), [errno.ENOTEMPTY], "rmdir of a non-empty directory")
    expect(os.path.exists(os.path.join(full, "x")), "a failed rmdir lost a file")

    other = os.path.join(d, "other")
    os.mkdir(other)
    write_file(os.path.join(other, "y"), b"y")
    # RFC 1813 allows NFS3ERR_EXIST or NFS3ERR_NOTEMPTY here.
    expect_errno(lambda: os.rename(other, full), [errno.ENOTEMPTY, errno.EEXIST],
                 "rename of a directory over a non-empty directory")
    expect(read_file(os.path.join(full, "x")) == b"x"
           and read_file(os.path.join(other, "y")) == b"y",
           "a failed rename of a directory changed either directory")

    empty = os.path.join(d, "empty")
    os.mkdir(empty)
    os.rename(other, empty)
    expect(not os.path.exists(other), "rename over an empty directory left the source")
    expect(read_file(os.path.join(empty, "y")) == b"y",
           "rename over an empty directory: the source's entries are not there")

    f = os.path.join(d, "plain")
    write_file(f, b"p")
    expect_errno(lambda: os.rename(f, full), [errno.EISDIR, errno.EEXIST],
                 "rename of a file over a directory")
    expect_errno(lambda: os.rename(empty, f), [errno.ENOTDIR, errno.EEXIST],
                 "rename of a directory over a file")
    expect_errno(lambda: os.rename(full, os.path.join(full, "inside")), [errno.EINVAL],
                 "rename of a directory into itself")
    expect_errno(lambda: os.mkdir(full), [errno.EEXIST], "mkdir of an existing name")

    # Many entries: READDIR(PLUS) over several replies, then everything
    # removed while the directory is being read.
    many = os.path.join(d, "many")
    os.mkdir(many)
    names = {f"entry-{i:04d}-{'x' * (i % 60)}" for i in range(250)}
    for n in names:
        os.close(os.open(os.path.join(many, n), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    drop_caches()
    listed = set(os.listdir(many))
    expect(listed == names, f"readdir of 250 entries: {len(listed ^ names)} names differ")
    removed = 0
    with os.scandir(many) as it:
        for entry in it:
            os.unlink(entry.path)
            removed += 1
    left = os.listdir(many)
    expect(removed == 250 and not left,
           f"unlinking while reading a directory: {removed} removed, {len(left)} left")
    os.rmdir(many)


def check_links(d):
    f, g, h = (os.path.join(d, n) for n in ("l1", "l2", "l3"))
    write_file(f, b"linked")
    os.link(f, g)
    os.link(f, h)
    st = os.stat(f)
    expect(st.st_nlink == 3, f"three links: st_nlink {st.st_nlink}")
    expect(os.stat(h).st_ino == st.st_ino, "a hard link has another inode number")
    os.unlink(g)
    drop_caches()
    expect(os.stat(h).st_nlink == 2, f"a link removed: st_nlink {os.stat(h).st_nlink}, expected 2")
    expect(read_file(h) == b"linked", "a hard link does not hold the file's data")
    expect_errno(lambda: os.link(f, h), [errno.EEXIST], "link onto an existing name")
    os.unlink(f)
    os.unlink(h)

    target = "/".join(["nowhere" * 7] * 20)  # 999 bytes
    s = os.path.join(d, "sym")
    os.symlink(target, s)
    expect(os.readlink(s) == target, "a 999-byte symlink target did not round-trip")
    expect(stat.S_ISLNK(os.lstat(s).st_mode), "lstat of a symlink is not a link")
    expect_errno(lambda: os.stat(s), [errno.ENOENT], "stat through a dangling symlink")
    os.unlink(s)


def check_times(d):
    parents = {n: os.path.join(d, f"t-{n}") for n in
               ("mkdir", "rmdir", "create", "unlink", "rename-from", "rename-to")}
    for p in parents.values():
        os.mkdir(p)
    os.mkdir(os.path.join(parents["rmdir"], "sub"))
    write_file(os.path.join(parents["unlink"], "f"), b"u")
    write_file(os.path.join(parents["rename-from"], "f"), b"r")
    data = os.path.join(d, "t-data")
    write_file(data, b"before")
    before = {n: os.stat(p) for n, p in parents.items()}
    data_before = os.stat(data)
    time.sleep(1.1)  # servers may keep whole seconds
    os.mkdir(os.path.join(parents["mkdir"], "sub"))
    os.rmdir(os.path.join(parents["rmdir"], "sub"))
    write_file(os.path.join(parents["create"], "f"), b"c")
    os.unlink(os.path.join(parents["unlink"], "f"))
    os.rename(os.path.join(parents["rename-from"], "f"), os.path.join(parents["rename-to"], "f"))
    with open(data, "r+b") as f:
        f.write(b"after!")
    drop_caches()
    for n, p in parents.items():
        st = os.stat(p)
        expect(st.st_mtime_ns > before[n].st_mtime_ns,
               f"{n} in a directory did not advance its mtime")
        expect(st.st_ctime_ns > before[n].st_ctime_ns,
               f"{n} in a directory did not advance its ctime")
    st = os.stat(data)
    expect(st.st_mtime_ns > data_before.st_mtime_ns, "a write did not advance the file's mtime")

    os.utime(data, (1_000_000_000, 1_234_567_890))
    drop_caches()
    st = os.stat(data)
    expect((int(st.st_atime), int(st.st_mtime)) == (1_000_000_000, 1_234_567_890),
           f"utime: atime/mtime {int(st.st_atime)}/{int(st.st_mtime)}, "
           "expected 1000000000/1234567890")
    for p in parents.values():
        remove_tree(p)
        os.rmdir(p)
    os.unlink(data)


def check_truncate(d):
    p = os.path.join(d, "trunc")
    write_file(p, b"abc")
    os.truncate(p, 10000)
    expect(os.stat(p).st_size == 10000, "truncate up: wrong size")
    drop_caches()
    expect(read_file(p) == b"abc" + bytes(9997), "truncate up did not extend with zeros")
    # Down then up again: what was beyond the short size must read as zeros,
    # from the server too (a partial block's tail must not come back).
    write_file(p, b"x" * 70000)
    os.truncate(p, 100)
    os.truncate(p, 70000)
    expect(read_file(p) == b"x" * 100 + bytes(69900), "truncate down then up: stale data")
    drop_caches()
    expect(read_file(p) == b"x" * 100 + bytes(69900),
           "truncate down then up: stale data read back from the server")
    # A write far past EOF leaves a hole of zeros.
    with open(p, "r+b") as f:
        f.seek(300000)
        f.write(b"end")
    drop_caches()
    expect(read_file(p) == b"x" * 100 + bytes(299900) + b"end", "a hole does not read as zeros")
    os.unlink(p)


def check_permissions(d):
    closed, public, private, sticky = (os.path.join(d, n) for n in
                                       ("closed", "public", "private", "sticky"))
    write_file(closed, b"secret")
    os.chmod(closed, 0o000)
    write_file(public, b"public", 0o644)
    os.mkdir(private, 0o755)
    os.mkdir(sticky)
    os.chmod(sticky, 0o1777)
    roots = os.path.join(sticky, "roots")
    write_file(roots, b"r", 0o666)
    drop_caches()

    def checks():
        expect_errno(lambda: os.open(closed, os.O_RDONLY), [errno.EACCES],
                     "open for reading of a mode 000 file")
        expect_errno(lambda: os.open(closed, os.O_WRONLY), [errno.EACCES],
                     "open for writing of a mode 000 file")
        expect(read_file(public) == b"public", "a mode 644 file is not readable by others")
        expect_errno(lambda: os.open(public, os.O_WRONLY), [errno.EACCES],
                     "open for writing of another user's mode 644 file")
        expect_errno(lambda: os.chmod(public, 0o666), [errno.EPERM],
                     "chmod of another user's file")
        expect_errno(lambda: os.chown(public, 1000, 1000), [errno.EPERM],
                     "chown by a user who is not root")
        expect_errno(lambda: write_file(os.path.join(private, "f"), b"f"), [errno.EACCES],
                     "create in another user's mode 755 directory")
        mine = os.path.join(sticky, "mine")
        write_file(mine, b"m")
        st = os.stat(mine)
        expect((st.st_uid, st.st_gid) == (1000, 1000),
               f"a file created by uid/gid 1000 is owned by {st.st_uid}/{st.st_gid}")
        expect_errno(lambda: os.unlink(roots), [errno.EPERM, errno.EACCES],
                     "unlink of another user's file in a sticky directory")
        os.unlink(mine)

    as_user(1000, checks)
    os.chmod(closed, 0o600)
    for p in (closed, public, roots):
        os.unlink(p)
    os.rmdir(private)
    os.rmdir(sticky)


def cmd_posix(d):
    os.umask(0)
    expect(not os.listdir(d), f"{d} is not empty")
    checks = [
        check_exclusive_create,
        check_unlink_open_file,
        check_rename_over_open_file,
        check_directories,
        check_links,
        check_times,
        check_truncate,
        check_permissions,
    ]
    for check in checks:
        t0 = time.monotonic()
        check(d)
        print(f"posix: {check.__name__[len('check_'):]} ok ({time.monotonic() - t0:.1f} s)",
              flush=True)
    remove_tree(d)
    expect(not os.listdir(d), f"{d} is not empty at the end")


def main(argv):
    commands = {"fsx": (cmd_fsx, 5), "verify": (cmd_verify, 2), "posix": (cmd_posix, 1)}
    if len(argv) < 2 or argv[1] not in commands or len(argv) - 2 != commands[argv[1]][1]:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        commands[argv[1]][0](*argv[2:])
    except Failure as e:
        print(f"FAILED: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

//! The Linux kernel's NFSv3 client against strata: a Debian kernel booted
//! under qemu (`../shared/tools/linux-guest`, with nfs-common, git and
//! python3-minimal added to its packages) mounts `default/files` and
//!
//! - copies a tree in (`/usr/bin`, `/usr/sbin`) and compares checksums;
//! - makes a git repository of some of perl's modules (144 files),
//!   commits, modifies, renames, deletes and adds files, commits again,
//!   and checks `git fsck --full`, a clean `git status` and both commits;
//! - checks rename/link/symlink/chmod/chown in shell, then the POSIX
//!   semantics of `tests/nfs_guest.py posix` (O_EXCL, unlinking and
//!   renaming over open files, ENOTEMPTY, rename of directories, link
//!   counts, a directory's times, truncation's zeros, permissions as a
//!   user who is not root, readdir of 250 entries while removing them);
//! - runs `tests/nfs_guest.py fsx`, an fsx-like exerciser (xfstests and
//!   pjdfstest are not Debian packages): 1,500 seeded random writes,
//!   truncations, reads, mmap reads and writes, fsyncs, reopens and cache
//!   drops on a file of up to 256 KiB, checked against a model of the
//!   file, then the whole file compared after dropping caches and after a
//!   remount;
//! - runs fio with verification;
//! - writes files with fsync while the daemon is killed with SIGKILL and
//!   restarted on the same port: after a remount every fsync'ed byte is
//!   there, the tree, the fsx file and the git repository too;
//! - reads the tree back from snapshot `s1` (taken by the host with
//!   `strata fs snapshot` once the tree was in, before the kill) under the
//!   hidden `.snapshot`, finds it read-only and unchanged after the live
//!   tree loses `usr/sbin`.
//!
//! The fsx seed is new each run and printed; `STRATA_FSX_SEED=N` replays
//! one, `STRATA_FSX_OPS=N` changes the number of operations.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the guest scripts are: `STRATA_LINUX_GUEST`, else the workplace's
/// tools beside the checkout.
fn guest_tools() -> PathBuf {
    let candidates = [
        std::env::var_os("STRATA_LINUX_GUEST").map(PathBuf::from),
        Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/tools/linux-guest")),
        Some(PathBuf::from("/work/shared/tools/linux-guest")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|dir| dir.join("run.sh").is_file())
        .expect("the linux-guest tools (run.sh, build.sh) were not found: set STRATA_LINUX_GUEST")
}

const GUEST_DIR: &str = "/tmp/strata-linux-guest-nfs";

/// Operations of the guest's fsx run (`tests/nfs_guest.py`).
const FSX_OPS: u32 = 1500;

/// A daemon killed when the test ends, however it ends.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `strata serve` with NFS on `nfs` ("127.0.0.1:0" or a fixed
/// port); returns it and the NFS address it printed.
fn start(data: &Path, nfs: &str) -> (Daemon, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--data-dir"])
        .arg(data)
        .args(["--nbd", "127.0.0.1:0", "--api", "127.0.0.1:0", "--iscsi", "127.0.0.1:0"])
        .args(["--nfs", nfs])
        .env("STRATA_RAM_DIR", data)
        .env("STRATA_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut address = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("strata: nfs listening on ") {
            address = rest.split_whitespace().next().map(str::to_string);
        }
        if line.starts_with("strata: iscsi listening on ") {
            break;
        }
    }
    // Keep draining stdout so the daemon never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (Daemon(child), address.expect("the daemon printed its NFS address"))
}

/// The guest's script. `@SEED@`, `@FSX_OPS@` and `@NFS_GUEST_PY@` (the
/// checks of `tests/nfs_guest.py`) are filled in by [`guest_script`].
const GUEST_SCRIPT: &str = r#"
set -e
M="mount -t nfs -o vers=3,proto=tcp,port=$TARGET_PORT,mountport=$TARGET_PORT,mountproto=tcp,nolock,timeo=50 $TARGET_HOST:/default/files /mnt/nfs"
fail() { echo "FAILED: $*"; exit 1; }
up() { cut -d' ' -f1 /proc/uptime; }
cat > /tmp/nfs_guest.py <<'NFS_GUEST_PY'
@NFS_GUEST_PY@
NFS_GUEST_PY
mkdir -p /mnt/nfs
$M
echo "mounted at $(up) s"
cd /mnt/nfs
mkdir tree
tar -C / -cf - usr/bin usr/sbin | tar -C tree -xf -
(cd /usr && find bin sbin -type f -exec md5sum {} + | sort) > /tmp/a
(cd tree/usr && find bin sbin -type f -exec md5sum {} + | sort) > /tmp/b
cmp /tmp/a /tmp/b
echo "tree ok: $(wc -l < /tmp/a) files at $(up) s"

# git: two commits (the second modifies, renames, deletes and adds), fsck.
git config --global user.name "strata test"
git config --global user.email test@strata.invalid
git config --global init.defaultBranch main
mkdir repo
cd /usr/share/perl/5.*.*/
tar -cf - Pod IO TAP Getopt Text File | tar -C /mnt/nfs/repo -xf -
cd /mnt/nfs/repo
git init -q
git add -A
git commit -q -m one
set -- $(git ls-files -s | awk '$1 == "100644" || $1 == "100755" { print $4 }' | sed -n '1p;2p;3p')
echo more >> "$1"
git mv "$2" renamed
git rm -q "$3"
echo new > new
git add -A
git commit -q -m two
git fsck --full --strict || fail "git fsck --full"
st=$(git status --porcelain) || fail "git status"
test -z "$st" || fail "git status after the commits: $st"
test "$(git rev-list --count HEAD)" = 2 || fail "git log: $(git log --oneline)"
printf 'A\tnew\nD\t%s\nM\t%s\nR100\t%s\trenamed\n' "$3" "$1" "$2" > /tmp/want
git diff --name-status -M HEAD~1 HEAD | sort > /tmp/got
cmp /tmp/want /tmp/got || fail "the second commit: $(cat /tmp/got)"
cd /mnt/nfs
echo "git ok: $(git -C repo ls-files | wc -l) files at $(up) s"

echo x > f; ln f g; test "$(stat -c %h f)" = 2
ln -s f s; test "$(readlink s)" = f
mv f h; test -e h; test ! -e f; test "$(cat g)" = x
chmod 640 h; test "$(stat -c %a h)" = 640
chown 1234:5678 h; test "$(stat -c %u:%g h)" = 1234:5678
mkdir -p d1/d2; mv d1 d3; test -d d3/d2; rmdir d3/d2 d3
if rmdir tree 2>/dev/null; then echo "rmdir of a full directory succeeded"; exit 1; fi
rm g h s
echo "semantics ok at $(up) s"
mkdir posix
python3 /tmp/nfs_guest.py posix /mnt/nfs/posix
rmdir posix
echo "posix ok at $(up) s"

python3 /tmp/nfs_guest.py fsx /mnt/nfs/fsx /tmp/fsx.model @SEED@ @FSX_OPS@ 262144
echo 3 > /proc/sys/vm/drop_caches
python3 /tmp/nfs_guest.py verify /mnt/nfs/fsx /tmp/fsx.model
cd /
umount /mnt/nfs
$M
python3 /tmp/nfs_guest.py verify /mnt/nfs/fsx /tmp/fsx.model
cd /mnt/nfs
echo "fsx ok at $(up) s"

fio --name=v --directory=/mnt/nfs --size=16M --rw=randwrite --bs=4k --verify=crc32c --ioengine=psync --fsync=64 --output-format=terse > /dev/null
echo "fio verify ok at $(up) s"
dd if=/dev/urandom of=/tmp/x bs=1M count=4 2>/dev/null
dd if=/dev/urandom of=/tmp/y bs=1M count=4 2>/dev/null
cp /tmp/x x; sync x
echo "synced x"
dd if=/tmp/y of=y bs=64k conv=fsync 2>/dev/null
echo "synced y"
cd /
umount /mnt/nfs
$M
cmp /tmp/x /mnt/nfs/x
cmp /tmp/y /mnt/nfs/y
(cd /mnt/nfs/tree/usr && find bin sbin -type f -exec md5sum {} + | sort) > /tmp/c
cmp /tmp/a /tmp/c
python3 /tmp/nfs_guest.py verify /mnt/nfs/fsx /tmp/fsx.model
git -C /mnt/nfs/repo fsck --full --strict || fail "git fsck --full after the restart"
st=$(git -C /mnt/nfs/repo status --porcelain) || fail "git status after the restart"
test -z "$st" || fail "git status after the restart: $st"
echo "after kill ok at $(up) s"

# The host took snapshot s1 once the tree was in (before the kill): its
# tree reads back whole, read-only, and stays so when the live one goes.
(cd /mnt/nfs/.snapshot/s1/tree/usr && find bin sbin -type f -exec md5sum {} + | sort) > /tmp/s || fail "reading snapshot s1"
cmp /tmp/a /tmp/s || fail "snapshot s1's tree differs"
if touch /mnt/nfs/.snapshot/s1/new 2>/dev/null; then fail "a file was made in a snapshot"; fi
if ls /mnt/nfs | grep -q snapshot; then fail ".snapshot is listed"; fi
rm -rf /mnt/nfs/tree/usr/sbin
test ! -e /mnt/nfs/tree/usr/sbin
(cd /mnt/nfs/.snapshot/s1/tree/usr && find bin sbin -type f -exec md5sum {} + | sort) > /tmp/s
cmp /tmp/a /tmp/s || fail "snapshot s1 changed with the live tree"
umount /mnt/nfs
echo "snapshot ok at $(up) s"
"#;

/// Waits until the guest's output (`output`) has `line`; fails the test
/// if the guest ends first or `deadline` passes.
fn wait_for_guest(output: &Path, guest: &mut Child, deadline: Instant, line: &str) {
    loop {
        let log = std::fs::read_to_string(output).unwrap_or_default();
        if log.contains(line) {
            return;
        }
        if let Ok(Some(status)) = guest.try_wait() {
            panic!("the guest ended ({status}) before {line:?}:\n{log}");
        }
        assert!(Instant::now() < deadline, "no {line:?} from the guest in time:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The guest script with the fsx seed, its number of operations and the
/// Python checks filled in.
fn guest_script(seed: u64, fsx_ops: u32) -> String {
    let python = include_str!("nfs_guest.py");
    assert!(
        !python.contains("\nNFS_GUEST_PY\n"),
        "the here-document's delimiter is in the script"
    );
    GUEST_SCRIPT
        .replace("@SEED@", &seed.to_string())
        .replace("@FSX_OPS@", &fsx_ops.to_string())
        .replace("@NFS_GUEST_PY@", python.trim_end())
}

#[test]
fn the_kernel_client_mounts_writes_and_keeps_what_it_synced_across_a_kill() {
    let tools = guest_tools();
    // Seconds once built; about a minute and a half the first time.
    let built = Command::new(tools.join("build.sh"))
        .env("GUEST_DIR", GUEST_DIR)
        .env("EXTRA_PKGS", "nfs-common,netbase,git,python3-minimal")
        .env("EXTRA_MODS", "nfs nfsv3 sunrpc lockd")
        .status()
        .unwrap();
    assert!(built.success(), "building the guest failed");

    let dir = tempfile::tempdir().unwrap();
    common::small_default_pool(dir.path());
    let (daemon, address) = start(dir.path(), "127.0.0.1:0");
    let port = address.rsplit(':').next().unwrap().to_string();
    // Root in the guest stays root (chown, and a tree of root's files).
    let set = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["fs", "set", "default/files", "nfs.squash=none", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(set.status.success(), "{set:?}");

    // A new seed each run (printed, and in any failure's output); set
    // STRATA_FSX_SEED to replay one, STRATA_FSX_OPS for a longer run.
    let seed = match std::env::var("STRATA_FSX_SEED") {
        Ok(seed) => seed.parse().expect("STRATA_FSX_SEED is a number"),
        Err(_) => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                % 1_000_000_000
        }
    };
    let fsx_ops =
        std::env::var("STRATA_FSX_OPS").map_or(FSX_OPS, |ops| ops.parse().expect("STRATA_FSX_OPS is a number"));
    println!("nfs_kernel: fsx seed {seed}, {fsx_ops} operations (STRATA_FSX_SEED={seed} replays it)");
    let script = dir.path().join("guest.sh");
    std::fs::write(&script, guest_script(seed, fsx_ops)).unwrap();
    let run_dir = dir.path().join("run");
    let mut guest = Command::new(tools.join("run.sh"))
        .arg(&script)
        .arg(&port)
        .env("GUEST_DIR", GUEST_DIR)
        .env("RUN_DIR", &run_dir)
        .env("TIMEOUT", "900")
        .spawn()
        .unwrap();

    // A snapshot of the dataset once the tree is in (the guest reads it
    // back at the end, after the kill).
    let output = run_dir.join("output.log");
    let deadline = Instant::now() + Duration::from_secs(900);
    wait_for_guest(&output, &mut guest, deadline, "tree ok");
    let snapshot = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["fs", "snapshot", "default/files@s1", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(snapshot.status.success(), "fs snapshot: {snapshot:?}");

    // Kill the daemon once the guest has fsync'ed x, while it writes y.
    wait_for_guest(&output, &mut guest, deadline, "synced x");
    drop(daemon);
    let (daemon, again) = start(dir.path(), &address);
    assert_eq!(again, address);

    let status = guest.wait().unwrap();
    let log = std::fs::read_to_string(&output).unwrap_or_default();
    drop(daemon);
    assert!(status.success(), "the guest script failed ({status}):\n{log}");
    for line in [
        "mounted",
        "tree ok",
        "git ok",
        "semantics ok",
        "posix ok",
        "fsx ok",
        "fio verify ok",
        "synced y",
        "after kill ok",
        "snapshot ok",
    ] {
        assert!(log.contains(line), "missing {line:?} in the guest's output:\n{log}");
    }
}

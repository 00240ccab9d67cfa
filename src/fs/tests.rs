//! The file service on simulated devices: namespace changes and file data
//! as a client sees them, after a clean reopen and after a power loss.

use super::*;
use crate::device::sim::{SimDelays, SimDevice};
use crate::pool::superblock::Role;
use crate::pool::NewDevice;

fn block_on<F: std::future::Future>(test: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(test)
}

const DATASET: u32 = 9;

async fn new_pool(sim: &SimDevice) -> Arc<Pool> {
    let devices = vec![NewDevice {
        device: sim.as_device(),
        role: Role::Fast,
    }];
    Pool::create("test", 1 << 20, devices).await.unwrap()
}

/// Drops the pool and the file system, loses power, opens both again.
async fn power_loss(sim: &SimDevice, open: (Arc<Pool>, Arc<FileSystem>)) -> (Arc<Pool>, Arc<FileSystem>) {
    drop(open);
    sim.crash();
    let pool = Pool::open(vec![sim.as_device()]).await.unwrap();
    let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
    (pool, fs)
}

fn user() -> Cred {
    Cred {
        uid: 1000,
        gid: 1000,
        gids: vec![],
    }
}

fn attrs(mode: u32) -> SetAttrs {
    SetAttrs {
        mode: Some(mode),
        ..SetAttrs::default()
    }
}

fn names(fs: &FileSystem, dir: &Handle) -> Vec<String> {
    let (entries, eof) = fs.readdir(dir, &Cred::root(), 0, 1000).unwrap();
    assert!(eof);
    entries
        .iter()
        .map(|e| String::from_utf8(e.name.clone()).unwrap())
        .collect()
}

/// Builds a small tree: /a (file, 10,000 bytes), /d (directory), /d/b
/// (a hard link to /a), /l (symbolic link), /gone (removed).
async fn build(fs: &FileSystem) -> (Handle, Handle) {
    let root = fs.root();
    let (a, _, _) = fs
        .create(&root, b"a", &Cred::root(), CreateHow::Guarded(attrs(0o666)))
        .await
        .unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let (n, _, attr) = fs.write(&a, &Cred::root(), 0, &data, Stable::FileSync).await.unwrap();
    assert_eq!((n, attr.after.size), (10_000, 10_000));
    let (d, _, _) = fs.mkdir(&root, b"d", &Cred::root(), attrs(0o777)).await.unwrap();
    fs.link(&a, &d, b"b", &Cred::root()).await.unwrap();
    fs.symlink(&root, b"l", &Cred::root(), b"d/b", SetAttrs::default())
        .await
        .unwrap();
    let (gone, _, _) = fs
        .create(&root, b"gone", &Cred::root(), CreateHow::Guarded(attrs(0o644)))
        .await
        .unwrap();
    fs.write(&gone, &Cred::root(), 0, &[7u8; 4096], Stable::FileSync)
        .await
        .unwrap();
    fs.remove(&root, b"gone", &Cred::root()).await.unwrap();
    assert_eq!(fs.getattr(&gone), Err(FsError::Stale));
    (a, d)
}

/// A file `u` in the root with 6,000 bytes written UNSTABLE: not
/// committed, which a snapshot taken next must still hold.
async fn unstable_u(fs: &FileSystem) -> Handle {
    let cred = Cred::root();
    let (u, _, _) = fs
        .create(&fs.root(), b"u", &cred, CreateHow::Guarded(attrs(0o644)))
        .await
        .unwrap();
    fs.write(&u, &cred, 0, &[5u8; 6_000], Stable::Unstable).await.unwrap();
    u
}

/// Changes [`build`]'s tree after a snapshot: `a` rewritten and removed,
/// `d/b` removed, `l` renamed to `l2`.
async fn change_tree(fs: &FileSystem, a: &Handle, d: &Handle) {
    let (cred, root) = (Cred::root(), fs.root());
    fs.write(a, &cred, 0, &[0xee; 4096], Stable::FileSync).await.unwrap();
    fs.remove(d, b"b", &cred).await.unwrap();
    fs.remove(&root, b"a", &cred).await.unwrap();
    fs.rename(&root, b"l", &root, b"l2", &cred).await.unwrap();
}

/// [`change_tree`], then `u` rewritten (20,000 bytes UNSTABLE) and a file
/// `later` made (50,000 bytes FILE_SYNC), returned.
async fn change_after_s1(fs: &FileSystem, a: &Handle, d: &Handle, u: &Handle) -> Handle {
    let cred = Cred::root();
    change_tree(fs, a, d).await;
    fs.write(u, &cred, 0, &[9u8; 20_000], Stable::Unstable).await.unwrap();
    let (later, _, _) = fs
        .create(&fs.root(), b"later", &cred, CreateHow::Guarded(attrs(0o644)))
        .await
        .unwrap();
    fs.write(&later, &cred, 0, &[1u8; 50_000], Stable::FileSync)
        .await
        .unwrap();
    later
}

async fn check(fs: &FileSystem, a: &Handle, d: &Handle) {
    let root = fs.root();
    assert_eq!(names(fs, &root), [".", "..", "a", "d", "l"]);
    assert_eq!(names(fs, d), [".", "..", "b"]);
    let (b, attr) = fs.lookup(d, b"b", &Cred::root()).unwrap();
    assert_eq!(b, *a);
    assert_eq!((attr.nlink, attr.size, attr.mode), (2, 10_000, 0o666));
    let (data, eof) = fs.read(a, &Cred::root(), 9_990, 100).await.unwrap();
    assert!(eof);
    assert_eq!(data, (9_990..10_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    let (l, _) = fs.lookup(&root, b"l", &Cred::root()).unwrap();
    assert_eq!(fs.readlink(&l).unwrap(), b"d/b");
    assert_eq!(fs.getattr(&root).unwrap().nlink, 3);
}

#[test]
fn a_tree_survives_a_reopen_and_a_power_loss() {
    block_on(async {
        let sim = SimDevice::new(160 << 20, 3);
        let pool = new_pool(&sim).await;
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let (a, d) = build(&fs).await;
        check(&fs, &a, &d).await;

        // Power loss with nothing checkpointed: the log replays it all.
        let (pool, fs) = power_loss(&sim, (pool, fs)).await;
        check(&fs, &a, &d).await;

        // From a checkpoint (the metadata store's rows), then more changes
        // replayed on top of it.
        pool.checkpoint().await.unwrap();
        // Onto another link of the same file: nothing happens (POSIX).
        fs.rename(&fs.root(), b"a", &d, b"b", &Cred::root()).await.unwrap();
        assert_eq!(names(&fs, &fs.root()), [".", "..", "a", "d", "l"]);
        fs.rename(&fs.root(), b"a", &d, b"c", &Cred::root()).await.unwrap();
        let (_pool, fs) = power_loss(&sim, (pool, fs)).await;
        assert_eq!(names(&fs, &fs.root()), [".", "..", "d", "l"]);
        assert_eq!(names(&fs, &d), [".", "..", "b", "c"]);
        let (c, attr) = fs.lookup(&d, b"c", &Cred::root()).unwrap();
        assert_eq!((c, attr.nlink), (a, 2));
        // Replacing a file frees it once its last link goes.
        fs.rename(&d, b"c", &fs.root(), b"l", &Cred::root()).await.unwrap();
        fs.remove(&d, b"b", &Cred::root()).await.unwrap();
        let (l, attr) = fs.lookup(&fs.root(), b"l", &Cred::root()).unwrap();
        assert_eq!((l, attr.nlink, attr.kind), (a, 1, FileType::Regular));
    });
}

#[test]
fn permissions_names_and_directories_are_checked() {
    block_on(async {
        let sim = SimDevice::new(160 << 20, 4);
        let pool = new_pool(&sim).await;
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let root = fs.root();
        // A new dataset's root is 1777 (like /tmp); a 0755 directory of
        // root's is closed to a user.
        let how = CreateHow::Guarded(attrs(0o644));
        assert_eq!(fs.getattr(&root).unwrap().mode, 0o1777);
        let (locked, _, _) = fs.mkdir(&root, b"locked", &Cred::root(), attrs(0o755)).await.unwrap();
        assert_eq!(
            fs.create(&locked, b"x", &user(), how).await.err(),
            Some(FsError::Access)
        );
        let (home, _, _) = fs.mkdir(&root, b"home", &Cred::root(), attrs(0o755)).await.unwrap();
        fs.setattr(
            &home,
            &Cred::root(),
            SetAttrs {
                uid: Some(1000),
                gid: Some(1000),
                ..SetAttrs::default()
            },
            None,
        )
        .await
        .unwrap();
        let (f, attr, _) = fs.create(&home, b"f", &user(), how).await.unwrap();
        assert_eq!((attr.uid, attr.gid, attr.mode), (1000, 1000, 0o644));
        assert_eq!(fs.create(&home, b"f", &user(), how).await.err(), Some(FsError::Exist));
        for bad in [&b""[..], b".", b"..", b"a/b"] {
            assert_eq!(fs.create(&home, bad, &user(), how).await.err(), Some(FsError::Inval));
        }
        assert_eq!(
            fs.create(&home, &[b'n'; 256], &user(), how).await.err(),
            Some(FsError::NameTooLong)
        );
        let other = Cred {
            uid: 2000,
            gid: 2000,
            gids: vec![],
        };
        assert_eq!(
            fs.write(&f, &other, 0, b"no", Stable::Unstable).await.err(),
            Some(FsError::Access)
        );
        assert_eq!(fs.access(&f, &other, 0x3f).unwrap(), access::READ);
        assert_eq!(fs.remove(&home, b"f", &other).await.err(), Some(FsError::Access));
        // A directory: not removed by REMOVE, nor while it has entries.
        let (sub, _, _) = fs.mkdir(&home, b"sub", &user(), attrs(0o755)).await.unwrap();
        assert_eq!(fs.remove(&home, b"sub", &user()).await.err(), Some(FsError::IsDir));
        fs.create(&sub, b"inner", &user(), how).await.unwrap();
        assert_eq!(fs.rmdir(&home, b"sub", &user()).await.err(), Some(FsError::NotEmpty));
        // Not moved into itself.
        assert_eq!(
            fs.rename(&home, b"sub", &sub, b"loop", &user()).await.err(),
            Some(FsError::Inval)
        );
        fs.remove(&sub, b"inner", &user()).await.unwrap();
        fs.rmdir(&home, b"sub", &user()).await.unwrap();
        assert_eq!(fs.getattr(&sub), Err(FsError::Stale));
        assert_eq!(fs.getattr(&home).unwrap().nlink, 2);
        // Unaligned writes and a truncation read back as written.
        fs.write(&f, &user(), 3, b"hello", Stable::Unstable).await.unwrap();
        fs.write(&f, &user(), 1000, b"world", Stable::Unstable).await.unwrap();
        fs.commit(&f).await.unwrap();
        let (data, _) = fs.read(&f, &user(), 0, 2000).await.unwrap();
        assert_eq!(data.len(), 1005);
        assert_eq!(&data[..8], b"\0\0\0hello");
        assert_eq!(&data[1000..], b"world");
        let shrink = SetAttrs {
            size: Some(5),
            ..SetAttrs::default()
        };
        fs.setattr(&f, &user(), shrink, None).await.unwrap();
        let grow = SetAttrs {
            size: Some(2000),
            ..SetAttrs::default()
        };
        fs.setattr(&f, &user(), grow, None).await.unwrap();
        // SETATTR's guard: the ctime the client saw, else nothing changes.
        let ctime = fs.getattr(&f).unwrap().ctime;
        let stale = Time {
            seconds: ctime.seconds - 1,
            ..ctime
        };
        assert_eq!(
            fs.setattr(&f, &user(), attrs(0o600), Some(stale)).await.err(),
            Some(FsError::NotSync)
        );
        assert_eq!(fs.getattr(&f).unwrap().mode, 0o644);
        fs.setattr(&f, &user(), attrs(0o600), Some(ctime)).await.unwrap();
        assert_eq!(fs.getattr(&f).unwrap().mode, 0o600);
        let (data, eof) = fs.read(&f, &user(), 0, 4000).await.unwrap();
        assert!(eof);
        assert_eq!(&data[..5], b"\0\0\0he");
        assert!(data[5..].iter().all(|b| *b == 0), "truncated bytes read back as zeros");
    });
}

#[test]
fn readdir_resumes_after_a_cookie_whose_entry_was_removed() {
    block_on(async {
        let sim = SimDevice::new(160 << 20, 5);
        let pool = new_pool(&sim).await;
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let root = fs.root();
        for i in 0..50 {
            let name = format!("f{i:02}");
            fs.create(
                &root,
                name.as_bytes(),
                &Cred::root(),
                CreateHow::Unchecked(attrs(0o644)),
            )
            .await
            .unwrap();
        }
        let (first, eof) = fs.readdir(&root, &Cred::root(), 0, 12).unwrap();
        assert!(!eof);
        assert_eq!(first.len(), 12);
        let last = first.last().unwrap();
        fs.remove(&root, &last.name, &Cred::root()).await.unwrap();
        let (rest, eof) = fs.readdir(&root, &Cred::root(), last.cookie, 1000).unwrap();
        assert!(eof);
        assert_eq!(first.len() + rest.len(), 52, "nothing listed twice or skipped");
        assert_eq!(rest[0].name, b"f10");
    });
}

/// What snapshot `s1` of [`a_snapshot_keeps_the_tree_as_it_was`] must hold,
/// through the dataset's `.snapshot` directory as a client finds it.
async fn check_snapshot(fs: &FileSystem, a: &Handle) -> Arc<FileSystem> {
    let root = fs.root();
    let cred = Cred::root();
    assert!(
        !names(fs, &root).contains(&".snapshot".to_string()),
        "hidden from listings"
    );
    let (dir, dir_attr) = fs.lookup(&root, SNAPSHOT_DIR, &cred).unwrap();
    assert_eq!(
        (dir_attr.kind, dir_attr.mode, dir_attr.fileid),
        (FileType::Directory, 0o555, SNAPSHOT_DIR_INO)
    );
    assert_eq!(fs.getattr(&dir).unwrap(), dir_attr);
    assert_eq!(names(fs, &dir), [".", "..", "s1"]);
    assert_eq!(fs.lookup(&dir, b"..", &cred).unwrap().0, root);
    assert_eq!(fs.lookup(&dir, b"nope", &cred), Err(FsError::NoEnt));
    assert_eq!(
        fs.mkdir(&dir, b"x", &cred, SetAttrs::default()).await,
        Err(FsError::ReadOnly)
    );
    let (snap_root, attr) = fs.lookup(&dir, b"s1", &cred).unwrap();
    assert_ne!(snap_root.dataset, fs.dataset());
    assert_eq!(
        attr.fsid,
        fs.getattr(&root).unwrap().fsid,
        "one file system for clients"
    );
    assert_ne!(attr.fileid, fs.getattr(&root).unwrap().fileid, "file ids never collide");
    let snap = fs.snapshot_fs(snap_root.dataset).expect("the snapshot opens");
    assert_eq!(snap.root(), snap_root);
    assert_eq!(names(&snap, &snap_root), [".", "..", "a", "d", "l", "u"]);
    assert_eq!(
        snap.lookup(&snap_root, b"..", &cred).unwrap().0,
        dir,
        "up into .snapshot"
    );
    let (sa, attr) = snap.lookup(&snap_root, b"a", &cred).unwrap();
    assert_eq!((sa.ino, attr.size, attr.nlink), (a.ino, 10_000, 2));
    let (data, eof) = snap.read(&sa, &cred, 0, 20_000).await.unwrap();
    assert!(eof);
    assert_eq!(data, (0..10_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    let (su, attr) = snap.lookup(&snap_root, b"u", &cred).unwrap();
    assert_eq!(attr.size, 6_000, "an UNSTABLE write acknowledged before is in it");
    assert_eq!(snap.read(&su, &cred, 0, 8_000).await.unwrap().0, vec![5u8; 6_000]);
    let (sd, _) = snap.lookup(&snap_root, b"d", &cred).unwrap();
    assert_eq!(snap.lookup(&sd, b"b", &cred).unwrap().0, sa);
    // Nothing in it changes.
    assert_eq!(
        snap.write(&sa, &cred, 0, &[1; 512], Stable::FileSync).await,
        Err(FsError::ReadOnly)
    );
    assert_eq!(snap.remove(&snap_root, b"a", &cred).await, Err(FsError::ReadOnly));
    assert_eq!(
        snap.setattr(&sa, &cred, attrs(0o600), None).await,
        Err(FsError::ReadOnly)
    );
    // A live handle is not the snapshot's, nor the other way round.
    assert_eq!(snap.getattr(a), Err(FsError::Stale));
    assert_eq!(fs.getattr(&sa), Err(FsError::Stale));
    snap
}

/// The live dataset after [`a_snapshot_keeps_the_tree_as_it_was`]'s changes.
async fn check_live(fs: &FileSystem) {
    let root = fs.root();
    let cred = Cred::root();
    assert_eq!(names(fs, &root), [".", "..", "d", "u", "l2", "new"]);
    let (u, attr) = fs.lookup(&root, b"u", &cred).unwrap();
    assert_eq!(attr.size, 10);
    assert_eq!(fs.read(&u, &cred, 0, 100).await.unwrap().0, vec![5u8; 10]);
    let (d, _) = fs.lookup(&root, b"d", &cred).unwrap();
    assert_eq!(names(fs, &d), [".", ".."]);
}

#[test]
fn a_snapshot_keeps_the_tree_as_it_was() {
    block_on(async {
        let sim = SimDevice::new(160 << 20, 5);
        let pool = new_pool(&sim).await;
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let cred = Cred::root();
        let root = fs.root();
        let (a, d) = build(&fs).await;
        let u = unstable_u(&fs).await;
        assert_eq!(
            fs.create(&root, SNAPSHOT_DIR, &cred, CreateHow::Guarded(attrs(0o644)))
                .await,
            Err(FsError::Exist),
            "the name is taken"
        );
        fs.snapshot("s1").await.unwrap();
        assert!(fs.snapshot("s1").await.is_err(), "names are unique");
        assert_eq!(fs.snapshot_list().len(), 1);

        // Everything changes after it.
        change_tree(&fs, &a, &d).await;
        let truncate = SetAttrs {
            size: Some(10),
            ..SetAttrs::default()
        };
        fs.setattr(&u, &cred, truncate, None).await.unwrap();
        fs.mkdir(&root, b"new", &cred, attrs(0o755)).await.unwrap();
        check_live(&fs).await;
        check_snapshot(&fs, &a).await;

        // Power loss: the log replays the snapshot at its place among the
        // namespace's changes.
        let (pool, fs) = power_loss(&sim, (pool, fs)).await;
        check_live(&fs).await;
        check_snapshot(&fs, &a).await;

        // From the metadata store's rows.
        pool.checkpoint().await.unwrap();
        let (pool, fs) = power_loss(&sim, (pool, fs)).await;
        check_live(&fs).await;
        let snap = check_snapshot(&fs, &a).await;
        let snap_root = snap.root();

        // Destroyed: its handles are stale, its rows go.
        fs.destroy_snapshot("s1").await.unwrap();
        assert_eq!(
            snap.read(&snap_root, &cred, 0, 1).await,
            Err(FsError::Stale),
            "calls after the destroy are refused"
        );
        assert!(fs.snapshot_fs(snap_root.dataset).is_none());
        let (dir, _) = fs.lookup(&root, SNAPSHOT_DIR, &cred).unwrap();
        assert_eq!(names(&fs, &dir), [".", ".."]);
        assert_eq!(fs.destroy_snapshot("s1").await, Err(FsError::NoEnt));
        pool.checkpoint().await.unwrap();
        drop((snap, fs));
        drop(pool);
        sim.crash();
        let pool = Pool::open(vec![sim.as_device()]).await.unwrap();
        assert!(pool.existing_namespace(snap_root.dataset).is_none());
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        check_live(&fs).await;
        assert!(fs.snapshot_fs(snap_root.dataset).is_none());
    });
}

/// A SETATTR that changes no size (chmod) logs the file's row; an UNSTABLE
/// WRITE that extends the file while that record commits must still have
/// its new size logged by the COMMIT that follows, or a power loss after
/// the COMMIT loses bytes the client was told are durable.
#[test]
fn a_write_during_a_chmod_keeps_its_size_for_the_commit() {
    block_on(async {
        let sim = SimDevice::new(160 << 20, 7);
        let pool = new_pool(&sim).await;
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let (f, _, _) = fs
            .create(&fs.root(), b"f", &Cred::root(), CreateHow::Guarded(attrs(0o644)))
            .await
            .unwrap();
        // Poll the chmod until its change is applied and it waits for the
        // record's commit (every device operation yields once); the write
        // runs then, the chmod answers after.
        let root = Cred::root();
        sim.set_delays(SimDelays::always(1));
        {
            let mut chmod = std::pin::pin!(fs.setattr(&f, &root, attrs(0o600), None));
            loop {
                let answered = std::future::poll_fn(|cx| match std::future::Future::poll(chmod.as_mut(), cx) {
                    std::task::Poll::Ready(result) => std::task::Poll::Ready(Some(result)),
                    std::task::Poll::Pending => std::task::Poll::Ready(None),
                })
                .await;
                assert!(answered.is_none(), "the chmod waited for its commit");
                if fs.getattr(&f).unwrap().mode & 0o777 == 0o600 {
                    break;
                }
                tokio::task::yield_now().await;
            }
            let (_, _, attr) = fs.write(&f, &root, 0, &[5u8; 8192], Stable::Unstable).await.unwrap();
            assert_eq!(attr.after.size, 8192);
            chmod.await.unwrap();
        }
        sim.set_delays(SimDelays::default());
        fs.commit(&f).await.unwrap();

        let (_pool, fs) = power_loss(&sim, (pool, fs)).await;
        let attr = fs.getattr(&f).unwrap();
        assert_eq!(
            (attr.size, attr.mode & 0o777),
            (8192, 0o600),
            "the committed size and the mode survive"
        );
        let (data, _) = fs.read(&f, &Cred::root(), 0, 8192).await.unwrap();
        assert_eq!(data, [5u8; 8192]);
    });
}

const CLONE: u32 = 77;

/// The tree [`build`] made, with /u of 6,000 bytes: what snapshot `s1`
/// of [`a_rollback_and_a_clone_bring_a_snapshot_back`] holds.
async fn check_as_at_s1(fs: &FileSystem, a: &Handle) {
    let root = fs.root();
    let cred = Cred::root();
    assert_eq!(names(fs, &root), [".", "..", "a", "d", "l", "u"]);
    let (found, attr) = fs.lookup(&root, b"a", &cred).unwrap();
    assert_eq!((found.ino, attr.size, attr.nlink), (a.ino, 10_000, 2));
    let (data, _) = fs.read(&found, &cred, 0, 20_000).await.unwrap();
    assert_eq!(data, (0..10_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    let (d, _) = fs.lookup(&root, b"d", &cred).unwrap();
    assert_eq!(fs.lookup(&d, b"b", &cred).unwrap().0, found);
    let (u, attr) = fs.lookup(&root, b"u", &cred).unwrap();
    assert_eq!(attr.size, 6_000);
    assert_eq!(fs.read(&u, &cred, 0, 8_000).await.unwrap().0, vec![5u8; 6_000]);
}

/// A clone of a snapshot: /a rewritten, /c added after it was made.
async fn check_clone(clone: &FileSystem) {
    let root = clone.root();
    let cred = Cred::root();
    assert_eq!(names(clone, &root), [".", "..", "a", "d", "l", "u", "c"]);
    let (a, attr) = clone.lookup(&root, b"a", &cred).unwrap();
    assert_eq!(attr.size, 10_000);
    let (data, _) = clone.read(&a, &cred, 0, 4096).await.unwrap();
    assert_eq!(data, vec![0x77; 4096], "the clone's own write");
    let (c, _) = clone.lookup(&root, b"c", &cred).unwrap();
    assert_eq!(clone.read(&c, &cred, 0, 100).await.unwrap().0, vec![3u8; 100]);
}

#[test]
fn a_rollback_and_a_clone_bring_a_snapshot_back() {
    block_on(async {
        let sim = SimDevice::new(160 << 20, 11);
        let pool = new_pool(&sim).await;
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let cred = Cred::root();
        let root = fs.root();
        let (a, d) = build(&fs).await;
        let u = unstable_u(&fs).await;
        let s1 = fs.snapshot("s1").await.unwrap();

        // Changes after it, a file made since among them.
        let later = change_after_s1(&fs, &a, &d, &u).await;

        // A clone starts as the snapshot and changes on its own.
        pool.create_clone(CLONE, s1.id).await.unwrap();
        let clone = FileSystem::open(&pool, CLONE, 16 << 10, 0).await.unwrap();
        check_as_at_s1(&clone, &a).await;
        let clone_root = clone.root();
        assert_eq!(clone_root.dataset, CLONE);
        let (ca, _) = clone.lookup(&clone_root, b"a", &cred).unwrap();
        clone
            .write(&ca, &cred, 0, &[0x77; 4096], Stable::FileSync)
            .await
            .unwrap();
        let (c, _, _) = clone
            .create(&clone_root, b"c", &cred, CreateHow::Guarded(attrs(0o644)))
            .await
            .unwrap();
        clone.write(&c, &cred, 0, &[3u8; 100], Stable::FileSync).await.unwrap();
        check_clone(&clone).await;
        assert_eq!(
            fs.getattr(&ca),
            Err(FsError::Stale),
            "a clone's handle is not the dataset's"
        );

        // A newer snapshot stands in the way.
        fs.snapshot("s2").await.unwrap();
        assert!(matches!(fs.rollback("s1").await, Err(FsError::Io(_))));
        fs.destroy_snapshot("s2").await.unwrap();
        assert_eq!(fs.rollback("nope").await, Err(FsError::NoEnt));

        fs.rollback("s1").await.unwrap();
        check_as_at_s1(&fs, &a).await;
        assert_eq!(
            fs.getattr(&a).unwrap().size,
            10_000,
            "a handle the snapshot has stays valid"
        );
        assert_eq!(fs.getattr(&later), Err(FsError::Stale), "a file made since is gone");
        let (again, _, _) = fs
            .create(&root, b"later", &cred, CreateHow::Guarded(attrs(0o644)))
            .await
            .unwrap();
        assert_ne!(again, later, "a new file never gets the handle of one rolled back");
        assert_eq!(fs.getattr(&later), Err(FsError::Stale));
        fs.remove(&root, b"later", &cred).await.unwrap();
        check_clone(&clone).await;
        let snap = fs.snapshot_fs(s1.id).unwrap();
        check_as_at_s1(&snap, &a).await;
        drop(snap);

        // Power loss: the log replays the clone and the rollback in order.
        drop(clone);
        let (pool, fs) = power_loss(&sim, (pool, fs)).await;
        check_as_at_s1(&fs, &a).await;
        assert_eq!(fs.getattr(&later), Err(FsError::Stale));
        let clone = FileSystem::open(&pool, CLONE, 16 << 10, 0).await.unwrap();
        check_clone(&clone).await;

        // From the metadata store's rows.
        pool.checkpoint().await.unwrap();
        drop(clone);
        let (pool, fs) = power_loss(&sim, (pool, fs)).await;
        check_as_at_s1(&fs, &a).await;
        assert_eq!(fs.getattr(&later), Err(FsError::Stale));
        let clone = FileSystem::open(&pool, CLONE, 16 << 10, 0).await.unwrap();
        check_clone(&clone).await;
        // The snapshot has a clone: the pool keeps it.
        assert!(fs.destroy_snapshot("s1").await.is_err());
    });
}

/// The origin dataset of [`a_promoted_clone_takes_over_the_snapshots`]
/// after its changes: /a and /d/b removed, /l renamed, /later made.
async fn check_origin_live(fs: &FileSystem) {
    let root = fs.root();
    let cred = Cred::root();
    assert_eq!(names(fs, &root), [".", "..", "d", "u", "l2", "later"]);
    let (later, attr) = fs.lookup(&root, b"later", &cred).unwrap();
    assert_eq!(attr.size, 50_000);
    assert_eq!(fs.read(&later, &cred, 49_900, 200).await.unwrap().0, vec![1u8; 100]);
    let (u, attr) = fs.lookup(&root, b"u", &cred).unwrap();
    assert_eq!(attr.size, 20_000);
    assert_eq!(fs.read(&u, &cred, 0, 100).await.unwrap().0, vec![9u8; 100]);
}

/// Snapshot `s0` of [`a_promoted_clone_takes_over_the_snapshots`]: the tree
/// [`build`] made, before /u.
async fn check_as_at_s0(snap: &FileSystem) {
    let root = snap.root();
    let cred = Cred::root();
    assert_eq!(names(snap, &root), [".", "..", "a", "d", "l"]);
    let (a, attr) = snap.lookup(&root, b"a", &cred).unwrap();
    assert_eq!((attr.size, attr.nlink), (10_000, 2));
    let (data, _) = snap.read(&a, &cred, 0, 20_000).await.unwrap();
    assert_eq!(data, (0..10_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
}

/// The snapshot `name` of `fs`, as a client finds it in `.snapshot`.
fn snapshot_in_dir(fs: &FileSystem, name: &str) -> Arc<FileSystem> {
    let cred = Cred::root();
    let (dir, _) = fs.lookup(&fs.root(), SNAPSHOT_DIR, &cred).unwrap();
    let (snap_root, attr) = fs.lookup(&dir, name.as_bytes(), &cred).unwrap();
    assert_eq!(attr.fsid, fs.getattr(&fs.root()).unwrap().fsid, "in the dataset's fsid");
    let snap = fs.snapshot_fs(snap_root.dataset).expect("the snapshot opens");
    assert_eq!(snap.root(), snap_root);
    snap
}

/// After the promotion of [`a_promoted_clone_takes_over_the_snapshots`]:
/// `s0` and `s1` are the clone's (before its own `c1`), the origin keeps
/// `s2` and is a clone of `s1`; every view as it was. `sa` is the handle
/// of /a in `s1` a client had before the promotion.
async fn check_promoted(pool: &Pool, fs: &FileSystem, clone: &FileSystem, sa: &Handle) {
    let cred = Cred::root();
    let listed = |fs: &FileSystem| -> Vec<String> { fs.snapshot_list().into_iter().map(|s| s.name).collect() };
    assert_eq!(listed(clone), ["s0", "s1", "c1"]);
    assert_eq!(listed(fs), ["s2"]);
    let s1 = clone.snapshot_list()[1].id;
    assert_eq!(sa.dataset, s1);
    assert_eq!(pool.origin_of(DATASET), Some(s1), "the origin is a clone of s1 now");
    assert_eq!(pool.origin_of(CLONE), None, "the clone is its own");
    for (dataset, want) in [(clone, vec!["s0", "s1", "c1"]), (fs, vec!["s2"])] {
        let (dir, _) = dataset.lookup(&dataset.root(), SNAPSHOT_DIR, &cred).unwrap();
        let mut all = vec![".", ".."];
        all.extend(want);
        assert_eq!(names(dataset, &dir), all);
    }
    assert_eq!(
        fs.lookup(&fs.lookup(&fs.root(), SNAPSHOT_DIR, &cred).unwrap().0, b"s1", &cred),
        Err(FsError::NoEnt),
        "moved away"
    );
    assert!(fs.snapshot_fs(s1).is_none());
    check_as_at_s0(&snapshot_in_dir(clone, "s0")).await;
    let snap = snapshot_in_dir(clone, "s1");
    check_as_at_s1(&snap, sa).await;
    // The handle from before is the clone's snapshot's now: same file,
    // same data, in the clone's fsid.
    let attr = snap.getattr(sa).unwrap();
    assert_eq!(
        (attr.size, attr.fsid),
        (10_000, clone.getattr(&clone.root()).unwrap().fsid)
    );
    assert_eq!(
        snap.read(sa, &cred, 0, 100).await.unwrap().0,
        (0..100u32).map(|i| (i % 251) as u8).collect::<Vec<_>>()
    );
    let c1 = snapshot_in_dir(clone, "c1");
    check_clone(&c1).await;
    check_clone(clone).await;
    check_origin_live(fs).await;
    assert_eq!(snapshot_in_dir(fs, "s2").root().dataset, fs.snapshot_list()[0].id);
    check_origin_live(&snapshot_in_dir(fs, "s2")).await;
}

/// The promoted clone once its former origin is destroyed.
async fn check_alone(pool: &Pool, clone: &FileSystem, sa: &Handle) {
    assert_eq!(pool.origin_of(CLONE), None);
    check_clone(clone).await;
    check_as_at_s0(&snapshot_in_dir(clone, "s0")).await;
    check_as_at_s1(&snapshot_in_dir(clone, "s1"), sa).await;
    check_clone(&snapshot_in_dir(clone, "c1")).await;
}

/// `zfs promote` for datasets: the clone takes the origin snapshot and the
/// older ones with their namespaces, the origin becomes a clone of it;
/// through a power loss (replay of the `Promote` record) and from a
/// checkpoint; then the former origin can go.
#[test]
fn a_promoted_clone_takes_over_the_snapshots() {
    block_on(async {
        let sim = SimDevice::new(160 << 20, 13);
        let pool = new_pool(&sim).await;
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let cred = Cred::root();
        let (a, d) = build(&fs).await;
        fs.snapshot("s0").await.unwrap();
        let u = unstable_u(&fs).await;
        let s1 = fs.snapshot("s1").await.unwrap();
        change_after_s1(&fs, &a, &d, &u).await;
        fs.snapshot("s2").await.unwrap();

        pool.create_clone(CLONE, s1.id).await.unwrap();
        let clone = FileSystem::open(&pool, CLONE, 16 << 10, 0).await.unwrap();
        let clone_root = clone.root();
        let (ca, _) = clone.lookup(&clone_root, b"a", &cred).unwrap();
        clone
            .write(&ca, &cred, 0, &[0x77; 4096], Stable::FileSync)
            .await
            .unwrap();
        let (c, _, _) = clone
            .create(&clone_root, b"c", &cred, CreateHow::Guarded(attrs(0o644)))
            .await
            .unwrap();
        clone.write(&c, &cred, 0, &[3u8; 100], Stable::Unstable).await.unwrap();
        // A client has s1 open through the origin, a handle in it.
        let old_view = snapshot_in_dir(&fs, "s1");
        let (sa, _) = old_view.lookup(&old_view.root(), b"a", &cred).unwrap();

        // Refused: a snapshot name of the clone that would clash, and a
        // dataset that is no clone.
        clone.snapshot("s0").await.unwrap();
        match clone.promote(&fs).await {
            Err(FsError::Io(message)) => assert!(message.contains("'s0'"), "{message}"),
            other => panic!("a clash of names is refused, not {other:?}"),
        }
        assert_eq!(clone.snapshot_list().len(), 1, "nothing moved");
        clone.destroy_snapshot("s0").await.unwrap();
        match fs.promote(&clone).await {
            Err(FsError::Io(message)) => assert!(message.contains("not a clone"), "{message}"),
            other => panic!("promoting no clone is refused, not {other:?}"),
        }
        clone.snapshot("c1").await.unwrap();

        let moved = clone.promote(&fs).await.unwrap();
        assert_eq!(moved.len(), 2);
        assert_eq!(moved[1], s1.id);
        check_promoted(&pool, &fs, &clone, &sa).await;
        // A call that found the origin's view before goes on reading it.
        assert_eq!(old_view.getattr(&sa).unwrap().size, 10_000);
        assert!(clone.promote(&fs).await.is_err(), "once");
        assert!(
            clone.destroy_snapshot("s1").await.is_err(),
            "the origin is a clone of it now"
        );
        drop(old_view);

        // Power loss: the log replays the promotion.
        drop(clone);
        let (pool, fs) = power_loss(&sim, (pool, fs)).await;
        let clone = FileSystem::open(&pool, CLONE, 16 << 10, 0).await.unwrap();
        check_promoted(&pool, &fs, &clone, &sa).await;

        // From the metadata store's rows.
        pool.checkpoint().await.unwrap();
        drop(clone);
        let (pool, fs) = power_loss(&sim, (pool, fs)).await;
        let clone = FileSystem::open(&pool, CLONE, 16 << 10, 0).await.unwrap();
        check_promoted(&pool, &fs, &clone, &sa).await;

        // The former origin goes (its own snapshot first); the promoted
        // clone keeps its files and the moved snapshots theirs.
        fs.destroy_snapshot("s2").await.unwrap();
        fs.retire().await;
        pool.destroy_volume(DATASET).await.unwrap();
        drop(fs);
        check_alone(&pool, &clone, &sa).await;
        drop(clone);
        drop(pool);
        sim.crash();
        let pool = Pool::open(vec![sim.as_device()]).await.unwrap();
        assert!(pool.existing_namespace(DATASET).is_none());
        let clone = FileSystem::open(&pool, CLONE, 16 << 10, 0).await.unwrap();
        check_alone(&pool, &clone, &sa).await;
        clone.destroy_snapshot("s1").await.unwrap();
        clone.destroy_snapshot("s0").await.unwrap();
        check_clone(&snapshot_in_dir(&clone, "c1")).await;
        check_clone(&clone).await;
    });
}

/// A file dataset's data moves between tiers like a volume's: its whole
/// engine object (2^63 bytes) pinned to the capacity tier, a pass moves
/// the file's blocks there, and the file reads back the same before and
/// after a power loss.
#[test]
fn a_datasets_files_move_between_tiers() {
    block_on(async {
        let fast = SimDevice::new(160 << 20, 11);
        let capacity = SimDevice::new(256 << 20, 12);
        let devices = vec![
            NewDevice {
                device: fast.as_device(),
                role: Role::Fast,
            },
            NewDevice {
                device: capacity.as_device(),
                role: Role::Capacity,
            },
        ];
        let pool = Pool::create("test", 1 << 20, devices).await.unwrap();
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let cred = Cred::root();
        let (f, _, _) = fs
            .create(&fs.root(), b"f", &cred, CreateHow::Guarded(attrs(0o644)))
            .await
            .unwrap();
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i / 4096 % 251) as u8).collect();
        fs.write(&f, &cred, 0, &data, Stable::FileSync).await.unwrap();
        pool.checkpoint().await.unwrap();
        let on = |pool: &Pool, role: Role| {
            pool.volume_tier_bytes(DATASET)
                .unwrap()
                .into_iter()
                .find(|(r, _)| *r == role)
                .unwrap()
                .1
        };
        assert!(on(&pool, Role::Fast) >= data.len() as u64);
        assert_eq!(on(&pool, Role::Capacity), 0);

        pool.set_tier_pin(DATASET, crate::pool::migrate::TierPin::Capacity);
        let summary = pool.migrate_now().await.unwrap();
        assert_eq!(summary.errors, 0, "{summary:?}");
        assert_eq!(on(&pool, Role::Fast), 0, "{summary:?}");
        assert!(on(&pool, Role::Capacity) >= data.len() as u64);
        let (read, eof) = fs.read(&f, &cred, 0, data.len() as u32).await.unwrap();
        assert!(eof && read == data, "the file differs after the move");

        drop((fs, pool));
        fast.crash();
        capacity.crash();
        let pool = Pool::open(vec![fast.as_device(), capacity.as_device()]).await.unwrap();
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let (read, _) = fs.read(&f, &cred, 0, data.len() as u32).await.unwrap();
        assert!(read == data, "the file differs after a power loss");
        assert_eq!(on(&pool, Role::Fast), 0);
    });
}

/// READDIR cookies come from the client: the largest one is past every
/// entry (an empty, complete listing), never a wrap to the start nor a
/// panic; a cookie past the last entry given out is the same.
#[test]
fn readdir_past_the_largest_cookie_is_empty_and_complete() {
    block_on(async {
        let sim = SimDevice::new(160 << 20, 17);
        let pool = new_pool(&sim).await;
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let (a, d) = build(&fs).await;
        check(&fs, &a, &d).await;
        let root = fs.root();
        let (all, eof) = fs.readdir(&root, &Cred::root(), 0, 1000).unwrap();
        assert!(eof && all.len() > 3, "{} entries", all.len());
        let last = all.iter().map(|e| e.cookie).max().unwrap();
        for cookie in [u64::MAX, u64::MAX - 1, last, last + 1_000_000] {
            let (entries, eof) = fs.readdir(&root, &Cred::root(), cookie, 1000).unwrap();
            let names: Vec<_> = entries
                .iter()
                .map(|e| String::from_utf8_lossy(&e.name).into_owned())
                .collect();
            assert!(eof && names.is_empty(), "cookie {cookie}: {names:?} (eof {eof})");
        }
    });
}

/// REMOVE commits the unlink, then frees the file's data. When freeing
/// fails (here every device read fails, and freeing a partial block reads
/// it), the removal is still answered as done, the freeing is counted and
/// retried in the background, and once the device reads again the data is
/// freed with no other call.
#[test]
fn a_committed_remove_is_answered_as_done_when_freeing_its_data_fails() {
    use crate::device::sim::SimFaults;
    block_on(async {
        let sim = SimDevice::new(160 << 20, 19);
        let pool = new_pool(&sim).await;
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        let (cred, root) = (Cred::root(), fs.root());
        let (f, _, _) = fs
            .create(&root, b"f", &cred, CreateHow::Guarded(attrs(0o644)))
            .await
            .unwrap();
        // 10,000 bytes: the last block is partial, so freeing reads it.
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        fs.write(&f, &cred, 0, &data, Stable::FileSync).await.unwrap();
        pool.checkpoint().await.unwrap();
        // Reopened: nothing of the file is cached in memory.
        let (pool, fs) = power_loss(&sim, (pool, fs)).await;
        let root = fs.root();
        assert!(fs.engine_used() > 0);

        let before = deferred_frees();
        sim.set_faults(SimFaults {
            read_error: 1.0,
            ..SimFaults::default()
        });
        let removed = fs.remove(&root, b"f", &cred).await;
        assert!(removed.is_ok(), "a committed remove answered {removed:?}");
        assert_eq!(fs.lookup(&root, b"f", &cred), Err(FsError::NoEnt));
        assert_eq!(fs.getattr(&f), Err(FsError::Stale));
        let deferred = deferred_frees();
        assert_eq!(deferred.deferred, before.deferred + 1, "{deferred:?}");
        assert_eq!(deferred.pending, before.pending + 1, "{deferred:?}");
        assert_eq!(fs.namespace.lock_or_abort().reaping(), vec![f.ino]);

        // The device reads again: the background retry frees the data.
        sim.set_faults(SimFaults::default());
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !fs.namespace.lock_or_abort().reaping().is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "never freed: {:?}",
                deferred_frees()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let after = deferred_frees();
        assert_eq!(after.freed, before.freed + 1, "{after:?}");
        assert_eq!(after.pending, before.pending, "{after:?}");
        // And it stays freed across a power loss.
        let (_pool, fs) = power_loss(&sim, (pool, fs)).await;
        assert!(fs.namespace.lock_or_abort().reaping().is_empty());
        assert_eq!(names(&fs, &fs.root()), [".", ".."]);
    });
}

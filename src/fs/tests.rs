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
    let (a, _) = fs
        .create(&root, b"a", &Cred::root(), CreateHow::Guarded(attrs(0o666)))
        .await
        .unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let (n, _, attr) = fs.write(&a, &Cred::root(), 0, &data, Stable::FileSync).await.unwrap();
    assert_eq!((n, attr.size), (10_000, 10_000));
    let (d, _) = fs.mkdir(&root, b"d", &Cred::root(), attrs(0o777)).await.unwrap();
    fs.link(&a, &d, b"b", &Cred::root()).await.unwrap();
    fs.symlink(&root, b"l", &Cred::root(), b"d/b", SetAttrs::default())
        .await
        .unwrap();
    let (gone, _) = fs
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
        drop(fs);
        drop(pool);
        sim.crash();
        let pool = Pool::open(vec![sim.as_device()]).await.unwrap();
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
        check(&fs, &a, &d).await;

        // From a checkpoint (the metadata store's rows), then more changes
        // replayed on top of it.
        pool.checkpoint().await.unwrap();
        // Onto another link of the same file: nothing happens (POSIX).
        fs.rename(&fs.root(), b"a", &d, b"b", &Cred::root()).await.unwrap();
        assert_eq!(names(&fs, &fs.root()), [".", "..", "a", "d", "l"]);
        fs.rename(&fs.root(), b"a", &d, b"c", &Cred::root()).await.unwrap();
        drop(fs);
        drop(pool);
        sim.crash();
        let pool = Pool::open(vec![sim.as_device()]).await.unwrap();
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
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
        let (locked, _) = fs.mkdir(&root, b"locked", &Cred::root(), attrs(0o755)).await.unwrap();
        assert_eq!(
            fs.create(&locked, b"x", &user(), how).await.err(),
            Some(FsError::Access)
        );
        let (home, _) = fs.mkdir(&root, b"home", &Cred::root(), attrs(0o755)).await.unwrap();
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
        let (f, attr) = fs.create(&home, b"f", &user(), how).await.unwrap();
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
        let (sub, _) = fs.mkdir(&home, b"sub", &user(), attrs(0o755)).await.unwrap();
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
        let (f, _) = fs
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
            assert_eq!(attr.size, 8192);
            chmod.await.unwrap();
        }
        sim.set_delays(SimDelays::default());
        fs.commit(&f).await.unwrap();

        drop(fs);
        drop(pool);
        sim.crash();
        let pool = Pool::open(vec![sim.as_device()]).await.unwrap();
        let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
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

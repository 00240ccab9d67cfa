//! RAM tier files left in the RAM directory by a daemon killed with kill -9:
//! the next `strata serve` of another data directory names them (and the
//! data directory each belongs to), `strata ram-tier list` shows them, and
//! `strata ram-tier remove` removes those no daemon uses.

mod common;

use common::{small_default_pool, wait_for_log, Server};
use std::process::Command;
use strata::pool::ram;

fn ram_tier(ram: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("ram-tier")
        .args(args)
        .arg("--ram-dir")
        .arg(ram)
        .output()
        .unwrap()
}

#[test]
fn a_killed_daemons_ram_tier_is_reported_listed_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let ram = dir.path().join("ram");
    std::fs::create_dir(&ram).unwrap();
    let first = dir.path().join("first");
    small_default_pool(&first);
    let mut killed = Server::start_with_ram_dir(&first, Some(&ram));
    killed.kill9();
    let key = strata::control::manager::ram_file_key(&first, "default");
    let left = ram.join(format!("strata-{key}.ram"));
    assert!(left.exists(), "kill -9 leaves the RAM tier file {}", left.display());

    // A daemon of another data directory on the same RAM directory.
    let second = dir.path().join("second");
    small_default_pool(&second);
    let log = dir.path().join("second.log");
    let mut running = Server::start_logged(&second, Some(&ram), &[], Some(&log));
    wait_for_log(&log, "stale RAM tier file");
    let logged = std::fs::read_to_string(&log).unwrap();
    let line = logged
        .lines()
        .find(|l| l.contains("stale RAM tier file"))
        .unwrap()
        .to_string();
    let first_canonical = std::fs::canonicalize(&first).unwrap();
    assert!(line.contains(&left.display().to_string()), "{line}");
    assert!(
        line.contains(&format!("data directory {}", first_canonical.display())),
        "{line}"
    );
    assert!(line.contains("strata ram-tier remove"), "{line}");
    assert_eq!(
        logged.matches("stale RAM tier file").count(),
        1,
        "only the killed daemon's file is stale (the running one's own is in use):\n{logged}"
    );

    // Listed: the killed daemon's stale, the running one's in use.
    let listed = ram_tier(&ram, &["list", "--json"]);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let files: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let files = files.as_array().unwrap();
    assert_eq!(files.len(), 2, "{files:?}");
    let by_dir = |dir: &std::path::Path| {
        let dir = std::fs::canonicalize(dir).unwrap().display().to_string();
        files
            .iter()
            .find(|f| f["data_dir"] == dir.as_str())
            .unwrap_or_else(|| panic!("no file of {dir}: {files:?}"))
            .clone()
    };
    let stale = by_dir(&first);
    let in_use = by_dir(&second);
    assert_eq!(stale["file"], left.display().to_string());
    assert_eq!(stale["pool"], "default");
    assert!(stale["pid"].is_null(), "{stale}");
    assert_eq!(in_use["pid"], running.pid());
    let table = ram_tier(&ram, &["list"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.starts_with("FILE"), "{table}");
    assert!(
        table.contains("stale") && table.contains(&format!("in use (pid {})", running.pid())),
        "{table}"
    );

    // The running daemon's file is refused; --stale removes the other only.
    let refused = ram_tier(&ram, &["remove", in_use["file"].as_str().unwrap()]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("in use by process"), "{said}");
    let removed = ram_tier(&ram, &["remove", "--stale"]);
    assert!(removed.status.success(), "{}", String::from_utf8_lossy(&removed.stderr));
    assert_eq!(
        String::from_utf8_lossy(&removed.stdout),
        format!("removed {}\n", left.display())
    );
    assert!(!left.exists());
    assert!(std::path::Path::new(in_use["file"].as_str().unwrap()).exists());
    assert!(running.stop().success());
}

/// A region file records its data directory; listed, it shows who
/// holds it and whether it is dirty; it is removed only when no process
/// holds it, and when dirty only with `force`.
#[test]
fn region_files_are_listed_with_their_data_directory_and_removed_only_when_free() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strata-0123abcd-tank-2.ram");
    std::fs::write(dir.path().join("strata-other.ram"), b"not a region").unwrap();
    let source = ram::RamSource::File {
        path: path.clone(),
        bytes: 2 << 20,
        data_dir: Some(std::path::PathBuf::from("/srv/strata data")),
    };
    let (tier, _, _) = ram::RamTier::open(&source, &[4u8; 16]).unwrap();
    let listed = ram::region_files(dir.path()).unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].pool, "tank-2");
    assert_eq!(listed[0].data_dir, Some(std::path::PathBuf::from("/srv/strata data")));
    assert_eq!(listed[0].held_by, Some(std::process::id()));
    assert!(!listed[0].dirty);
    assert!(matches!(
        ram::remove_region_file(&path, true),
        Err(ram::RemoveError::InUse(..))
    ));
    let slot = tier.allocate(1).unwrap()[0];
    let data = vec![3u8; ram::SLOT_BYTES];
    // SAFETY: a freshly allocated slot, written once.
    unsafe { tier.write(slot, 1, 0, 1, &data, strata::checksum::crc32c(&data)) };
    drop(tier);
    let found = ram::region_file(&path).unwrap();
    assert_eq!((found.held_by, found.dirty), (None, true));
    assert!(matches!(
        ram::remove_region_file(&path, false),
        Err(ram::RemoveError::Dirty(..))
    ));
    assert!(path.exists());
    // Reopened, the sector comes back (the data directory is not part
    // of what must match), and the header still records the directory.
    let (tier, survivors, intact) = ram::RamTier::open(&source, &[4u8; 16]).unwrap();
    assert!(intact && survivors.len() == 1);
    drop(tier);
    ram::remove_region_file(&path, true).unwrap();
    assert!(!path.exists());
    assert!(matches!(
        ram::remove_region_file(&dir.path().join("strata-other.ram"), true),
        Err(ram::RemoveError::NotRegion(_))
    ));
    assert_eq!(ram::region_file_pool("strata-0123abcd-a-b.ram"), Some("a-b"));
    assert_eq!(ram::region_file_pool("strata-0123abc-a.ram"), None);
}

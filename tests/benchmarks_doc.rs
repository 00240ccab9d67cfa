//! BENCHMARKS.md is generated: `python3 bench/all.py render` writes it from
//! bench/BENCHMARKS.md.in and bench/results/*.csv. This test runs
//! `python3 bench/all.py check`, which fails when the committed page is not
//! what a render writes (a hand edit, a CSV or template changed without a
//! render), leaving out only the "not rerun since COMMIT" notes, which
//! depend on later commits (bench/all.py's docstring gives the rule).

use std::path::Path;
use std::process::Command;

#[test]
fn benchmarks_md_is_what_bench_all_py_renders() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new("python3")
        .arg("bench/all.py")
        .arg("check")
        .current_dir(root)
        .output()
        .expect("python3 runs bench/all.py");
    assert!(
        output.status.success(),
        "python3 bench/all.py check failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn check_fails_on_a_page_that_differs_from_the_render() {
    // The check must be able to fail: a copy of the tree's bench/ files
    // with one figure of BENCHMARKS.md changed.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("strata-benchmarks-doc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("bench/results")).expect("temporary directory");
    for file in ["bench/all.py", "bench/BENCHMARKS.md.in"] {
        std::fs::copy(root.join(file), dir.join(file)).expect("copy a bench file");
    }
    for entry in std::fs::read_dir(root.join("bench/results")).expect("bench/results") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "csv") {
            std::fs::copy(&path, dir.join("bench/results").join(path.file_name().expect("a name")))
                .expect("copy a CSV");
        }
    }
    let page = std::fs::read_to_string(root.join("BENCHMARKS.md")).expect("BENCHMARKS.md");
    let check = |page: &str| {
        std::fs::write(dir.join("BENCHMARKS.md"), page).expect("write the page");
        Command::new("python3")
            .arg("bench/all.py")
            .arg("check")
            .current_dir(&dir)
            .output()
            .expect("python3 runs bench/all.py")
    };
    assert!(check(&page).status.success(), "the copied page should pass");
    let edited = page.replacen(" | IOPS | ", " | IOPS | 1", 1);
    assert_ne!(edited, page, "the page has an IOPS row to edit");
    let output = check(&edited);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        !output.status.success(),
        "a page with a changed figure passed the check"
    );
}

//! The walls between modules, checked: each top-level module of `src/` may
//! use only modules below it in this order (and the small utilities at the
//! bottom may use each other). An import that goes up (the engine reaching
//! for the control plane, a frontend for the daemon) fails this test with
//! the file and the line.
//!
//! Test-only code (a `#[cfg(test)] mod tests` at the end of a file) is not
//! checked: tests may build what they need from anywhere.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Bottom to top. Modules on one line are peers at the same level.
const LAYERS: &[&[&str]] = &[
    &["bytes", "checksum", "private", "sync", "units", "utc"],
    &["tls"],
    &["device"],
    &["meta"],
    &["block"],
    &["analytics"],
    &["pool"],
    &["fs"],
    &["volume"],
    &["control"],
    &["scsi"],
    &["frontend"],
    &["admin"],
    &["daemon"],
];

fn level(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `crate::NAME` references outside comments and the trailing test module:
/// (line number, NAME).
fn crate_references(text: &str) -> Vec<(usize, String)> {
    let code = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    let mut found = Vec::new();
    for (number, line) in code.lines().enumerate() {
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            found.push((number + 1, name));
        }
        // `use crate::{a, b::c}` groups.
        if let Some(at) = line.find("crate::{") {
            let group = &line[at + "crate::{".len()..];
            for item in group.split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    found.push((number + 1, name));
                }
            }
        }
    }
    found
}

#[test]
fn every_module_uses_only_the_modules_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    let mut modules_seen = BTreeMap::new();
    for file in files {
        let relative = file.strip_prefix(&src).unwrap();
        let first = relative
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .into_owned();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let Some(own) = level(&module) else {
            violations.push(format!(
                "src/{}: module `{module}` is in no layer of this test",
                relative.display()
            ));
            continue;
        };
        *modules_seen.entry(module.clone()).or_insert(0) += 1;
        let text = std::fs::read_to_string(&file).unwrap();
        for (line, target) in crate_references(&text) {
            if target.is_empty() || target == module {
                continue;
            }
            let allowed = match level(&target) {
                Some(0) if own == 0 => true,
                Some(other) => other < own,
                None => false,
            };
            if !allowed {
                violations.push(format!(
                    "src/{}:{line}: `{module}` uses `crate::{target}`",
                    relative.display()
                ));
            }
        }
    }
    assert!(modules_seen.len() >= 12, "modules found: {modules_seen:?}");
    assert!(
        violations.is_empty(),
        "imports across the walls:\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_checker_sees_grouped_and_plain_references_but_not_tests_or_comments() {
    let text = "use crate::pool::Pool;\nuse crate::{device, meta::log};\n// crate::admin\nfn f() {}\n#[cfg(test)]\nmod tests {\n    use crate::daemon;\n}\n";
    let names: Vec<String> = crate_references(text).into_iter().map(|(_, n)| n).collect();
    assert_eq!(names, vec!["pool", "", "device", "meta"]);
}

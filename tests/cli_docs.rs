//! docs/CLI.md against the `strata` binary's own `--help`: every command
//! and every option the CLI has is documented, and the document names no
//! command and no option the CLI lacks.
//!
//! The convention the document follows (stated at its top):
//! - every command (`strata volume`, `strata volume create`, ...; not
//!   clap's `help`) has a heading whose text starts with the command in
//!   full as a code span: ``### `strata volume create` ``. Its section runs
//!   to the next heading of the same or a higher level, or the next
//!   command heading;
//! - every long option of a command is the first cell of an option table
//!   row (`` | `--size SIZE` | ... | ``) in that command's section, or in
//!   the table of the "Global options" section (options every command
//!   takes) or of the "Client options" section (options every command but
//!   `strata serve` takes);
//! - a command line in the document (a code block line or a code span that
//!   starts with `strata `, or `$ strata `) names an existing command, and
//!   each option on it is one of that command's;
//! - any other `--option` anywhere is an option of some strata command,
//!   except in a code block line or code span that starts with the name of
//!   another program (`curl --cacert ...`, `nbdinfo --list ...`).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_strata");
const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/CLI.md");

/// One command of the CLI as its `--help` describes it.
#[derive(Debug, Default)]
struct CommandHelp {
    /// Subcommand names (clap's `help` left out), with their aliases.
    subcommands: Vec<(String, Vec<String>)>,
    long: BTreeSet<String>,
    short: BTreeSet<char>,
}

/// Every command, by its path (`["volume", "create"]`; `[]` is `strata`).
type Tree = BTreeMap<Vec<String>, CommandHelp>;

fn help_of(path: &[String]) -> String {
    let output = Command::new(BIN)
        .args(path)
        .arg("--help")
        .env_remove("STRATA_API")
        .env_remove("STRATA_DATA_DIR")
        .env_remove("STRATA_TOKEN")
        .env_remove("STRATA_CACERT")
        .env("COLUMNS", "100")
        .output()
        .expect("run strata --help");
    assert!(
        output.status.success(),
        "`strata {} --help` failed: {}",
        path.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("help is UTF-8")
}

/// Parses clap's help text: the "Commands:" and "Options:" sections.
fn parse_help(text: &str) -> CommandHelp {
    let mut help = CommandHelp::default();
    let mut section = "";
    for line in text.lines() {
        if !line.is_empty() && !line.starts_with(' ') {
            section = line.trim_end();
            continue;
        }
        match section {
            "Commands:" => {
                // An entry starts two spaces in; its description may wrap
                // onto lines indented further, where an alias list can end up.
                if line.len() > 2 && line.starts_with("  ") && !line[2..].starts_with(' ') {
                    let name = line[2..].split_whitespace().next().unwrap_or_default().to_string();
                    if name != "help" {
                        help.subcommands.push((name, Vec::new()));
                    }
                }
                if let Some(start) = line.find("[aliases: ").or_else(|| line.find("[alias: ")) {
                    let rest = &line[start..];
                    let list = &rest[rest.find(": ").unwrap() + 2..rest.find(']').expect("alias list ends")];
                    if let Some((_, aliases)) = help.subcommands.last_mut() {
                        aliases.extend(list.split(',').map(|a| a.trim().to_string()));
                    }
                }
            }
            "Options:" => {
                // `  -s, --size <SIZE>`, `      --api <ADDR>`, `  -r`; a
                // description (indented ten spaces) never counts.
                let spec = if let Some(rest) = line.strip_prefix("      --") {
                    Some((None, rest))
                } else if let Some(rest) = line.strip_prefix("  -") {
                    let mut chars = rest.chars();
                    let short = chars.next().filter(|c| c.is_ascii_alphanumeric());
                    let after = chars.as_str();
                    match short {
                        Some(c) if after.is_empty() || after.starts_with(' ') => Some((Some(c), "")),
                        Some(c) => after.strip_prefix(", --").map(|long| (Some(c), long)),
                        None => None,
                    }
                } else {
                    None
                };
                if let Some((short, long)) = spec {
                    if let Some(c) = short {
                        help.short.insert(c);
                    }
                    let name: String = long
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                        .collect();
                    if !name.is_empty() {
                        help.long.insert(format!("--{name}"));
                    }
                }
            }
            _ => {}
        }
    }
    help
}

fn cli_tree() -> Tree {
    let mut tree = Tree::new();
    let mut pending = vec![Vec::<String>::new()];
    while let Some(path) = pending.pop() {
        let help = parse_help(&help_of(&path));
        for (name, _) in &help.subcommands {
            let mut child = path.clone();
            child.push(name.clone());
            pending.push(child);
        }
        tree.insert(path, help);
    }
    tree
}

fn show(path: &[String]) -> String {
    if path.is_empty() {
        "strata".to_string()
    } else {
        format!("strata {}", path.join(" "))
    }
}

/// Follows `words` (after `strata`) down the command tree, aliases
/// included: the command reached and how many words it took, or an error
/// when a word that should name a subcommand names none.
fn resolve(tree: &Tree, words: &[&str]) -> Result<(Vec<String>, usize), String> {
    let mut path = Vec::new();
    for (taken, word) in words.iter().enumerate() {
        let help = &tree[&path];
        // Options come after the command they belong to.
        if help.subcommands.is_empty() || word.starts_with('-') {
            return Ok((path, taken));
        }
        let found = help
            .subcommands
            .iter()
            .find(|(name, aliases)| name == word || aliases.iter().any(|a| a == word));
        match found {
            Some((name, _)) => path.push(name.clone()),
            None => {
                return Err(format!(
                    "`{} {word}`: no such command (subcommands: {})",
                    show(&path),
                    help.subcommands
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            }
        }
    }
    Ok((path, words.len()))
}

/// The `--option` tokens of a piece of text.
fn long_flags(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let mut flags = Vec::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at;
        let before_ok = start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'-');
        let name: String = text[start + 2..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
            .collect();
        if before_ok && name.starts_with(|c: char| c.is_ascii_lowercase()) {
            flags.push(format!("--{name}"));
        }
        i = start + 2 + name.len();
    }
    flags
}

/// The `-x` tokens of a command line (a dash, one letter, then the end of
/// a word).
fn short_flags(text: &str) -> Vec<char> {
    let chars: Vec<char> = text.chars().collect();
    let mut flags = Vec::new();
    for i in 0..chars.len() {
        let starts_word = i == 0 || matches!(chars[i - 1], ' ' | '[' | '(' | '|');
        let ends_word = chars
            .get(i + 2)
            .is_none_or(|c| matches!(c, ' ' | ']' | ')' | '|' | '='));
        if chars[i] == '-' && starts_word && chars.get(i + 1).is_some_and(char::is_ascii_alphabetic) && ends_word {
            flags.push(chars[i + 1]);
        }
    }
    flags
}

/// The code spans of a line of prose.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

/// A shell line cut into its commands (`a | b`, `a; b`, `a && b`, `$(b)`).
/// A ` | ` that does not start a new program (`[POOL | POOL/NAME]`,
/// `--status X | --abort X`) stays inside the command.
fn commands_of(line: &str) -> Vec<String> {
    let line = line.trim().strip_prefix("$ ").unwrap_or(line.trim());
    let mut commands: Vec<String> = Vec::new();
    for piece in line.split("&&").flat_map(|p| p.split("; ")).flat_map(|p| p.split("$(")) {
        for (n, part) in piece.split(" | ").enumerate() {
            let trimmed = part.trim();
            let program = trimmed.split_whitespace().next().unwrap_or_default();
            let new_program = program.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                && program
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            match commands.last_mut() {
                Some(last) if n > 0 && !new_program => {
                    last.push_str(" | ");
                    last.push_str(part);
                }
                _ => commands.push(trimmed.to_string()),
            }
        }
    }
    commands
}

/// Whether a code line or span is a command of another program than strata.
fn is_other_program(text: &str) -> bool {
    let text = text.trim().strip_prefix("$ ").unwrap_or(text.trim());
    let first = text.split_whitespace().next().unwrap_or_default();
    first != "strata"
        && first.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && first
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

struct DocLine<'a> {
    number: usize,
    text: &'a str,
    in_code: bool,
}

fn doc_lines(doc: &str) -> Vec<DocLine<'_>> {
    let mut in_code = false;
    let mut lines = Vec::new();
    for (index, text) in doc.lines().enumerate() {
        if text.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        lines.push(DocLine {
            number: index + 1,
            text,
            in_code,
        });
    }
    lines
}

/// A heading: its level and text.
fn heading(line: &DocLine) -> Option<(usize, String)> {
    if line.in_code || !line.text.starts_with('#') {
        return None;
    }
    let level = line.text.chars().take_while(|&c| c == '#').count();
    Some((level, line.text[level..].trim().to_string()))
}

/// What a part of the document documents.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Section {
    Command(Vec<String>),
    /// Options of every command.
    Global,
    /// Options of every command but `strata serve` (and `strata` itself).
    Client,
    Other,
}

fn is_client_command(path: &[String]) -> bool {
    path.first().is_some_and(|first| first != "serve")
}

/// Checks the document against the tree; every finding as one line.
fn check(tree: &Tree, doc: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let lines = doc_lines(doc);
    let all_long: BTreeSet<&String> = tree.values().flat_map(|h| h.long.iter()).collect();

    // Which section each line is in.
    let mut sections = Vec::with_capacity(lines.len());
    let mut stack: Vec<(usize, Section)> = Vec::new();
    let mut headed: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    for line in &lines {
        if let Some((level, text)) = heading(line) {
            let section = if let Some(rest) = text.strip_prefix("`strata") {
                let span = rest.split('`').next().unwrap_or_default();
                let words: Vec<&str> = span.split_whitespace().collect();
                match resolve(tree, &words) {
                    Ok((path, taken)) if taken == words.len() => {
                        if let Some(first) = headed.insert(path.clone(), line.number) {
                            problems.push(format!(
                                "docs/CLI.md:{}: `{}` has a second heading (first at line {first})",
                                line.number,
                                show(&path)
                            ));
                        }
                        Section::Command(path)
                    }
                    Ok((path, taken)) => {
                        problems.push(format!(
                            "docs/CLI.md:{}: heading names `strata{span}`, but `{}` has no subcommand `{}`",
                            line.number,
                            show(&path),
                            words[taken]
                        ));
                        Section::Other
                    }
                    Err(message) => {
                        problems.push(format!("docs/CLI.md:{}: heading {message}", line.number));
                        Section::Other
                    }
                }
            } else if text == "Global options" {
                Section::Global
            } else if text == "Client options" {
                Section::Client
            } else {
                Section::Other
            };
            let is_command = matches!(section, Section::Command(_));
            while stack
                .last()
                .is_some_and(|(l, s)| *l >= level || (is_command && matches!(s, Section::Command(_))))
            {
                stack.pop();
            }
            // A heading inside a section that is no command heading
            // (`### NBD over TLS`) stays in that section.
            let inherited = match (&section, stack.last()) {
                (Section::Other, Some((_, outer))) => outer.clone(),
                _ => section,
            };
            stack.push((level, inherited));
        }
        sections.push(stack.last().map_or(Section::Other, |(_, s)| s.clone()));
    }

    // Every command has its heading.
    for path in tree.keys().filter(|p| !p.is_empty()) {
        if !headed.contains_key(path) {
            problems.push(format!(
                "missing: `{}` has no heading ``## `{}` ``",
                show(path),
                show(path)
            ));
        }
    }

    // Options documented in tables, by section.
    let mut documented: BTreeMap<Section, BTreeSet<String>> = BTreeMap::new();
    for (line, section) in lines.iter().zip(&sections) {
        if line.in_code || !line.text.trim_start().starts_with('|') {
            continue;
        }
        let first_cell = line.text.trim_start()[1..].split('|').next().unwrap_or_default();
        let flags = long_flags(&code_spans(first_cell).join(" "));
        for flag in flags {
            let ok = match section {
                Section::Command(path) => tree[path].long.contains(&flag),
                Section::Global => tree.values().all(|h| h.long.contains(&flag)),
                Section::Client => tree
                    .iter()
                    .filter(|(p, _)| is_client_command(p))
                    .all(|(_, h)| h.long.contains(&flag)),
                Section::Other => true,
            };
            if !ok {
                let whose = match section {
                    Section::Command(path) => format!("an option of `{}`", show(path)),
                    Section::Global => "an option of every command".to_string(),
                    _ => "an option of every command but `strata serve`".to_string(),
                };
                problems.push(format!(
                    "extra: docs/CLI.md:{}: `{flag}` is documented as {whose}, which it is not",
                    line.number
                ));
            }
            documented.entry(section.clone()).or_default().insert(flag);
        }
    }
    let empty = BTreeSet::new();
    let global = documented.get(&Section::Global).unwrap_or(&empty);
    let client = documented.get(&Section::Client).unwrap_or(&empty);
    for (path, help) in tree {
        let own = documented.get(&Section::Command(path.clone())).unwrap_or(&empty);
        for flag in &help.long {
            let covered =
                own.contains(flag) || global.contains(flag) || (is_client_command(path) && client.contains(flag));
            if !covered {
                problems.push(format!(
                    "missing: `{} {flag}` is in no option table of its section, \"Global options\" or \"Client options\"",
                    show(path)
                ));
            }
        }
    }

    // Command lines, and every other option named anywhere.
    let top: BTreeSet<&str> = tree[&Vec::new()]
        .subcommands
        .iter()
        .flat_map(|(name, aliases)| std::iter::once(name.as_str()).chain(aliases.iter().map(String::as_str)))
        .collect();
    // The words of a command line after `strata`; in a code span the
    // `strata` may be left out (`pool create --ram SIZE`).
    let command_words = |command: &str, in_span: bool| -> Option<Vec<String>> {
        let words: Vec<String> = command.split_whitespace().map(str::to_string).collect();
        match words.first().map(String::as_str) {
            Some("strata") => Some(words[1..].to_vec()),
            Some(first) if in_span && top.contains(first) => Some(words),
            _ => None,
        }
    };
    for line in &lines {
        // Code block lines, or the code spans of prose, each with whether
        // it is a span; and the prose between spans.
        let mut pieces: Vec<(&str, bool)> = Vec::new();
        let mut prose: Vec<&str> = Vec::new();
        if line.in_code {
            pieces.push((line.text, false));
        } else {
            for (n, part) in line.text.split('`').enumerate() {
                if n % 2 == 1 {
                    pieces.push((part, true));
                } else {
                    prose.push(part);
                }
            }
        }
        for (piece, in_span) in pieces {
            let mut is_strata = false;
            for command in commands_of(piece) {
                let Some(words) = command_words(&command, in_span) else {
                    continue;
                };
                is_strata = true;
                let words: Vec<&str> = words.iter().map(String::as_str).collect();
                match resolve(tree, &words) {
                    Ok((path, _)) => {
                        let help = &tree[&path];
                        for flag in long_flags(&command) {
                            if !help.long.contains(&flag) {
                                problems.push(format!(
                                    "extra: docs/CLI.md:{}: `{}` has no option `{flag}` (in `{command}`)",
                                    line.number,
                                    show(&path)
                                ));
                            }
                        }
                        for flag in short_flags(&command) {
                            if !help.short.contains(&flag) {
                                problems.push(format!(
                                    "extra: docs/CLI.md:{}: `{}` has no option `-{flag}` (in `{command}`)",
                                    line.number,
                                    show(&path)
                                ));
                            }
                        }
                    }
                    Err(message) => problems.push(format!("extra: docs/CLI.md:{}: {message}", line.number)),
                }
            }
            // Neither a strata command line nor another program's: its
            // options are checked with the prose.
            if !is_strata && !is_other_program(piece) {
                prose.push(piece);
            }
        }
        for flag in prose.iter().flat_map(|text| long_flags(text)) {
            if !all_long.contains(&flag) {
                problems.push(format!(
                    "extra: docs/CLI.md:{}: `{flag}` is no option of any strata command",
                    line.number
                ));
            }
        }
    }
    problems
}

#[test]
fn cli_md_documents_every_command_and_option_and_nothing_else() {
    let tree = cli_tree();
    // The parser must have seen the CLI, or every check below is vacuous.
    let paths: Vec<String> = tree.keys().map(|p| show(p)).collect();
    for expected in [
        "strata serve",
        "strata volume create",
        "strata pool add-device",
        "strata receive",
    ] {
        assert!(
            paths.iter().any(|p| p == expected),
            "{expected} not found in --help: {paths:?}"
        );
    }
    assert!(tree[&vec!["serve".to_string()]].long.contains("--data-dir"));
    assert!(tree[&vec!["volume".to_string(), "create".to_string()]]
        .short
        .contains(&'s'));

    let doc = std::fs::read_to_string(DOC).expect("read docs/CLI.md");
    let problems = check(&tree, &doc);
    assert!(
        problems.is_empty(),
        "docs/CLI.md and `strata --help` disagree ({} problems):\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

/// The checker itself: it must find what a wrong document gets wrong.
#[test]
fn the_checker_finds_missing_and_extra_commands_and_options() {
    let tree = cli_tree();
    let doc = "\
# CLI

## Global options

| option | meaning |
|---|---|
| `--help` | help |
| `--version` | version |

## `strata volume`

### `strata volume create`

| option | meaning |
|---|---|
| `--size SIZE` | size |
| `--colour` | no such option |

```
strata volume create POOL/NAME --size 1G --wait -s 1G -q
strata volume frobnicate X
nbdinfo --list nbd://x
```

Prose naming `--no-such-flag`, and `curl --not-ours` is another program's.
";
    let problems = check(&tree, doc);
    let has = |needle: &str| problems.iter().any(|p| p.contains(needle));
    assert!(
        has("`--colour` is documented as an option of `strata volume create`"),
        "{problems:#?}"
    );
    assert!(has("`strata volume create` has no option `--wait`"), "{problems:#?}");
    assert!(has("`strata volume create` has no option `-q`"), "{problems:#?}");
    assert!(has("`strata volume frobnicate`: no such command"), "{problems:#?}");
    assert!(
        has("`--no-such-flag` is no option of any strata command"),
        "{problems:#?}"
    );
    assert!(has("missing: `strata pool create` has no heading"), "{problems:#?}");
    assert!(has("missing: `strata serve --nbd`"), "{problems:#?}");
    assert!(has("missing: `strata volume create --api`"), "{problems:#?}");
    assert!(!has("`strata volume create --size`"), "{problems:#?}");
    assert!(!has("`--size` is documented"), "{problems:#?}");
    assert!(!has("--list"), "{problems:#?}");
    assert!(!has("--not-ours"), "{problems:#?}");
    assert!(!has("missing: `strata volume create` has no heading"), "{problems:#?}");
}

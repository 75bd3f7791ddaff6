//! The binding files keep the order src/lib.rs's module documentation lists (each file imports
//! exactly the files named beside it, all listed before it, so there is no circle) and stay
//! under 800 lines. Reads the sources only: `cargo test -p candlewick-python --test layers`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

const MAX_LINES: usize = 800;

/// `(file, the files it may import)` in the order lib.rs lists them: the lines
/// ``//! N. `name` (`a`, `b`): ...`` (no parenthesis: it imports none).
fn declared_layers(lib: &str) -> Vec<(String, BTreeSet<String>)> {
    let mut layers = Vec::new();
    for line in lib.lines() {
        let Some(rest) = line.strip_prefix("//! ") else { continue };
        let Some((number, rest)) = rest.split_once(". `") else { continue };
        if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Some((name, rest)) = rest.split_once('`') else { continue };
        let imports = match rest.strip_prefix(" (").and_then(|r| r.split_once(')')) {
            Some((list, _)) => list.split(", ").map(|m| m.trim_matches('`').to_owned()).collect(),
            None => BTreeSet::new(),
        };
        layers.push((name.to_owned(), imports));
    }
    layers
}

/// The binding modules (of `modules`) a source file names through `super::` or `crate::`, in
/// imports and paths (`super::Item` from a module nested in the file names no other file).
fn used_modules(source: &str, modules: &BTreeSet<&str>) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    for prefix in ["super::", "crate::"] {
        for (at, _) in source.match_indices(prefix) {
            let before = source[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let rest = &source[at + prefix.len()..];
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                used.insert(name);
            }
        }
        // `use super::{a::x, b::y}`.
        for (at, _) in source.match_indices(&format!("{prefix}{{")) {
            let rest = &source[at + prefix.len() + 1..];
            let group = &rest[..rest.find('}').unwrap_or(rest.len())];
            for item in group.split(',') {
                let name: String = item.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if !name.is_empty() {
                    used.insert(name);
                }
            }
        }
    }
    used.retain(|m| modules.contains(m.as_str()));
    used
}

fn sources() -> BTreeMap<String, String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(&dir).expect("bindings/python/src") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "rs") {
            let name = path.file_stem().expect("a file name").to_string_lossy().into_owned();
            files.insert(name, fs::read_to_string(&path).expect("a readable source"));
        }
    }
    files
}

#[test]
fn every_binding_file_imports_only_the_files_listed_before_it() {
    let files = sources();
    let layers = declared_layers(&files["lib"]);
    let listed: BTreeSet<&str> = layers.iter().map(|(n, _)| n.as_str()).collect();
    let on_disk: BTreeSet<&str> = files.keys().map(String::as_str).filter(|n| *n != "lib").collect();
    assert_eq!(listed, on_disk, "lib.rs's list of layers and the files in src/ differ");
    let mut below = BTreeSet::new();
    for (name, declared) in &layers {
        let upward: Vec<&String> = declared.iter().filter(|m| !below.contains(m.as_str())).collect();
        assert!(upward.is_empty(), "lib.rs lets `{name}` import {upward:?}, which are not listed before it");
        let used = used_modules(&files[name.as_str()], &on_disk);
        assert_eq!(&used, declared, "`{name}.rs` imports {used:?}; lib.rs lists {declared:?}");
        below.insert(name.as_str());
    }
}

#[test]
fn no_binding_file_is_over_800_lines() {
    for (name, source) in sources() {
        let lines = source.lines().count();
        assert!(lines <= MAX_LINES, "{name}.rs has {lines} lines (at most {MAX_LINES})");
    }
}

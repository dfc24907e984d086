//! The house order holds: every `crate::` path in `src/` points down
//! `main → operator → {admission, reconcile, account} → backend → bus → policy → api`, and the
//! modules on one level do not use each other. `src/lib.rs` states the same order; this test is
//! what keeps it true (a grep over the code, comments left out).

use std::path::Path;

/// The layers, bottom first. Modules on one level are siblings.
const LAYERS: &[&[&str]] = &[
    &["api", "serve"],
    &["policy"],
    &["bus"],
    &["backend"],
    &["admission", "reconcile", "account"],
    // `plugin` (`kubectl settle`) is a top-level like main, beside the operator.
    &["operator", "plugin"],
];

fn level(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The `crate::<module>` paths a file uses, outside comments, with their line numbers;
/// `use crate::{a::X, b}` names both `a` and `b`.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    // Keep code only, and remember each character's line.
    let mut code = String::new();
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for ch in line.split("//").next().unwrap_or("").chars().chain(['\n']) {
            code.push(ch);
            lines.push(n + 1);
        }
    }
    let chars: Vec<char> = code.chars().collect();
    let ident = |from: usize| -> String {
        chars[from..]
            .iter()
            .take_while(|c| c.is_ascii_alphanumeric() || **c == '_')
            .collect()
    };
    let mut found = Vec::new();
    let mut i = 0;
    while let Some(at) = code[i..].find("crate::").map(|k| i + k) {
        // `code` is ASCII wherever `crate::` can match, so byte and char offsets agree there.
        let start = code[..at].chars().count() + "crate::".len();
        if chars.get(start) == Some(&'{') {
            // A group: every name at depth one, up to its closing brace.
            let (mut depth, mut j, mut expect_name) = (1, start + 1, true);
            while j < chars.len() && depth > 0 {
                match chars[j] {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 1 => expect_name = true,
                    c if expect_name && (c.is_ascii_alphanumeric() || c == '_') => {
                        found.push((lines[j], ident(j)));
                        expect_name = false;
                    }
                    _ => {}
                }
                j += 1;
            }
        } else {
            let name = ident(start);
            if !name.is_empty() {
                found.push((lines[start], name));
            }
        }
        i = at + "crate::".len();
    }
    found
}

#[test]
fn every_import_points_down_the_house_order() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut checked = 0;
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under src");
        let top = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|s| s.trim_end_matches(".rs").to_string())
            .unwrap_or_default();
        let Some(mine) = level(&top) else { continue };
        let text = std::fs::read_to_string(file).expect("read file");
        for (line, used) in crate_paths(&text) {
            let Some(theirs) = level(&used) else { continue };
            checked += 1;
            if used != top && theirs >= mine {
                wrong.push(format!(
                    "src/{}:{line} ({top}) uses crate::{used}",
                    rel.display()
                ));
            }
        }
    }
    assert!(
        checked >= 30,
        "the grep found only {checked} crate paths: is it still reading src/?"
    );
    assert!(
        wrong.is_empty(),
        "imports against the house order:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_grep_sees_an_upward_import_and_ignores_comments() {
    let text = "use crate::api::X;\n// crate::operator in a comment\nlet y = crate::backend::nats::f(); // crate::admission\nuse crate::{\n    bus::{A, B},\n    policy::C,\n};\n";
    let found = crate_paths(text);
    let names: Vec<&str> = found.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(names, ["api", "backend", "bus", "policy"]);
    assert_eq!(found[2].0, 5, "the line of a name inside a group");
}

#[test]
fn lib_rs_states_the_same_order() {
    let lib = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs"))
        .expect("read lib.rs");
    assert!(
        lib.contains(
            "main → operator → {admission, reconcile, account} → backend → bus → policy → api"
        ),
        "src/lib.rs must state the order this test checks"
    );
}

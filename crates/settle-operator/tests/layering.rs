//! What the crate graph does not enforce of the house order. Across crates the compiler refuses
//! an arrow up (`settle` cannot name `settle_operator`); these tests check the rest:
//!
//! - the crates' manifests depend only downward: `settle` on none of ours, `settle-import` on
//!   `settle`, `settle-operator` on both, `kubectl-settle` on the three (for the condition names);
//! - the library applications link carries none of the operator's dependencies by default;
//! - inside each crate, every `crate::` path points down its own order
//!   (`backend → bus → policy → api` in `settle`; `main → operator → {admission, reconcile,
//!   account} → {serve, events, exposition}` in `settle-operator`), and the modules on one level
//!   do not use each other; each crate's `src/lib.rs` states the order;
//! - inside every folder, the files beside `mod.rs` use each other in no circle.
//!
//! A grep over the code, comments left out.

use std::path::{Path, PathBuf};

/// A crate of the workspace whose modules keep a house order: where its sources are, its layers
/// bottom first (modules on one level are siblings), and the line its `src/lib.rs` states.
struct House {
    krate: &'static str,
    layers: &'static [&'static [&'static str]],
    stated: &'static str,
}

const HOUSES: &[House] = &[
    House {
        krate: "settle",
        layers: &[&["api"], &["policy"], &["bus"], &["backend"]],
        stated: "backend → bus → policy → api",
    },
    House {
        krate: "settle-operator",
        layers: &[
            &["serve", "events", "exposition"],
            &["admission", "reconcile", "account"],
            &["operator"],
        ],
        stated: "main → operator → {admission, reconcile, account} → settle::backend",
    },
];

fn src_of(krate: &str) -> PathBuf {
    settle_testkit::root()
        .join("crates")
        .join(krate)
        .join("src")
}

fn level(layers: &[&[&str]], module: &str) -> Option<usize> {
    layers.iter().position(|l| l.contains(&module))
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
    paths_after(text, "crate::")
}

/// The names a file's code uses right after `prefix` (`crate::`, `super::super::`,
/// `crate::reconcile::`), outside comments, with their line numbers: `prefix{a::X, b}` names `a`
/// and `b`. A match inside a longer path (`super::` within `super::super::x`) does not count.
fn paths_after(text: &str, prefix: &str) -> Vec<(usize, String)> {
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
    while let Some(at) = code[i..].find(prefix).map(|k| i + k) {
        i = at + prefix.len();
        let before = code[..at].chars().last();
        if before.is_some_and(|c| c == ':' || c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        // `code` is ASCII wherever `prefix` can match, so byte and char offsets agree there.
        let start = code[..at].chars().count() + prefix.len();
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
    }
    // `super::super::x` read with the prefix `super::` names no sibling.
    found.retain(|(_, n)| n != "super");
    found
}

#[test]
fn every_import_points_down_the_house_order() {
    let mut checked = 0;
    let mut wrong = Vec::new();
    for house in HOUSES {
        let src = src_of(house.krate);
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        for file in &files {
            let rel = file.strip_prefix(&src).expect("under src");
            let top = rel
                .components()
                .next()
                .and_then(|c| c.as_os_str().to_str())
                .map(|s| s.trim_end_matches(".rs").to_string())
                .unwrap_or_default();
            // main.rs sits above every layer.
            let mine = if top == "main" {
                house.layers.len()
            } else {
                let Some(mine) = level(house.layers, &top) else {
                    continue;
                };
                mine
            };
            let text = std::fs::read_to_string(file).expect("read file");
            for (line, used) in crate_paths(&text) {
                let Some(theirs) = level(house.layers, &used) else {
                    continue;
                };
                checked += 1;
                if used != top && theirs >= mine {
                    wrong.push(format!(
                        "crates/{}/src/{}:{line} ({top}) uses crate::{used}",
                        house.krate,
                        rel.display()
                    ));
                }
            }
        }
    }
    assert!(
        checked >= 30,
        "the grep found only {checked} crate paths: is it still reading the crates' src/?"
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
fn each_lib_rs_states_the_same_order() {
    for house in HOUSES {
        let lib = std::fs::read_to_string(src_of(house.krate).join("lib.rs")).expect("read lib.rs");
        assert!(
            lib.contains(house.stated),
            "crates/{}/src/lib.rs must state the order this test checks: {}",
            house.krate,
            house.stated
        );
    }
}

/// The workspace crates a member's manifest depends on (normal dependencies only), by package
/// name: `settle.workspace = true`, `settle = { workspace = true, … }`.
fn our_dependencies(krate: &str) -> Vec<String> {
    let manifest = settle_testkit::root()
        .join("crates")
        .join(krate)
        .join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).expect("read a member's Cargo.toml");
    let mut section = String::new();
    let mut found = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
            continue;
        }
        if section != "[dependencies]" {
            continue;
        }
        let name = line.split(['=', '.', ' ']).next().unwrap_or_default();
        if name == "settle" || name.starts_with("settle-") || name == "kubectl-settle" {
            found.push(name.to_string());
        }
    }
    found.sort();
    found
}

#[test]
fn the_crates_depend_only_downward() {
    let allowed: &[(&str, &[&str])] = &[
        ("settle", &[]),
        ("settle-import", &["settle"]),
        ("settle-operator", &["settle", "settle-import"]),
        (
            "kubectl-settle",
            &["settle", "settle-import", "settle-operator"],
        ),
        ("settle-testkit", &["settle", "settle-operator"]),
        ("settle-e2e", &[]),
        ("settle-examples", &["settle"]),
    ];
    let members: Vec<String> = std::fs::read_dir(settle_testkit::root().join("crates"))
        .expect("read crates/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    for member in &members {
        let Some((_, ok)) = allowed.iter().find(|(k, _)| k == member) else {
            panic!("crates/{member} is not in this test's table: say what it may depend on");
        };
        for dep in our_dependencies(member) {
            assert!(
                ok.contains(&dep.as_str()),
                "crates/{member} depends on {dep}, against the house order (it may use {ok:?})"
            );
        }
    }
    assert_eq!(
        our_dependencies("settle-operator"),
        ["settle", "settle-import"]
    );
}

/// What an application that links `settle` compiles: `cargo tree` of its normal dependencies
/// with the default features.
fn library_tree(features: &[&str]) -> String {
    tree_of("settle", features)
}

/// `cargo tree` of a member's normal dependencies, one crate a line.
fn tree_of(package: &str, features: &[&str]) -> String {
    let mut cmd = std::process::Command::new(env!("CARGO"));
    cmd.current_dir(settle_testkit::root()).args([
        "tree",
        "--locked",
        "--offline",
        "-p",
        package,
        "-e",
        "normal",
        "--prefix",
        "none",
    ]);
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    let out = cmd.output().expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_library_carries_nothing_only_the_operator_needs() {
    let names = |tree: &str| -> std::collections::BTreeSet<String> {
        tree.lines()
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_string)
            .collect()
    };
    let plain = names(&library_tree(&[]));
    for crate_name in [
        "clap",
        "tracing-subscriber",
        "kube-runtime",
        "kube-client",
        "rcgen",
        "x509-parser",
        "hyper-util",
        "aws-sdk-sqs",
        "aws-config",
        "settle-operator",
    ] {
        assert!(
            !plain.contains(crate_name),
            "an application linking `settle` compiles {crate_name}"
        );
    }
    // The example applications (crates/settle-examples) link the library and what an application
    // itself uses, nothing of the operator.
    let examples = names(&tree_of("settle-examples", &[]));
    for crate_name in [
        "settle-operator",
        "kube-runtime",
        "clap",
        "rcgen",
        "x509-parser",
    ] {
        assert!(
            !examples.contains(crate_name),
            "the example applications compile {crate_name}"
        );
    }
    println!(
        "crates an application compiles: settle {}, settle with sqs {}, the example applications {}",
        plain.len(),
        names(&library_tree(&["sqs"])).len(),
        examples.len()
    );
    // The grep reads what it should: the features bring in what they say.
    assert!(names(&library_tree(&["sqs"])).contains("aws-sdk-sqs"));
    assert!(names(&library_tree(&["admin"])).contains("kube-runtime"));
}

/// What the files beside a folder's `mod.rs` use of each other: sibling → the siblings it names.
/// `mod.rs` itself is the parent (its vocabulary, such as reconcile's `Ctx`, may be used by all).
fn sibling_imports(src: &Path, dir: &Path) -> std::collections::BTreeMap<String, Vec<String>> {
    let module = dir
        .strip_prefix(src)
        .expect("under src")
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .collect::<Vec<_>>()
        .join("::");
    let mut siblings = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("dir entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .trim_end_matches(".rs")
            .to_string();
        if name == "mod" || !(path.is_dir() || path.extension().is_some_and(|e| e == "rs")) {
            continue;
        }
        let mut files = Vec::new();
        if path.is_dir() {
            rust_files(&path, &mut files);
        } else {
            files.push(path.clone());
        }
        siblings.insert(name, files);
    }
    let names: Vec<String> = siblings.keys().cloned().collect();
    let mut uses = std::collections::BTreeMap::new();
    for (name, files) in &siblings {
        let mut used = Vec::new();
        for file in files {
            // How deep the file's module sits below `dir`: `s.rs` and `s/mod.rs` are 1, `s/x.rs` 2.
            let rel = file.strip_prefix(dir).expect("under dir");
            let mut depth = rel.components().count();
            if rel.file_name().is_some_and(|n| n == "mod.rs") {
                depth -= 1;
            }
            let text = std::fs::read_to_string(file).expect("read file");
            let mut found = paths_after(&text, &"super::".repeat(depth));
            if !module.is_empty() {
                found.extend(paths_after(&text, &format!("crate::{module}::")));
            }
            used.extend(
                found
                    .into_iter()
                    .map(|(_, n)| n)
                    .filter(|n| n != name && names.contains(n)),
            );
        }
        used.sort();
        used.dedup();
        uses.insert(name.clone(), used);
    }
    uses
}

/// A circle in `uses`, if there is one, as the names around it.
fn circle(uses: &std::collections::BTreeMap<String, Vec<String>>) -> Option<Vec<String>> {
    fn visit(
        at: &str,
        uses: &std::collections::BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(k) = path.iter().position(|p| p == at) {
            let mut c = path[k..].to_vec();
            c.push(at.to_string());
            return Some(c);
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.to_string());
        for next in uses.get(at).into_iter().flatten() {
            if let Some(c) = visit(next, uses, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(at.to_string());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    uses.keys()
        .find_map(|k| visit(k, uses, &mut Vec::new(), &mut done))
}

/// Inside every folder of `src/`, the files beside `mod.rs` use each other in no circle: a step
/// does not call back up into the pipeline that runs it (as `reconcile/nats.rs` once imported
/// `publish` from `reconcile/subscription.rs`, which calls it), and the webhook's parts do not
/// lean on each other both ways.
#[test]
fn no_folder_has_an_import_circle_among_its_files() {
    let mut folders = 0;
    let mut edges = 0;
    let mut circles = Vec::new();
    for house in HOUSES {
        let (f, e, c) = circles_in(&src_of(house.krate));
        folders += f;
        edges += e;
        circles.extend(c.into_iter().map(|c| format!("crates/{}/{c}", house.krate)));
    }
    let src = src_of("settle-operator");
    let reconcile = sibling_imports(&src, &src.join("reconcile"));
    assert!(
        reconcile["subscription"].contains(&"nats".to_string())
            && reconcile["nats"].contains(&"step".to_string()),
        "the grep must see the pipeline use its steps and a step use step.rs: {reconcile:?}"
    );
    assert!(
        folders >= 10 && edges >= 30,
        "{folders} folders, {edges} uses"
    );
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

/// The folders under `src` (those with a `mod.rs`), the uses among their files, and the circles.
fn circles_in(src: &Path) -> (usize, usize, Vec<String>) {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut folders: Vec<_> = files
        .iter()
        .filter(|f| f.file_name().is_some_and(|n| n == "mod.rs"))
        .filter_map(|f| f.parent().map(Path::to_path_buf))
        .collect();
    folders.sort();
    let mut edges = 0;
    let mut circles = Vec::new();
    for dir in &folders {
        let uses = sibling_imports(src, dir);
        edges += uses.values().map(Vec::len).sum::<usize>();
        if let Some(c) = circle(&uses) {
            circles.push(format!(
                "src/{}: {}",
                dir.strip_prefix(src).expect("under src").display(),
                c.join(" → ")
            ));
        }
    }
    (folders.len(), edges, circles)
}

#[test]
fn the_circle_check_finds_a_circle_and_reads_nested_paths() {
    let uses = std::collections::BTreeMap::from([
        ("a".to_string(), vec!["b".to_string()]),
        ("b".to_string(), vec!["c".to_string()]),
        ("c".to_string(), vec!["a".to_string()]),
        ("d".to_string(), vec![]),
    ]);
    assert_eq!(
        circle(&uses),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    let code = "use super::super::x::Y;\nuse super::{step::T, status};\nlet z = crate::reconcile::nats::f();";
    let names = |prefix| -> Vec<String> {
        paths_after(code, prefix)
            .into_iter()
            .map(|(_, n)| n)
            .collect()
    };
    assert_eq!(names("super::"), ["step", "status"]);
    assert_eq!(names("super::super::"), ["x"]);
    assert_eq!(names("crate::reconcile::"), ["nats"]);
}

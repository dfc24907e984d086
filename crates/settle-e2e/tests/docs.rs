//! The documentation holds together: every relative link and image in README.md,
//! ARCHITECTURE.md, each crate's README.md and every page under docs/ resolves to a file (and,
//! with `#anchor`, to a heading of that page), and README.md stays a short front door with the
//! install near its top. Files only: no environment.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use settle_testkit::root;

/// The pages whose links are checked: README.md, ARCHITECTURE.md, crates/*/README.md and every
/// docs/**/*.md.
fn pages() -> Vec<PathBuf> {
    let root = root();
    let mut pages = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    let mut crates: Vec<PathBuf> = fs::read_dir(root.join("crates"))
        .expect("crates/")
        .filter_map(|e| e.ok().map(|e| e.path().join("README.md")))
        .filter(|p| p.is_file())
        .collect();
    crates.sort();
    pages.extend(crates);
    let mut docs = Vec::new();
    markdown_under(&root.join("docs"), &mut docs);
    docs.sort();
    pages.extend(docs);
    pages
}

fn markdown_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            markdown_under(&path, out);
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
}

/// The text outside fenced code blocks and inline code, line by line (links in code are not
/// links).
fn prose_lines(text: &str) -> Vec<(usize, String)> {
    let mut lines = Vec::new();
    let mut fence: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(marker) = &fence {
            if trimmed.starts_with(marker.as_str()) {
                fence = None;
            }
            continue;
        }
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            let marker: String = trimmed
                .chars()
                .take_while(|c| *c == '`' || *c == '~')
                .collect();
            fence = Some(marker);
            continue;
        }
        lines.push((i + 1, strip_inline_code(line)));
    }
    lines
}

fn strip_inline_code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else if !in_code {
            out.push(c);
        } else {
            out.push(' ');
        }
    }
    out
}

/// Every `[text](target)` and `![alt](target)` of a line: the targets.
fn link_targets(line: &str) -> Vec<String> {
    let bytes = line.as_bytes();
    let mut targets = Vec::new();
    let mut i = 0;
    while i + 1 < bytes.len() {
        if bytes[i] == b']' && bytes[i + 1] == b'(' {
            let start = i + 2;
            let mut depth = 0;
            let mut end = None;
            for (j, b) in bytes.iter().enumerate().skip(start) {
                match b {
                    b'(' => depth += 1,
                    b')' if depth == 0 => {
                        end = Some(j);
                        break;
                    }
                    b')' => depth -= 1,
                    _ => {}
                }
            }
            if let Some(end) = end {
                let raw = line[start..end].trim();
                // A title after the target: [text](path "title").
                let target = raw.split_whitespace().next().unwrap_or("");
                let target = target.trim_start_matches('<').trim_end_matches('>');
                if !target.is_empty() {
                    targets.push(target.to_string());
                }
                i = end;
            }
        }
        i += 1;
    }
    targets
}

/// GitHub's anchor for a heading: lower case, punctuation dropped (but `-` and `_`), spaces
/// as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors a page offers: its headings' slugs (repeats numbered as GitHub does) and
/// explicit `<a id=...>` / `<a name=...>`.
fn anchors(text: &str) -> HashSet<String> {
    let mut set = HashSet::new();
    let mut fence = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = !fence;
            continue;
        }
        if !fence && trimmed.starts_with('#') {
            let title = trimmed.trim_start_matches('#');
            if title.starts_with(' ') || title.is_empty() {
                let base = slug(&title.replace('`', ""));
                let mut candidate = base.clone();
                let mut n = 0;
                while set.contains(&candidate) {
                    n += 1;
                    candidate = format!("{base}-{n}");
                }
                set.insert(candidate);
            }
        }
        for key in ["id=\"", "name=\""] {
            let mut rest = line;
            while let Some(pos) = rest.find(key) {
                let after = &rest[pos + key.len()..];
                if let Some(end) = after.find('"') {
                    set.insert(after[..end].to_string());
                }
                rest = after;
            }
        }
    }
    set
}

#[test]
fn every_link_in_the_docs_resolves() {
    let root = root();
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let here = page
            .strip_prefix(&root)
            .unwrap_or(&page)
            .display()
            .to_string();
        let text = match fs::read_to_string(&page) {
            Ok(text) => text,
            Err(e) => {
                broken.push(format!("{here}: cannot read it: {e}"));
                continue;
            }
        };
        let own_anchors = anchors(&text);
        for (line_no, line) in prose_lines(&text) {
            for target in link_targets(&line) {
                if target.starts_with("http://")
                    || target.starts_with("https://")
                    || target.starts_with("mailto:")
                {
                    continue;
                }
                checked += 1;
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target.as_str(), None),
                };
                if path.is_empty() {
                    let anchor = anchor.unwrap_or("");
                    if !own_anchors.contains(anchor) {
                        broken.push(format!(
                            "{here}:{line_no}: ({target}): no heading #{anchor} on this page"
                        ));
                    }
                    continue;
                }
                let resolved = page.parent().expect("a page's directory").join(path);
                if !resolved.exists() {
                    broken.push(format!(
                        "{here}:{line_no}: ({target}): no file {}",
                        resolved.display()
                    ));
                    continue;
                }
                if let Some(anchor) = anchor
                    && resolved.extension().is_some_and(|e| e == "md")
                    && resolved.is_file()
                {
                    let other = fs::read_to_string(&resolved).unwrap_or_default();
                    if !anchors(&other).contains(anchor) {
                        broken.push(format!(
                            "{here}:{line_no}: ({target}): {path} has no heading #{anchor}"
                        ));
                    }
                }
            }
        }
    }
    assert!(checked > 0, "no links found: the pages moved?");
    assert!(
        broken.is_empty(),
        "{} broken link(s):\n{}",
        broken.len(),
        broken.join("\n")
    );
}

#[test]
fn the_readme_is_a_short_front_door_with_the_install_near_its_top() {
    let readme = fs::read_to_string(root().join("README.md")).expect("README.md");
    let lines: Vec<&str> = readme.lines().collect();
    assert!(
        lines.len() <= 200,
        "README.md has {} lines; keep it at most 200 and move detail to docs/",
        lines.len()
    );
    let install = lines.iter().position(|l| l.contains("helm install"));
    match install {
        Some(i) => assert!(
            i < 60,
            "README.md says `helm install` first on line {}; bring it within the first 60",
            i + 1
        ),
        None => panic!("README.md does not say `helm install`"),
    }
}

#[test]
fn the_slug_of_a_heading_is_githubs() {
    assert_eq!(slug("Install with Helm"), "install-with-helm");
    assert_eq!(
        slug("`kubectl settle`: the account from the command line"),
        "kubectl-settle-the-account-from-the-command-line"
    );
    assert_eq!(
        slug("The cost curve: Settle at 1,000, 3,000 and 10,000 Subscriptions"),
        "the-cost-curve-settle-at-1000-3000-and-10000-subscriptions"
    );
    let a = anchors("# A\n## A\n```\n# not a heading\n```\n<a id=\"R1\"></a>\n");
    assert!(
        a.contains("a") && a.contains("a-1") && a.contains("R1") && !a.contains("not-a-heading")
    );
    assert_eq!(
        link_targets("see [x](a.md#b) and ![y](img/c.svg \"t\")"),
        vec!["a.md#b", "img/c.svg"]
    );
}

/// The benchmark page's charts are what `hack/charts.py` makes of their data files
/// (docs/img/*.tsv): a figure changed in a data file, or an SVG edited by hand, fails here until
/// `python3 hack/charts.py` writes them again.
#[test]
fn the_benchmark_charts_are_what_the_script_makes_of_their_data() {
    let out = std::process::Command::new("python3")
        .arg("hack/charts.py")
        .arg("--check")
        .current_dir(settle_testkit::root())
        .output()
        .expect("run python3 hack/charts.py --check");
    assert!(
        out.status.success(),
        "the charts differ from their data: run `python3 hack/charts.py`\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

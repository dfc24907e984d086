//! The linker script that places the functions of `link/hot-functions.txt` first (build.rs):
//! pure text in, text out, so `tests/hot_text.rs` pins it without a link.

use std::fmt::Write as _;

/// The linker script: each function by its own name first (only LTO's numeric suffix left
/// open), so what ran is together; then, for a build whose names have moved since the profile
/// (its crate hashes change with the dependencies, the version, the toolchain), the same names
/// with what differs between builds left open, which also places the other instantiations of a
/// generic function there. A function's section is `.text.<name>`, or `.text.unlikely.<name>`
/// where LLVM judged it cold.
pub fn linker_script(names: &str) -> String {
    let names: Vec<&str> = names
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut script = String::from("SECTIONS {\n  .text.hot : {\n");
    for pattern in names
        .iter()
        .map(|n| format!("{}*", unsuffixed(n)))
        .chain(names.iter().map(|n| loose(n)))
    {
        if pattern.contains(|c: char| "?[]\\ ()\"{};,".contains(c)) || !seen.insert(pattern.clone())
        {
            continue;
        }
        let _ = writeln!(script, "    *(.text.{pattern} .text.unlikely.{pattern})");
    }
    script.push_str("  }\n} INSERT BEFORE .text;\n");
    script
}

/// `name` without the numeric suffix LTO gives a local copy (`.123`, `.llvm.123`).
pub fn unsuffixed(name: &str) -> &str {
    let Some((head, tail)) = name.rsplit_once('.') else {
        return name;
    };
    if tail.is_empty() || !tail.bytes().all(|b| b.is_ascii_digit()) {
        return name;
    }
    head.strip_suffix(".llvm").unwrap_or(head)
}

/// `name` as a pattern with what differs between builds of the same code left open: a legacy
/// symbol's hash (`17h<16 hex>E`), and in a v0 symbol each crate disambiguator (`Cs<base62>_`)
/// and back-reference (`B<base62>_`), whose positions move with the disambiguators' lengths.
pub fn loose(name: &str) -> String {
    let name = unsuffixed(name);
    let mut out = String::with_capacity(name.len() + 1);
    if name.starts_with("_ZN") {
        out.push_str(legacy_unhashed(name));
    } else if name.starts_with("_R") {
        let b = name.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let tag = if b[i..].starts_with(b"Cs") {
                2
            } else if b[i] == b'B' {
                1
            } else {
                0
            };
            if tag > 0 {
                let digits = b[i + tag..]
                    .iter()
                    .take_while(|c| c.is_ascii_alphanumeric())
                    .count();
                let end = i + tag + digits;
                if end < b.len() && b[end] == b'_' && (digits > 0 || tag == 1) {
                    out.push_str(&name[i..i + tag]);
                    out.push_str("*_");
                    i = end + 1;
                    continue;
                }
            }
            out.push(char::from(b[i]));
            i += 1;
        }
    } else {
        out.push_str(name);
    }
    if !out.ends_with('*') {
        out.push('*');
    }
    out
}

/// A legacy symbol without its hash: `_ZN...17h<16 hex>E` as `_ZN...17h` (the pattern then
/// ends `17h*`); a name without one as it is.
fn legacy_unhashed(name: &str) -> &str {
    let Some(start) = name.len().checked_sub(20) else {
        return name;
    };
    let hashed = name
        .get(start..)
        .and_then(|t| t.strip_prefix("17h"))
        .and_then(|t| t.strip_suffix('E'))
        .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
    if hashed { &name[..start + 3] } else { name }
}

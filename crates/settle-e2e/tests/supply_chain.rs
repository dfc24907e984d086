//! What `make lint` says of the crates Settle depends on (hack/crates.py): every crate Cargo.lock
//! resolves for this machine comes from crates.io or this workspace, under a license
//! hack/licenses.txt accepts, and one that does not is named with what to do.
//!
//! Needs no environment (cargo's offline metadata and python3).

use settle_testkit as common;

use std::process::{Command, Output};

fn check(metadata: Option<&std::path::Path>) -> Output {
    let mut cmd = Command::new("python3");
    cmd.arg(common::root().join("hack/crates.py"));
    if let Some(m) = metadata {
        cmd.arg("--metadata").arg(m);
    }
    cmd.output().expect("python3 runs hack/crates.py")
}

#[test]
fn every_crate_of_the_workspace_is_from_crates_io_or_here_under_an_accepted_license() {
    let out = check(None);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("each under an accepted license"), "{said}");
}

#[test]
fn a_crate_under_a_license_not_accepted_from_git_or_with_no_expression_is_named() {
    let crates_io = "registry+https://github.com/rust-lang/crates.io-index";
    let packages = serde_json::json!({"packages": [
        {"name": "gpl-thing", "version": "1.0.0", "license": "GPL-3.0-only", "source": crates_io},
        {"name": "forked", "version": "0.1.0", "license": "MIT",
         "source": "git+https://example.com/forked?rev=abc#abc"},
        {"name": "file-only", "version": "2.0.0", "license": null, "license_file": "LICENSE",
         "source": crates_io},
        {"name": "both", "version": "1.0.0", "license": "MIT AND GPL-2.0-only", "source": crates_io},
        {"name": "garbled", "version": "1.0.0", "license": "MIT OR (Apache-2.0", "source": crates_io},
        {"name": "either", "version": "1.0.0", "license": "GPL-3.0-only OR MIT", "source": crates_io},
        {"name": "llvm", "version": "1.0.0", "license": "Apache-2.0 WITH LLVM-exception",
         "source": crates_io},
        {"name": "old-style", "version": "1.0.0", "license": "MIT/Apache-2.0", "source": crates_io},
        {"name": "nested", "version": "1.0.0", "license": "(MIT OR Apache-2.0) AND Unicode-3.0",
         "source": crates_io},
        {"name": "here", "version": "0.1.0", "license": "Apache-2.0", "source": null},
    ]});
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("metadata.json");
    std::fs::write(&file, packages.to_string()).expect("write");
    let out = check(Some(&file));
    assert!(!out.status.success(), "refused");
    let said = String::from_utf8_lossy(&out.stderr);
    for (who, why) in [
        ("gpl-thing 1.0.0", "is not accepted"),
        ("forked 0.1.0", "not crates.io or this workspace"),
        (
            "file-only 2.0.0",
            "add `crate file-only 2.0.0` to hack/licenses.txt",
        ),
        ("both 1.0.0", "is not accepted"),
        ("garbled 1.0.0", "parentheses"),
    ] {
        assert!(
            said.lines().any(|l| l.contains(who) && l.contains(why)),
            "{who}: {why}\n{said}"
        );
    }
    for fine in ["either", "llvm", "old-style", "nested", "here"] {
        assert!(
            !said.contains(&format!("crates: {fine} ")),
            "{fine} passes\n{said}"
        );
    }
}

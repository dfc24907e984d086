//! The images `make image` builds without a container engine (hack/image.sh): reproducible (two
//! builds of one commit are the same bytes), the operator image the same as the Dockerfile's
//! (user, entrypoint, command, ports, files) and as the chart expects (its ports, its default
//! image reference), holding everything its binary needs (the binary runs on the image's own
//! libraries, as the nonroot user), and saying what went in (version, commit, the Debian
//! packages its files came from, and a bill of materials of every crate the binary links). The
//! example application's image likewise.
//!
//! Needs no environment; builds the release binaries when they are missing (`make test` has run
//! `make image` before).

use settle_testkit as common;

use common::image::{ImageArchive, TarEntry, build_image_into, image_archive, sha256_digest};
use common::root;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn settle() -> ImageArchive {
    ImageArchive::open(&image_archive("settle"))
}

fn example() -> ImageArchive {
    ImageArchive::open(&image_archive("example"))
}

fn entries_by_path(image: &ImageArchive) -> BTreeMap<String, TarEntry> {
    image
        .layer_entries()
        .into_iter()
        .map(|e| (format!("/{}", e.path), e))
        .collect()
}

/// `version = "…"` of Cargo.toml's package.
fn cargo_version() -> String {
    read("Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("Cargo.toml has a version")
        .to_string()
}

fn chart_app_version() -> String {
    read("charts/settle/Chart.yaml")
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .map(|v| v.trim().trim_matches('"').to_string())
        .expect("Chart.yaml has an appVersion")
}

/// The Dockerfile's instructions (continuation lines joined, comments dropped), per stage.
fn dockerfile_stages() -> Vec<Vec<(String, String)>> {
    let text = read("Dockerfile").replace("\\\n", " ");
    let mut stages: Vec<Vec<(String, String)>> = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (op, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let op = op.to_ascii_uppercase();
        if op == "FROM" {
            stages.push(Vec::new());
        }
        stages
            .last_mut()
            .expect("the Dockerfile starts with FROM")
            .push((op, rest.trim().to_string()));
    }
    stages
}

fn last<'a>(stage: &'a [(String, String)], op: &str) -> &'a str {
    stage
        .iter()
        .rev()
        .find(|(o, _)| o == op)
        .map(|(_, rest)| rest.as_str())
        .unwrap_or_else(|| panic!("the Dockerfile's final stage has no {op}"))
}

fn json_list(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{text} is not the exec (JSON) form: {e}"))
}

/// `COPY [--from=…] SRC… DEST` of a stage: (sources, destination).
fn copies(stage: &[(String, String)]) -> Vec<(Vec<String>, String)> {
    stage
        .iter()
        .filter(|(op, _)| op == "COPY")
        .map(|(_, rest)| {
            let mut words: Vec<String> = rest
                .split_whitespace()
                .filter(|w| !w.starts_with("--"))
                .map(str::to_string)
                .collect();
            let dest = words.pop().expect("COPY has a destination");
            (words, dest)
        })
        .collect()
}

#[test]
fn two_builds_of_one_commit_are_the_same_image_byte_for_byte() {
    let (a, b) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let first = build_image_into("settle", a.path(), None, &[]);
    let second = build_image_into("settle", b.path(), None, &[]);
    let read = |p: &Path| std::fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
    let (x, y) = (ImageArchive::open(&first), ImageArchive::open(&second));
    assert_eq!(
        x.manifest_digest, y.manifest_digest,
        "the same manifest digest twice"
    );
    assert_eq!(
        sha256_digest(&read(&first)),
        sha256_digest(&read(&second)),
        "the same archive bytes"
    );
    // The digest file beside the archive says the same, as `hack/image.sh digest` prints it.
    let digest_file = format!("{}.digest", first.display());
    assert_eq!(
        std::fs::read_to_string(&digest_file)
            .expect("digest file")
            .trim(),
        x.manifest_digest
    );
    // And the default place (`make image`'s) holds that very image.
    assert_eq!(
        settle().manifest_digest,
        x.manifest_digest,
        "make image's archive is the same image"
    );
}

#[test]
fn another_tag_names_the_same_manifest_and_a_label_makes_another_digest() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tagged = ImageArchive::open(&build_image_into("settle", dir.path(), Some("next"), &[]));
    let relabelled = ImageArchive::open(&build_image_into(
        "settle",
        dir.path(),
        Some("upgraded"),
        &["dev.settle.test=upgrade"],
    ));
    let default = settle();
    assert_eq!(tagged.reference(), "ghcr.io/settle-dev/settle:next");
    assert_eq!(
        tagged.index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
        "next"
    );
    assert_eq!(
        tagged.manifest_digest, default.manifest_digest,
        "a tag is only a name: the same image"
    );
    assert!(
        tagged.path.ends_with("settle-next.oci.tar"),
        "the archive is named by its tag: {}",
        tagged.path.display()
    );
    assert_eq!(relabelled.reference(), "ghcr.io/settle-dev/settle:upgraded");
    assert_eq!(
        relabelled.label("dev.settle.test").as_deref(),
        Some("upgrade")
    );
    assert_ne!(
        relabelled.manifest_digest, default.manifest_digest,
        "a new label is a new image"
    );
    assert_eq!(
        relabelled.manifest["layers"], default.manifest["layers"],
        "with the very same layer"
    );
}

#[test]
fn the_image_runs_as_the_dockerfile_says_with_the_files_it_copies() {
    let stages = dockerfile_stages();
    let final_stage = stages.last().expect("a stage");
    let image = settle();
    let config = &image.config["config"];
    assert_eq!(config["User"], last(final_stage, "USER"), "USER");
    assert_eq!(
        config["Entrypoint"],
        json_list(last(final_stage, "ENTRYPOINT")),
        "ENTRYPOINT"
    );
    assert_eq!(config["Cmd"], json_list(last(final_stage, "CMD")), "CMD");
    let exposed: BTreeSet<String> = final_stage
        .iter()
        .filter(|(op, _)| op == "EXPOSE")
        .flat_map(|(_, rest)| rest.split_whitespace())
        .map(|p| {
            if p.contains('/') {
                p.to_string()
            } else {
                format!("{p}/tcp")
            }
        })
        .collect();
    let in_image: BTreeSet<String> = config["ExposedPorts"]
        .as_object()
        .expect("ExposedPorts")
        .keys()
        .cloned()
        .collect();
    assert_eq!(in_image, exposed, "EXPOSE");
    assert_eq!(
        last(final_stage, "FROM"),
        "gcr.io/distroless/cc-debian12:nonroot",
        "the base whose files hack/image.sh assembles"
    );
    let entries = entries_by_path(&image);
    let copied = copies(final_stage);
    assert!(!copied.is_empty(), "the final stage copies the binary");
    for (_, dest) in copied {
        let entry = entries
            .get(&dest)
            .unwrap_or_else(|| panic!("the Dockerfile copies {dest}; the image has no such file"));
        assert_eq!(entry.kind, b'0', "{dest} is a file");
    }
}

#[test]
fn the_image_exposes_every_port_the_chart_listens_on_and_is_what_the_chart_runs() {
    // Every containerPort of the chart's Deployment is `{{ .Values.<key>.port }}`; values.yaml
    // gives each its default.
    let template = read("charts/settle/templates/deployment.yaml");
    let keys: Vec<&str> = template
        .split("containerPort: {{ .Values.")
        .skip(1)
        .map(|rest| rest.split(".port }}").next().expect("a .port value"))
        .collect();
    assert!(
        keys.len() >= 3,
        "webhook, metrics and probe ports: {keys:?}"
    );
    let values = read("charts/settle/values.yaml");
    let port_of = |key: &str| -> String {
        let block = values
            .split(&format!("\n{key}:\n"))
            .nth(1)
            .unwrap_or_else(|| panic!("values.yaml has no {key}:"));
        block
            .lines()
            .take_while(|l| l.starts_with(' ') || l.is_empty())
            .find_map(|l| l.strip_prefix("  port:"))
            .map(|p| format!("{}/tcp", p.split('#').next().unwrap_or("").trim()))
            .unwrap_or_else(|| panic!("values.yaml has no {key}.port"))
    };
    let chart: BTreeSet<String> = keys.iter().map(|k| port_of(k)).collect();
    let image = settle();
    let exposed: BTreeSet<String> = image.config["config"]["ExposedPorts"]
        .as_object()
        .expect("ExposedPorts")
        .keys()
        .cloned()
        .collect();
    assert_eq!(
        exposed, chart,
        "the image exposes exactly the chart's ports"
    );

    // `helm install` with default values runs ghcr.io/settle-dev/settle:<appVersion>, and the
    // kustomize base names the same.
    let repository = values
        .lines()
        .find_map(|l| l.trim().strip_prefix("repository:"))
        .expect("image.repository in values.yaml")
        .split('#')
        .next()
        .unwrap_or("")
        .trim()
        .to_string();
    let chart_ref = format!("{repository}:{}", chart_app_version());
    assert_eq!(
        image.reference(),
        chart_ref,
        "the archive names the chart's default image"
    );
    assert!(
        read("config/manager/deployment.yaml").contains(&format!("image: {chart_ref}")),
        "config/manager runs {chart_ref} too"
    );
}

#[test]
fn the_dockerfile_build_stage_has_every_file_cargo_toml_names() {
    // The workspace's manifest names its members (crates/*), and each member's manifest names
    // its test and bench targets: without their files the manifest does not parse and
    // `docker build` stops at `cargo build`. settle-operator's build.rs and what it reads lay the
    // operator's code out: without them the image's binary would build, laid out otherwise.
    let mut needed = BTreeSet::from(["Cargo.toml".to_string(), "Cargo.lock".to_string()]);
    assert!(
        read("Cargo.toml").contains("members = [\"crates/*\"]"),
        "the workspace's members are crates/*"
    );
    for member in std::fs::read_dir(root().join("crates")).expect("read crates/") {
        let member = member.expect("entry").path();
        let name = member.file_name().and_then(|n| n.to_str()).expect("a name");
        for file in ["Cargo.toml", "src"] {
            needed.insert(format!("crates/{name}/{file}"));
        }
        let manifest = std::fs::read_to_string(member.join("Cargo.toml")).expect("a manifest");
        let mut section = "";
        for line in manifest.lines() {
            if line.starts_with('[') {
                section = line.trim();
            } else if let Some(target) = line
                .strip_prefix("name = \"")
                .and_then(|n| n.strip_suffix('"'))
            {
                match section {
                    "[[test]]" => needed.insert(format!("crates/{name}/tests/{target}.rs")),
                    "[[bench]]" => needed.insert(format!("crates/{name}/benches/{target}.rs")),
                    _ => false,
                };
            }
        }
    }
    for file in ["build.rs", "link/layout.rs", "link/hot-functions.txt"] {
        needed.insert(format!("crates/settle-operator/{file}"));
    }
    let stages = dockerfile_stages();
    let sources: Vec<String> = copies(&stages[0])
        .into_iter()
        .flat_map(|(src, _)| src)
        .collect();
    for file in &needed {
        assert!(
            sources
                .iter()
                .any(|s| file == s || file.starts_with(&format!("{}/", s.trim_end_matches('/')))),
            "the build stage does not COPY {file}, which the workspace needs (COPY sources: {sources:?})"
        );
    }
    assert!(
        needed.iter().any(|f| f.contains("/benches/")),
        "the members name bench targets: {needed:?}"
    );
}

#[test]
fn the_layer_holds_the_binary_its_libraries_ca_certificates_and_users() {
    let image = settle();
    let entries = entries_by_path(&image);
    let file = |path: &str| -> &TarEntry {
        let e = entries
            .get(path)
            .unwrap_or_else(|| panic!("the image has no {path}"));
        assert_eq!(e.kind, b'0', "{path} is a regular file");
        e
    };
    let binary = file("/usr/local/bin/settle");
    assert_eq!(binary.mode, 0o755, "the binary is executable by everyone");
    assert!(
        binary.data.starts_with(b"\x7fELF"),
        "the binary is an ELF file"
    );
    // Laid out by build.rs: the functions the operator runs in `.text.hot`, before the rest.
    let sections = elf_sections(&binary.data);
    let hot = sections.iter().find(|(n, _, _)| n == ".text.hot");
    let text = sections.iter().find(|(n, _, _)| n == ".text");
    match (hot, text) {
        (Some((_, hot_at, hot_size)), Some((_, text_at, _))) => {
            assert!(*hot_size > 1 << 20, ".text.hot holds {hot_size} bytes");
            assert!(hot_at < text_at, ".text.hot is placed before .text");
        }
        _ => panic!(
            "the shipped binary has no .text.hot before .text (build.rs, link/hot-functions.txt): {:?}",
            sections.iter().map(|(n, _, _)| n).collect::<Vec<_>>()
        ),
    }
    file("/lib64/ld-linux-x86-64.so.2");
    file("/lib/x86_64-linux-gnu/libc.so.6");

    // Every library ldd names for this very binary (the loader included), at that path.
    let dir = tempfile::tempdir().expect("tempdir");
    let copy = dir.path().join("settle");
    std::fs::write(&copy, &binary.data).expect("write the binary");
    let ldd = Command::new("ldd").arg(&copy).output().expect("ldd runs");
    assert!(
        ldd.status.success(),
        "ldd: {}",
        String::from_utf8_lossy(&ldd.stderr)
    );
    let ldd = String::from_utf8_lossy(&ldd.stdout);
    let libs: Vec<&str> = ldd
        .lines()
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            match words.as_slice() {
                [_, "=>", path, ..] if path.starts_with('/') => Some(*path),
                [path, ..] if path.starts_with('/') => Some(*path),
                _ => None,
            }
        })
        .collect();
    assert!(
        libs.iter().any(|l| l.ends_with("/libc.so.6")),
        "ldd names libc: {ldd}"
    );
    for lib in &libs {
        let e = file(lib);
        let host = std::fs::read(lib).unwrap_or_else(|e| panic!("read {lib}: {e}"));
        assert!(
            e.data == host,
            "{lib} in the image is this machine's {lib} (copied through symlinks)"
        );
    }

    let certs =
        String::from_utf8_lossy(&file("/etc/ssl/certs/ca-certificates.crt").data).into_owned();
    let count = certs.matches("-----BEGIN CERTIFICATE-----").count();
    assert!(
        count >= 100,
        "Debian's CA bundle holds well over 100 roots, the image {count}"
    );
    // Only the package's roots: never what this machine added to its own trust store.
    if let Ok(local) = std::fs::read_dir("/usr/local/share/ca-certificates") {
        for crt in local.flatten() {
            let pem = std::fs::read_to_string(crt.path()).unwrap_or_default();
            let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
            let image_bodies: String = certs.lines().filter(|l| !l.starts_with("-----")).collect();
            assert!(
                body.is_empty() || !image_bodies.contains(&body),
                "the image trusts this machine's local CA {}",
                crt.path().display()
            );
        }
    }

    let passwd = String::from_utf8_lossy(&file("/etc/passwd").data).into_owned();
    assert!(
        passwd.lines().any(|l| l.starts_with("root:x:0:0:")),
        "{passwd}"
    );
    assert!(
        passwd
            .lines()
            .any(|l| l.starts_with("nonroot:x:65532:65532:") && l.contains(":/home/nonroot:")),
        "{passwd}"
    );
    let group = String::from_utf8_lossy(&file("/etc/group").data).into_owned();
    assert!(group.lines().any(|l| l == "root:x:0:"), "{group}");
    assert!(group.lines().any(|l| l == "nonroot:x:65532:"), "{group}");

    let tmp = entries.get("/tmp").expect("/tmp");
    assert_eq!(
        (tmp.kind, tmp.mode, tmp.uid),
        (b'5', 0o1777, 0),
        "/tmp is a sticky, world-writable directory"
    );
    let home = entries.get("/home/nonroot").expect("/home/nonroot");
    assert_eq!(
        (home.kind, home.mode, home.uid, home.gid),
        (b'5', 0o700, 65532, 65532),
        "nonroot's home is its own"
    );
}

#[test]
fn every_entry_is_root_owned_dated_to_the_commit_and_sorted() {
    let image = settle();
    let created = image.config["created"]
        .as_str()
        .expect("created")
        .to_string();
    let entries = image.layer_entries();
    let epoch = entries[0].mtime;
    let commit_time = Command::new("git")
        .args(["log", "-1", "--format=%ct"])
        .current_dir(root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<u64>()
                .ok()
        });
    if std::env::var_os("SOURCE_DATE_EPOCH").is_none() {
        assert_eq!(Some(epoch), commit_time, "every mtime is the commit's time");
    }
    let date = Command::new("date")
        .args(["-u", "-d", &format!("@{epoch}"), "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .expect("date");
    assert_eq!(
        String::from_utf8_lossy(&date.stdout).trim(),
        created,
        "the config's created time is the same instant"
    );
    let mut previous: Vec<String> = Vec::new();
    for e in &entries {
        assert_eq!(e.mtime, epoch, "{} has the one mtime", e.path);
        if e.path != "home/nonroot" {
            assert_eq!((e.uid, e.gid), (0, 0), "{} belongs to root", e.path);
        }
        let parts: Vec<String> = e.path.split('/').map(str::to_string).collect();
        assert!(
            parts > previous,
            "{} comes after {} (sorted by path)",
            e.path,
            previous.join("/")
        );
        previous = parts;
        if e.kind == b'0' {
            assert!(
                e.mode == 0o644 || e.mode == 0o755,
                "{} has mode {:o}",
                e.path,
                e.mode
            );
        }
    }
}

#[test]
fn the_labels_say_the_version_commit_and_debian_packages_that_went_in() {
    let image = settle();
    let label = |k: &str| {
        image
            .label(k)
            .unwrap_or_else(|| panic!("label {k} in {}", image.config["config"]["Labels"]))
    };
    assert_eq!(label("org.opencontainers.image.version"), cargo_version());
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(root())
        .output()
        .expect("git");
    assert_eq!(
        label("org.opencontainers.image.revision"),
        String::from_utf8_lossy(&head.stdout).trim()
    );
    for package in ["libc6", "libgcc-s1", "ca-certificates"] {
        let installed = Command::new("dpkg-query")
            .args(["-W", "-f=${Version}", package])
            .output()
            .expect("dpkg-query");
        assert!(installed.status.success(), "dpkg-query {package}");
        assert_eq!(
            label(&format!("dev.settle.image.debian.{package}")),
            String::from_utf8_lossy(&installed.stdout),
            "the image records the version of {package} its files came from"
        );
    }
    assert!(
        label("dev.settle.image.rustc").starts_with("rustc "),
        "the compiler is recorded"
    );
}

/// Runs `bin` of the unpacked image `dir` with the image's loader and libraries only.
/// A 64-bit little-endian ELF file's sections: name, address, size.
fn elf_sections(elf: &[u8]) -> Vec<(String, u64, u64)> {
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().expect("4 bytes")) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().expect("8 bytes"));
    assert_eq!(
        &elf[..6],
        b"\x7fELF\x02\x01",
        "a 64-bit little-endian ELF file"
    );
    let (table, size, count, names) = (
        u64_at(0x28) as usize,
        u16_at(0x3a),
        u16_at(0x3c),
        u16_at(0x3e),
    );
    let header = |i: usize| table + i * size;
    let strings = u64_at(header(names) + 0x18) as usize;
    (0..count)
        .map(|i| {
            let h = header(i);
            let at = strings + u32_at(h);
            let end = at + elf[at..].iter().position(|&b| b == 0).expect("a name");
            let name = String::from_utf8_lossy(&elf[at..end]).into_owned();
            (name, u64_at(h + 0x10), u64_at(h + 0x20))
        })
        .collect()
}

fn run_in_image(dir: &Path, bin: &str, args: &[&str]) -> std::process::Output {
    Command::new(dir.join("lib64/ld-linux-x86-64.so.2"))
        .arg("--library-path")
        .arg(dir.join("lib/x86_64-linux-gnu"))
        .arg(dir.join(bin.trim_start_matches('/')))
        .args(args)
        .env_clear()
        .output()
        .expect("run the image's loader")
}

/// Runs `bin` chrooted into `dir` as 65532:65532: the image's own loader path, library search
/// and file modes, nothing of the host. Needs root (CI and the node suite run as root).
fn run_chrooted(dir: &Path, bin: &str, args: &[&str]) -> Option<std::process::Output> {
    let uid = Command::new("id").arg("-u").output().expect("id -u");
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        eprintln!("not root: the chrooted run as 65532 is left out");
        return None;
    }
    Some(
        Command::new("chroot")
            .arg("--userspec=65532:65532")
            .arg(dir)
            .arg(bin)
            .args(args)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .output()
            .expect("chroot runs"),
    )
}

#[test]
fn the_operator_in_the_image_runs_on_the_image_libraries_as_nonroot() {
    let image = settle();
    let dir = tempfile::tempdir().expect("tempdir");
    image.extract_layer(dir.path());
    let want = format!("settle {}", cargo_version());
    let out = run_in_image(dir.path(), "/usr/local/bin/settle", &["--version"]);
    assert!(
        out.status.success(),
        "settle --version on the image's libraries: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want);
    if let Some(out) = run_chrooted(dir.path(), "/usr/local/bin/settle", &["--version"]) {
        assert!(
            out.status.success(),
            "settle --version chrooted as 65532: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want);
    }
}

/// An example application's image: named `repo` at the crate's version, run as nonroot, its
/// entrypoint the application at `entrypoint`.
fn assert_an_application_image(image: &ImageArchive, repo: &str, entrypoint: &str) {
    assert_eq!(image.reference(), format!("{repo}:{}", cargo_version()));
    let config = &image.config["config"];
    assert_eq!(config["User"], "65532:65532");
    assert_eq!(config["Entrypoint"], serde_json::json!([entrypoint]));
}

#[test]
fn the_example_image_runs_account_app_as_nonroot() {
    let image = example();
    assert_an_application_image(
        &image,
        "ghcr.io/settle-dev/settle-example",
        "/usr/local/bin/account_app",
    );
    let entries = entries_by_path(&image);
    for path in [
        "/usr/local/bin/account_app",
        "/lib64/ld-linux-x86-64.so.2",
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/passwd",
    ] {
        assert!(entries.contains_key(path), "the example image has {path}");
    }
    assert!(
        !entries.contains_key("/usr/local/bin/settle"),
        "the operator is not in the application's image"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    image.extract_layer(dir.path());
    // Without its configuration the app stops at once, saying what to set: it ran.
    let says_what_to_set = |out: &std::process::Output| {
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("set SETTLE_SUBSCRIPTION_FILE")
    };
    let out = run_in_image(dir.path(), "/usr/local/bin/account_app", &[]);
    assert!(
        says_what_to_set(&out),
        "account_app on the image's libraries: {out:?}"
    );
    if let Some(out) = run_chrooted(dir.path(), "/usr/local/bin/account_app", &[]) {
        assert!(
            says_what_to_set(&out),
            "account_app chrooted as 65532: {out:?}"
        );
    }
}

/// The Go runtime's example application: static, so the image holds no loader or library,
/// and it runs as nonroot like the Rust one.
#[test]
fn the_go_example_image_runs_account_app_static_as_nonroot() {
    let image = ImageArchive::open(&image_archive("example-go"));
    assert_an_application_image(
        &image,
        "ghcr.io/settle-dev/settle-example-go",
        "/usr/local/bin/account-app",
    );
    let config = &image.config["config"];
    assert!(
        config["Labels"]["dev.settle.image.go"]
            .as_str()
            .is_some_and(|v| v.starts_with("go version go1.")),
        "{:?}",
        config["Labels"]
    );
    let entries = entries_by_path(&image);
    for path in [
        "/usr/local/bin/account-app",
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/passwd",
    ] {
        assert!(
            entries.contains_key(path),
            "the Go example image has {path}"
        );
    }
    assert!(
        !entries.contains_key("/lib64/ld-linux-x86-64.so.2"),
        "a static binary needs no loader"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    image.extract_layer(dir.path());
    // Static: it runs as it is, on no library of the host's.
    let out = Command::new(dir.path().join("usr/local/bin/account-app"))
        .env_clear()
        .output()
        .expect("run account-app from the image");
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("set SETTLE_SUBSCRIPTION_FILE"),
        "account-app from the image: {out:?}"
    );
    if let Some(out) = run_chrooted(dir.path(), "/usr/local/bin/account-app", &[]) {
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("set SETTLE_SUBSCRIPTION_FILE"),
            "account-app chrooted as 65532: {out:?}"
        );
    }
}

#[test]
fn the_archive_is_an_oci_layout_that_docker_load_also_reads() {
    let image = settle();
    let layout: serde_json::Value =
        serde_json::from_slice(&image.files["oci-layout"]).expect("oci-layout");
    assert_eq!(layout["imageLayoutVersion"], "1.0.0");
    let entry = &image.index["manifests"][0];
    assert_eq!(
        entry["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        entry["platform"],
        serde_json::json!({"architecture": "amd64", "os": "linux"})
    );
    assert_eq!(
        entry["annotations"]["org.opencontainers.image.ref.name"],
        chart_app_version()
    );
    assert_eq!(
        entry["size"].as_u64(),
        Some(image.blob(&image.manifest_digest).len() as u64)
    );
    // Every blob is named by its digest, and the manifest's sizes are the blobs'.
    for (name, data) in image
        .files
        .iter()
        .filter(|(n, _)| n.starts_with("blobs/sha256/"))
    {
        assert_eq!(
            format!("blobs/{}", sha256_digest(data).replace(':', "/")),
            *name
        );
    }
    for d in std::iter::once(&image.manifest["config"])
        .chain(image.manifest["layers"].as_array().expect("layers"))
    {
        let digest = d["digest"].as_str().expect("digest");
        assert_eq!(
            d["size"].as_u64(),
            Some(image.blob(digest).len() as u64),
            "size of {digest}"
        );
    }
    assert_eq!(
        image.manifest["layers"][0]["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
    // Docker's manifest.json: the same config and layer, under the same name.
    let docker: serde_json::Value =
        serde_json::from_slice(&image.files["manifest.json"]).expect("manifest.json");
    let blob_file = |d: &serde_json::Value| {
        format!(
            "blobs/sha256/{}",
            d["digest"]
                .as_str()
                .expect("digest")
                .trim_start_matches("sha256:")
        )
    };
    assert_eq!(docker[0]["Config"], blob_file(&image.manifest["config"]));
    assert_eq!(
        docker[0]["Layers"],
        serde_json::json!([blob_file(&image.manifest["layers"][0])])
    );
    assert_eq!(
        docker[0]["RepoTags"],
        serde_json::json!([image.reference()])
    );
    // `hack/image.sh digest` prints the manifest digest.
    let printed = common::image::image_script_ok(&["digest", "settle"]);
    assert_eq!(printed.trim(), image.manifest_digest);
}

/// The crates whose sources the binary names (its panic locations and the like hold paths
/// under the cargo registry): a witness, from the bytes shipped, of crates it links.
fn crates_named_in(binary: &[u8]) -> BTreeSet<(String, String)> {
    let marker = b"/index.crates.io-";
    let version = regex::Regex::new(r"^(.+?)-(\d+\.\d+\.\d+[0-9A-Za-z.+-]*)$").expect("regex");
    let mut named = BTreeSet::new();
    let mut at = 0;
    while let Some(i) = binary[at..].windows(marker.len()).position(|w| w == marker) {
        let rest = &binary[at + i + marker.len()..];
        at += i + marker.len();
        // <hash>/<name>-<version>/...
        let Some(slash) = rest.iter().position(|&b| b == b'/') else {
            continue;
        };
        let dir = &rest[slash + 1..];
        let Some(end) = dir.iter().position(|&b| b == b'/') else {
            continue;
        };
        let Ok(dir) = std::str::from_utf8(&dir[..end]) else {
            continue;
        };
        if let Some(c) = version.captures(dir) {
            named.insert((c[1].to_string(), c[2].to_string()));
        }
    }
    named
}

#[test]
fn the_operator_image_carries_a_bill_of_materials_of_every_crate_it_links_and_every_debian_package()
{
    let image = settle();
    let entries = entries_by_path(&image);
    let inside = &entries
        .get("/usr/share/doc/settle/sbom.cdx.json")
        .expect("the bill of materials in the image")
        .data;
    let beside = std::fs::read(format!("{}.cdx.json", image.path.display()))
        .expect("the bill of materials beside the archive");
    assert_eq!(inside, &beside, "the one beside the archive is the image's");
    let bom: serde_json::Value = serde_json::from_slice(inside).expect("JSON");
    assert_eq!(
        (bom["bomFormat"].as_str(), bom["specVersion"].as_str()),
        (Some("CycloneDX"), Some("1.5"))
    );
    assert_eq!(bom["metadata"]["component"]["version"], cargo_version());
    let components = bom["components"].as_array().expect("components");
    let of = |prefix: &str| -> BTreeMap<(String, String), &serde_json::Value> {
        components
            .iter()
            .filter(|c| c["purl"].as_str().is_some_and(|p| p.starts_with(prefix)))
            .map(|c| {
                let field = |k: &str| c[k].as_str().unwrap_or_default().to_string();
                ((field("name"), field("version")), c)
            })
            .collect()
    };
    let crates = of("pkg:cargo/");
    let debs = of("pkg:deb/");

    // Every crate the binary in the image names is listed, and no crate only the build runs.
    let binary = &entries
        .get("/usr/local/bin/settle")
        .expect("the binary")
        .data;
    let named = crates_named_in(binary);
    assert!(named.len() > 50, "the binary names its crates: {named:?}");
    let missing: Vec<_> = named.iter().filter(|k| !crates.contains_key(*k)).collect();
    assert!(missing.is_empty(), "linked and not listed: {missing:?}");
    for build_only in ["serde_derive", "thiserror-impl", "clap_derive"] {
        assert!(
            !crates.keys().any(|(n, _)| n == build_only),
            "{build_only} runs at build time, not in the binary"
        );
    }
    // Cargo.lock's checksum for each crate from crates.io; the workspace's own are said.
    let lock = read("Cargo.lock");
    for ((name, version), c) in &crates {
        match c["hashes"][0]["content"].as_str() {
            Some(sum) => assert!(
                lock.contains(&format!(
                    "name = \"{name}\"\nversion = \"{version}\"\nsource = \"registry+https://github.com/rust-lang/crates.io-index\"\nchecksum = \"{sum}\""
                )),
                "{name} {version}: checksum {sum} is not Cargo.lock's"
            ),
            None => assert_eq!(
                c["properties"][0]["value"], "workspace",
                "{name} {version} has no checksum: only a crate of this workspace"
            ),
        }
    }
    assert!(crates.contains_key(&("settle".to_string(), cargo_version())));

    // The Debian packages: those the image's labels name, each at its version.
    let labels = image.config["config"]["Labels"]
        .as_object()
        .expect("labels");
    let labelled: BTreeSet<(String, String)> = labels
        .iter()
        .filter_map(|(k, v)| {
            let pkg = k.strip_prefix("dev.settle.image.debian.")?;
            Some((pkg.to_string(), v.as_str()?.to_string()))
        })
        .collect();
    assert!(!labelled.is_empty(), "the image names its Debian packages");
    assert_eq!(debs.keys().cloned().collect::<BTreeSet<_>>(), labelled);
}

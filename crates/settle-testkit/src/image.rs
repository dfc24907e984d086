//! The images `hack/image.sh` builds (the operator's and the example application's), for
//! crates/settle-e2e/tests/image.rs and the suites that run them as pods: where their archives are, building them
//! once per test process, and reading one whole (index → manifest → config → layer, each blob
//! checked against its digest). It only reads archives: loading an image into a node's
//! containerd is the pod suite's business, and what goes into an image is hack/image.sh's.

use super::{path_str, root};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};

/// `hack/image.sh ARGS`, its output returned whatever its status.
pub fn image_script(args: &[&str]) -> Output {
    super::process::without_cargo_test_env(&mut Command::new(root().join("hack/image.sh")))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run hack/image.sh {args:?}: {e}"))
}

/// `hack/image.sh ARGS`, which must succeed; returns its stdout.
pub fn image_script_ok(args: &[&str]) -> String {
    let out = image_script(args);
    assert!(
        out.status.success(),
        "hack/image.sh {args:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The archive of image `name` (`settle` or `example`) in the default place
/// (`${CARGO_TARGET_DIR:-target}/image`, where `make image` writes it), built or brought up to
/// date by `hack/image.sh build NAME` once per test process (a no-op pack when nothing changed).
pub fn image_archive(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let built = BUILT.get_or_init(|| Mutex::new(HashMap::new()));
    // Held while building, so two tests of one process never build the same image at once.
    let mut built = built.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = built.get(name) {
        return path.clone();
    }
    image_script_ok(&["build", name]);
    let path = PathBuf::from(image_script_ok(&["path", name]).trim());
    assert!(path.is_file(), "hack/image.sh built no {}", path.display());
    built.insert(name.to_string(), path.clone());
    path
}

/// Builds image `name` into `out`, under `tag` (None: the default) with `labels` (`K=V`) added;
/// returns the archive's path.
pub fn build_image_into(name: &str, out: &Path, tag: Option<&str>, labels: &[&str]) -> PathBuf {
    let mut common = vec![name, "--out", path_str(out)];
    if let Some(tag) = tag {
        common.extend(["--tag", tag]);
    }
    let mut build = vec!["build"];
    build.extend(&common);
    for label in labels {
        build.extend(["--label", label]);
    }
    image_script_ok(&build);
    let mut path = vec!["path"];
    path.extend(&common);
    PathBuf::from(image_script_ok(&path).trim())
}

pub fn sha256_digest(data: &[u8]) -> String {
    let hash = Sha256::digest(data);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// One tar entry, as written: the path without a leading `/`, its type flag (`b'0'` file,
/// `b'5'` directory, `b'2'` symlink), mode bits, owner, mtime, link target and contents.
#[derive(Clone, Debug)]
pub struct TarEntry {
    pub path: String,
    pub kind: u8,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: u64,
    pub link: String,
    pub data: Vec<u8>,
}

fn octal(field: &[u8]) -> u64 {
    let text = String::from_utf8_lossy(field);
    let digits = text.trim_matches(|c: char| c == '\0' || c == ' ');
    u64::from_str_radix(digits, 8).unwrap_or_else(|_| panic!("tar: bad octal field {text:?}"))
}

fn text(field: &[u8]) -> String {
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// The entries of a ustar/PAX archive, in order (PAX `path` and `linkpath` records applied).
pub fn tar_entries(bytes: &[u8]) -> Vec<TarEntry> {
    let mut entries = Vec::new();
    let mut pax: HashMap<String, String> = HashMap::new();
    let mut at = 0;
    while at + 512 <= bytes.len() {
        let h = &bytes[at..at + 512];
        if h.iter().all(|b| *b == 0) {
            break;
        }
        let size = octal(&h[124..136]) as usize;
        let data = bytes[at + 512..at + 512 + size].to_vec();
        at += 512 + size.div_ceil(512) * 512;
        let kind = h[156];
        if kind == b'x' {
            // Records "LEN key=value\n".
            let mut rest = &data[..];
            while !rest.is_empty() {
                let space = rest
                    .iter()
                    .position(|b| *b == b' ')
                    .expect("pax record length");
                let len: usize = text(&rest[..space]).parse().expect("pax record length");
                let record = String::from_utf8_lossy(&rest[space + 1..len - 1]).into_owned();
                if let Some((k, v)) = record.split_once('=') {
                    pax.insert(k.to_string(), v.to_string());
                }
                rest = &rest[len..];
            }
            continue;
        }
        let prefix = text(&h[345..500]);
        let name = text(&h[0..100]);
        let joined = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        entries.push(TarEntry {
            path: pax
                .remove("path")
                .unwrap_or(joined)
                .trim_end_matches('/')
                .to_string(),
            kind: if kind == 0 { b'0' } else { kind },
            mode: octal(&h[100..108]) as u32,
            uid: octal(&h[108..116]),
            gid: octal(&h[116..124]),
            mtime: octal(&h[136..148]),
            link: pax.remove("linkpath").unwrap_or_else(|| text(&h[157..257])),
            data,
        });
        pax.clear();
    }
    entries
}

/// An image archive read whole: the OCI layout's index, its one manifest and config, and the
/// Docker `manifest.json` beside them.
pub struct ImageArchive {
    pub path: PathBuf,
    /// The archive's files by name (`oci-layout`, `index.json`, `blobs/sha256/…`).
    pub files: BTreeMap<String, Vec<u8>>,
    pub index: serde_json::Value,
    pub manifest_digest: String,
    pub manifest: serde_json::Value,
    pub config: serde_json::Value,
}

impl ImageArchive {
    pub fn open(path: &Path) -> ImageArchive {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let files: BTreeMap<String, Vec<u8>> = tar_entries(&bytes)
            .into_iter()
            .filter(|e| e.kind == b'0')
            .map(|e| (e.path, e.data))
            .collect();
        let json = |name: &str, data: &[u8]| -> serde_json::Value {
            serde_json::from_slice(data)
                .unwrap_or_else(|e| panic!("{name} in {}: {e}", path.display()))
        };
        let index = json(
            "index.json",
            files.get("index.json").expect("index.json in the archive"),
        );
        let manifests = index["manifests"]
            .as_array()
            .expect("index.json lists manifests");
        assert_eq!(manifests.len(), 1, "one image per archive: {index}");
        let manifest_digest = manifests[0]["digest"]
            .as_str()
            .expect("manifest digest")
            .to_string();
        let mut archive = ImageArchive {
            path: path.to_path_buf(),
            files,
            index: index.clone(),
            manifest_digest: manifest_digest.clone(),
            manifest: serde_json::Value::Null,
            config: serde_json::Value::Null,
        };
        archive.manifest = json("the manifest", archive.blob(&manifest_digest));
        let config_digest = archive.manifest["config"]["digest"]
            .as_str()
            .expect("config digest")
            .to_string();
        archive.config = json("the config", archive.blob(&config_digest));
        archive
    }

    /// The blob of `digest`, checked against it.
    pub fn blob(&self, digest: &str) -> &[u8] {
        let name = format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
        let data = self
            .files
            .get(&name)
            .unwrap_or_else(|| panic!("{} has no blob {digest}", self.path.display()));
        assert_eq!(
            sha256_digest(data),
            digest,
            "blob {name} is not what its name says"
        );
        data
    }

    /// The full reference `ctr images import` names it by (`io.containerd.image.name`).
    pub fn reference(&self) -> String {
        self.index["manifests"][0]["annotations"]["io.containerd.image.name"]
            .as_str()
            .expect("io.containerd.image.name in index.json")
            .to_string()
    }

    /// A label of the image's config.
    pub fn label(&self, key: &str) -> Option<String> {
        self.config["config"]["Labels"][key]
            .as_str()
            .map(str::to_string)
    }

    /// The one layer, uncompressed (through `gzip -dc`), after checking its digest, and that its
    /// sha256 is the config's diff_id.
    pub fn layer_tar(&self) -> Vec<u8> {
        let layers = self.manifest["layers"].as_array().expect("manifest layers");
        assert_eq!(layers.len(), 1, "one layer: {}", self.manifest);
        let packed = self.blob(layers[0]["digest"].as_str().expect("layer digest"));
        let mut gzip = Command::new("gzip")
            .arg("-dc")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("gzip is on PATH");
        let mut stdin = gzip.stdin.take().expect("gzip stdin");
        let packed = packed.to_vec();
        let feeder = std::thread::spawn(move || stdin.write_all(&packed));
        let out = gzip.wait_with_output().expect("gzip ran");
        feeder.join().expect("feed gzip").expect("write to gzip");
        assert!(out.status.success(), "gzip -dc of the layer failed");
        assert_eq!(
            self.config["rootfs"]["diff_ids"][0].as_str(),
            Some(sha256_digest(&out.stdout).as_str()),
            "the config's diff_id is the uncompressed layer's digest"
        );
        out.stdout
    }

    pub fn layer_entries(&self) -> Vec<TarEntry> {
        tar_entries(&self.layer_tar())
    }

    /// Unpacks the layer into `dir` with tar.
    pub fn extract_layer(&self, dir: &Path) {
        let mut tar = Command::new("tar")
            .args(["-xf", "-", "-C", path_str(dir)])
            .stdin(Stdio::piped())
            .spawn()
            .expect("tar is on PATH");
        tar.stdin
            .take()
            .expect("tar stdin")
            .write_all(&self.layer_tar())
            .expect("write the layer to tar");
        assert!(
            tar.wait().expect("tar ran").success(),
            "tar -x of the layer failed"
        );
    }
}

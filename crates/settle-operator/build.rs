//! Lays out the operator's code: a release build of the `settle` binary on Linux places the
//! functions `settle operator` runs (`link/hot-functions.txt`, written by `hack/hot-text.sh`)
//! first and together, in an output section `.text.hot` before `.text`, so the pages it touches
//! are few and the kernel maps fewer around them (issue: scale; the README's cost curve).
//!
//! It only orders code: no function is added, dropped or changed, and nothing is done for other
//! binaries, debug builds, other systems, or with `SETTLE_HOT_TEXT=0` (for a linker without
//! linker-script `INSERT`, such as mold). A name the build no longer has matches nothing.

use std::path::Path;

#[path = "link/layout.rs"]
mod layout;

const FUNCTIONS: &str = "link/hot-functions.txt";

fn main() {
    println!("cargo:rerun-if-changed={FUNCTIONS}");
    println!("cargo:rerun-if-changed=link/layout.rs");
    println!("cargo:rerun-if-env-changed=SETTLE_HOT_TEXT");
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    let linux = std::env::var("CARGO_CFG_TARGET_OS").is_ok_and(|o| o == "linux");
    let off = std::env::var("SETTLE_HOT_TEXT").is_ok_and(|v| v == "0");
    if !release || !linux || off {
        return;
    }
    let (Ok(dir), Ok(out)) = (
        std::env::var("CARGO_MANIFEST_DIR"),
        std::env::var("OUT_DIR"),
    ) else {
        return;
    };
    let Ok(names) = std::fs::read_to_string(Path::new(&dir).join(FUNCTIONS)) else {
        println!(
            "cargo:warning={FUNCTIONS} is missing: the operator's code keeps the default layout"
        );
        return;
    };
    let script = Path::new(&out).join("hot-text.ld");
    if let Err(e) = std::fs::write(&script, layout::linker_script(&names)) {
        println!("cargo:warning=cannot write {}: {e}", script.display());
        return;
    }
    println!(
        "cargo:rustc-link-arg-bin=settle=-Wl,-T,{}",
        script.display()
    );
}

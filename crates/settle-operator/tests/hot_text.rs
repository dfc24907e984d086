//! The layout of the operator's code (build.rs, `link/layout.rs`): which sections the linker
//! script places first, and in what order. The shipped binary's layout is checked where it is
//! built (crates/settle-e2e/tests/image.rs).

#[path = "../link/layout.rs"]
mod layout;

#[test]
fn a_function_is_placed_by_its_own_name_before_any_loose_pattern() {
    let names = "# a comment\n\
        _ZN6settle4main17h0123456789abcdefE\n\
        _ZN5tokio7runtime4task3raw4poll17hfedcba9876543210E.1234\n\
        \n\
        _RNvNtCsgEmfK2I1SDS_4core3fmt5write\n";
    let script = layout::linker_script(names);
    let lines: Vec<&str> = script.lines().collect();
    assert_eq!(lines[0], "SECTIONS {");
    assert_eq!(lines[1], "  .text.hot : {");
    let placed: Vec<&str> = lines[2..lines.len() - 2]
        .iter()
        .map(|l| {
            l.trim()
                .strip_prefix("*(.text.")
                .and_then(|l| l.split(' ').next())
                .unwrap_or_else(|| panic!("not a placement: {l}"))
        })
        .collect();
    assert_eq!(
        placed,
        [
            // Exact, in the list's order, LTO's suffix left open.
            "_ZN6settle4main17h0123456789abcdefE*",
            "_ZN5tokio7runtime4task3raw4poll17hfedcba9876543210E*",
            "_RNvNtCsgEmfK2I1SDS_4core3fmt5write*",
            // Then loose: hashes and crate disambiguators open.
            "_ZN6settle4main17h*",
            "_ZN5tokio7runtime4task3raw4poll17h*",
            "_RNvNtCs*_4core3fmt5write*",
        ]
    );
    assert!(lines[2].ends_with(" .text.unlikely._ZN6settle4main17h0123456789abcdefE*)"));
    assert_eq!(lines[lines.len() - 1], "} INSERT BEFORE .text;");
}

#[test]
fn what_differs_between_builds_is_left_open_and_nothing_else() {
    assert_eq!(layout::unsuffixed("f.llvm.123"), "f");
    assert_eq!(layout::unsuffixed("f.42"), "f");
    assert_eq!(layout::unsuffixed("f.cold"), "f.cold");
    assert_eq!(layout::unsuffixed("main"), "main");
    // A legacy name without a hash, and one whose "hash" is not one, stay as they are.
    assert_eq!(layout::loose("_ZN4core3fmt5write"), "_ZN4core3fmt5write*");
    assert_eq!(layout::loose("_ZN1a17hxyzE"), "_ZN1a17hxyzE*");
    // v0: disambiguators and back-references open, generic arguments kept.
    assert_eq!(
        layout::loose(
            "_RINvNtCsgEmfK2I1SDS_4core3ptr13drop_in_placeNtNtCs1a2b_6settle3api3SubEB4_"
        ),
        "_RINvNtCs*_4core3ptr13drop_in_placeNtNtCs*_6settle3api3SubEB*_*"
    );
    assert_eq!(layout::loose("plain_c_symbol"), "plain_c_symbol*");
}

#[test]
fn a_name_a_linker_script_would_misread_is_left_out_and_repeats_are_placed_once() {
    let script = layout::linker_script("a b\nf(x)\ng\ng\n");
    let placements: Vec<&str> = script.lines().filter(|l| l.contains("*(")).collect();
    assert_eq!(placements, ["    *(.text.g* .text.unlikely.g*)"]);
}

//! No code: this crate holds the end-to-end suites under `tests/` (README.md).

//! No code: this crate holds applications on Settle's handler runtime under `examples/`
//! (`orders`, the runtime run from a Subscription resource; `account_app`, the test application
//! the account, pod and demo suites run). They depend on the `settle` library alone, as a team's
//! own service would.

//! The tenant attack matrix: what a tenant B sharing the cluster and the broker with tenant A
//! can try against A, and what happened when this suite tried it. Each broker's scene
//! (`matrix_nats`, `matrix_rabbitmq`, `matrix_sqs`) runs the attacks on the real API server and
//! the real broker configured as `docs/guide/multi-tenant.md` says, with A's application
//! running; a cell is written only after the attack was tried and seen to fail, and the scene
//! then checks A's counts exact, never stepped down, and still moving. The scene prints its
//! table and checks it against `docs/guide/tenant-matrix.md`, so the page says what the suite
//! saw. This file holds the table and the check every scene ends with; the attacks are the
//! scenes'.

use std::fmt::Write as _;
use std::time::Duration;

use kube::Api;
use settle::api::{ConsumerStats, Subscription};
use settle_testkit::subs::wait_condition;

use super::tenants::{nacked, settled};

/// The attacks, in the order of the page's rows.
pub(super) const READ: &str = "read A's deliveries";
pub(super) const SETTLE: &str = "settle A's deliveries";
pub(super) const FORGE: &str = "forge, inflate or deflate A's counters";
pub(super) const HIDE: &str = "hide A's losses";
pub(super) const SQUAT: &str = "squat A's consumer or queue name";
pub(super) const ADOPT: &str = "adopt A's consumer or queue";
pub(super) const FILL: &str = "fill a shared store";
pub(super) const MEMORY: &str = "flood the operator's memory";
pub(super) const STATUS: &str = "flood status writes";
pub(super) const WEBHOOK: &str = "flood the webhook";
pub(super) const SECRETS: &str = "read A's Secrets through a Backend";
pub(super) const IMPORTER: &str = "inject through the importer";

const ORDER: [&str; 12] = [
    READ, SETTLE, FORGE, HIDE, SQUAT, ADOPT, FILL, MEMORY, STATUS, WEBHOOK, SECRETS, IMPORTER,
];

/// After every attack: A's third message (each declined on all 3 attempts) counts exactly one
/// more than `before`, and A's account stays whole (`Accounted=True Kept`).
pub(super) async fn a_counts_its_next_message(api: &Api<Subscription>, before: &ConsumerStats) {
    let after = settled(api, "A's third message exhausted", nacked(3)).await;
    assert_eq!(after.exhausted, before.exhausted + 1, "{after:?}");
    wait_condition(
        api,
        "orders",
        "Accounted",
        "True",
        "Kept",
        Duration::from_secs(5),
    )
    .await;
}

/// One scene's column: what each attack it tried came to.
pub(super) struct Column {
    /// The page's heading for it.
    title: &'static str,
    cells: Vec<(&'static str, String)>,
}

impl Column {
    pub(super) fn new(title: &'static str) -> Column {
        Column {
            title,
            cells: Vec::new(),
        }
    }

    /// The broker or the API server refused the attack; `by` says who and how.
    pub(super) fn refused(&mut self, attack: &'static str, by: &str) {
        self.cells.push((attack, format!("refused: {by}")));
    }

    /// The attack went through and changed nothing of A's; `why` says why.
    pub(super) fn no_effect(&mut self, attack: &'static str, why: &str) {
        self.cells.push((attack, format!("no effect on A: {why}")));
    }

    /// The table, rows in the page's order.
    fn table(&self) -> String {
        let mut rows = self.cells.clone();
        rows.sort_by_key(|(a, _)| ORDER.iter().position(|o| o == a));
        let mut t = String::from("| B tries to | what happened |\n|---|---|\n");
        for (attack, outcome) in rows {
            let _ = writeln!(t, "| {attack} | {outcome} |");
        }
        t
    }

    /// Prints the table, and checks the page shows exactly it under this column's heading
    /// (`SETTLE_BLESS_DOCS=1` writes it there instead, for a change the suite has seen).
    pub(super) fn finish(self) {
        let table = self.table();
        println!("## {}\n\n{table}", self.title);
        let path = settle_testkit::root().join("docs/guide/tenant-matrix.md");
        let page = std::fs::read_to_string(&path).expect("docs/guide/tenant-matrix.md");
        let heading = format!("## {}\n", self.title);
        let (head, rest) = page
            .split_once(&heading)
            .unwrap_or_else(|| panic!("docs/guide/tenant-matrix.md has no \"## {}\"", self.title));
        let lines: Vec<&str> = rest.lines().collect();
        let start = lines.iter().position(|l| l.starts_with('|'));
        let (before, shown, after) = match start {
            Some(s) if lines[..s].iter().all(|l| !l.starts_with("## ")) => {
                let end = lines[s..]
                    .iter()
                    .position(|l| !l.starts_with('|'))
                    .map_or(lines.len(), |e| s + e);
                (&lines[..s], &lines[s..end], &lines[end..])
            }
            _ => (&[][..], &[][..], &lines[..]),
        };
        let shown: String = shown.iter().map(|l| format!("{l}\n")).collect();
        if std::env::var("SETTLE_BLESS_DOCS").is_ok_and(|v| v == "1") {
            let before: String = if before.is_empty() {
                "\n".to_string()
            } else {
                before.iter().map(|l| format!("{l}\n")).collect()
            };
            let after: String = after.iter().map(|l| format!("{l}\n")).collect();
            let gap = if after.starts_with('\n') || after.is_empty() {
                ""
            } else {
                "\n"
            };
            std::fs::write(&path, format!("{head}{heading}{before}{table}{gap}{after}"))
                .expect("write docs/guide/tenant-matrix.md");
            return;
        }
        assert_eq!(
            shown, table,
            "docs/guide/tenant-matrix.md does not show what the suite saw under \"## {}\"; the table above is what it saw (SETTLE_BLESS_DOCS=1 writes it)",
            self.title
        );
    }
}

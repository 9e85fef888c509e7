//! Cost that does not grow with history (issue 8): with millions of log
//! entries and acknowledged deliveries, every hot-path statement reaches
//! `result_events` and `deliveries` through an index range scan, never a
//! full scan, and never sorts more than one batch (docs/performance.md
//! "History does not slow the hot paths", decision 0065).
//!
//! The statements below are the ones the store issues (same tables, same
//! predicates, same ORDER BY/LIMIT, same locks), written out with literal
//! values so that both planners can explain them; each names the function
//! it mirrors. A change to one of those functions' queries belongs here too.

use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use serde_json::{Value, json};

use crate::helpers::*;

/// One hot-path statement and what its plan may contain.
struct HotPath {
    /// The store function it mirrors.
    name: &'static str,
    sql: String,
    /// A sort (SQLite temp B-tree, PostgreSQL Sort node) is allowed only
    /// where its input is bounded by a batch, never by the history.
    sort_ok: bool,
    /// When not empty, the plan must use one of these indexes (a range scan
    /// on the wrong index can still walk the history, e.g. a state filter
    /// applied after an index on `subscription_id` alone).
    index: Vec<&'static str>,
}

fn hot(name: &'static str, sql: impl Into<String>) -> HotPath {
    HotPath {
        name,
        sql: sql.into(),
        sort_ok: false,
        index: Vec::new(),
    }
}

impl HotPath {
    fn sort_ok(mut self) -> Self {
        self.sort_ok = true;
        self
    }

    fn index(self, name: &'static str) -> Self {
        self.index_among(&[name])
    }

    fn index_among(mut self, names: &[&'static str]) -> Self {
        self.index = names.to_vec();
        self
    }
}

const EVENT_A: &str = "0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a";
const EVENT_B: &str = "0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b";
const DELIVERY: &str = "0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d";
const SESSION: &str = "05050505050505050505050505050505";
const NOW: i64 = 1_800_000_000_000_000;

fn statements(pg: bool, queue: &str, sub: &str) -> Vec<HotPath> {
    let for_update = if pg { " FOR UPDATE" } else { "" };
    let skip_locked = if pg { " FOR UPDATE SKIP LOCKED" } else { "" };
    let key_share = if pg { " FOR KEY SHARE" } else { "" };
    // claim::recover_rows: one statement for both target states, scoped
    // to the claimed subscriptions (claim) or limited to a batch (sweeper).
    let recover = |one_subscription: bool| {
        let set = "revision = revision + 1, state = CASE WHEN attempts < attempt_budget \
                   THEN 'PENDING' ELSE 'EXPIRED' END, available_at = CASE WHEN attempts < \
                   attempt_budget THEN lease_until ELSE available_at END";
        let due = format!("state = 'LEASED' AND lease_until <= {NOW}");
        if one_subscription {
            // The subscription as an expression no index serves: the
            // lapsed range bounds the walk, not the live leases (0093).
            format!(
                "UPDATE deliveries SET {set} WHERE {due} \
                 AND COALESCE(subscription_id, '') IN ('{sub}')"
            )
        } else {
            format!(
                "UPDATE deliveries SET {set} WHERE {due} AND id IN \
                 (SELECT id FROM deliveries WHERE {due} LIMIT 500)"
            )
        }
    };
    vec![
        // journal::append: the counter row, then one insert per batch.
        hot(
            "journal::append (counter row)",
            format!(
                "UPDATE queues SET head_sequence = head_sequence + 100 WHERE id = '{queue}' \
                 RETURNING head_sequence"
            ),
        ),
        hot(
            "journal::append (insert)",
            format!(
                "INSERT INTO result_events (id, queue_id, sequence, type, aggregate_kind, \
                 aggregate_id, aggregate_revision, occurred_at, details, snapshot, appended_at, \
                 created_at) VALUES ('{EVENT_A}', '{queue}', 1, 'task.succeeded', 'task', \
                 '{EVENT_A}', '1', {NOW}, '{{}}', '{{}}', {NOW}, {NOW})"
            ),
        ),
        // materialize: subscription row lock, head and floor, read after
        // the cursor, insert deliveries, advance the cursor.
        hot(
            "materialize (subscription row)",
            format!("SELECT * FROM subscriptions WHERE id = '{sub}'{for_update}"),
        ),
        hot(
            "journal::position_for_materialize",
            format!(
                "SELECT head_sequence, retention_floor FROM queues WHERE id = '{queue}'{key_share}"
            ),
        ),
        hot(
            "journal::read_after",
            format!(
                "SELECT id, sequence, type FROM result_events WHERE queue_id = '{queue}' \
                 AND sequence > 9000000 AND sequence <= 9000300 ORDER BY sequence ASC LIMIT 256"
            ),
        )
        .index("ux_result_events_queue_sequence"),
        hot(
            "materialize (insert deliveries)",
            format!(
                "INSERT INTO deliveries (id, subscription_id, event_id, sequence, revision, \
                 state, available_at, lease_epoch, lease_until, lease_digest, lease_session_id, \
                 attempts, attempt_budget, acknowledged_at, ack_epoch, ack_session_id, \
                 created_at) VALUES ('{DELIVERY}', '{sub}', '{EVENT_A}', 1, 1, 'PENDING', {NOW}, \
                 0, NULL, NULL, NULL, 0, 5, NULL, NULL, NULL, {NOW})"
            ),
        ),
        hot(
            "materialize (advance the cursor)",
            format!(
                "UPDATE subscriptions SET cursor_sequence = 9000300, pending_count = 7 \
                 WHERE id = '{sub}'"
            ),
        ),
        // claim: the batch's credentials, its subscriptions with their
        // queues' positions, recovery of their lapsed leases, the
        // sessions' live leases, candidates, one lease per row, render
        // (on PostgreSQL the statements of `orbit_claim_batch`, 0108).
        hot(
            "tenancy::principals_by_id",
            format!("SELECT * FROM credentials WHERE id IN ('{SESSION}', '{DELIVERY}')"),
        ),
        hot(
            "claim::subscriptions_with_positions",
            format!(
                "SELECT subscriptions.id, subscriptions.queue_id, subscriptions.enabled, \
                 subscriptions.cursor_sequence, queues.head_sequence AS head, \
                 queues.retention_floor AS floor FROM subscriptions LEFT JOIN queues \
                 ON subscriptions.queue_id = queues.id WHERE subscriptions.id IN ('{sub}')"
            ),
        ),
        hot("claim::recover_rows (claimed subscriptions)", recover(true))
            .index("ix_deliveries_leased_until"),
        hot(
            "claim (held by the session)",
            orbit_events::store::claim::LIVE_LEASES
                .replace("$1", &format!("'{SESSION}'"))
                .replace("$2", &NOW.to_string()),
        )
        // Not `ix_deliveries_leased_until`: its range above now also holds
        // the old version of every row ACKED since the last VACUUM (0106).
        .index("ix_deliveries_leased_session"),
        hot(
            "claim::pick_and_lease",
            format!(
                "WITH picked AS MATERIALIZED (SELECT picked_id, row_number() OVER \
                 (ORDER BY picked_sequence, picked_id) AS picked_rank \
                 FROM (SELECT id AS picked_id, sequence AS picked_sequence FROM deliveries \
                 WHERE subscription_id = '{sub}' AND state = 'PENDING' AND available_at <= {NOW} \
                 AND attempts < attempt_budget ORDER BY sequence, id LIMIT 2{skip_locked}) \
                 AS candidates) \
                 UPDATE deliveries SET state = 'LEASED', lease_epoch = lease_epoch + 1, \
                 attempts = attempts + 1, revision = revision + 1, leased_at = {NOW}, \
                 lease_until = {NOW}, lease_session_id = a.column2, lease_digest = a.column3 \
                 FROM picked JOIN (VALUES (1, '{SESSION}', 'x'), (2, '{SESSION}', 'y')) AS a \
                 ON a.column1 = picked.picked_rank \
                 WHERE deliveries.id = picked.picked_id AND deliveries.state = 'PENDING' \
                 RETURNING id"
            ),
        )
        // The window's sort is over the picked rows: one claim's batch.
        .sort_ok()
        .index("ix_deliveries_pending_claim"),
        hot(
            "journal::render",
            format!("SELECT * FROM result_events WHERE id IN ('{EVENT_A}', '{EVENT_B}')"),
        ),
        // ack: read the row, the guarded update, the backlog counter.
        hot(
            "ack (read the delivery)",
            format!("SELECT * FROM deliveries WHERE id = '{DELIVERY}'"),
        ),
        hot(
            "ack (update)",
            format!(
                "UPDATE deliveries SET state = 'ACKED', acknowledged_at = {NOW}, \
                 ack_epoch = lease_epoch, ack_session_id = '{SESSION}', \
                 revision = revision + 1, lease_until = NULL, lease_session_id = NULL \
                 WHERE id = '{DELIVERY}' AND lease_epoch = 1 AND state <> 'ACKED' RETURNING id"
            ),
        ),
        hot(
            "ack (pending_count, SQLite)",
            format!(
                "UPDATE subscriptions SET pending_count = pending_count - 1 WHERE id = '{sub}'"
            ),
        ),
        // PostgreSQL: the ACKs' tallies, folded by a materialization and
        // summed by the readers of `pending_count` (decision 0094).
        hot(
            "tallies::fold",
            format!("DELETE FROM subscription_ack_tallies WHERE subscription_id = '{sub}' RETURNING acked"),
        )
        .index("ix_subscription_ack_tallies_subscription"),
        hot(
            "tallies::unfolded",
            format!(
                "SELECT subscription_id, CAST(SUM(acked) AS BIGINT) FROM subscription_ack_tallies \
                 WHERE subscription_id IN ('{sub}') GROUP BY subscription_id"
            ),
        )
        .index("ix_subscription_ack_tallies_subscription"),
        // Sweeper: recovery across subscriptions, retention batches.
        hot("retention::recover_leases", recover(false)),
        hot(
            "journal::purge (queue row)",
            format!("SELECT retention_floor FROM queues WHERE id = '{queue}'{for_update}"),
        ),
        hot(
            "journal::purge (examine a batch)",
            format!(
                "SELECT id, sequence, appended_at FROM result_events WHERE queue_id = '{queue}' \
                 AND sequence > 4000000 ORDER BY sequence ASC LIMIT 500"
            ),
        )
        .index("ux_result_events_queue_sequence"),
        // DISTINCT over at most one batch (500 event ids).
        hot(
            "journal::purge (still referenced)",
            format!(
                "SELECT DISTINCT event_id FROM deliveries WHERE subscription_id IN \
                 (SELECT id FROM subscriptions WHERE queue_id = '{queue}') AND event_id IN \
                 ('{EVENT_A}', '{EVENT_B}') AND state <> 'ACKED'"
            ),
        )
        .sort_ok()
        .index("ux_deliveries_subscription_event"),
        hot(
            "journal::purge (delete)",
            format!("DELETE FROM result_events WHERE id IN ('{EVENT_A}', '{EVENT_B}')"),
        ),
        hot(
            "retention::purge_acked_deliveries",
            format!(
                "DELETE FROM deliveries WHERE id IN (SELECT id FROM deliveries \
                 WHERE state = 'ACKED' AND acknowledged_at < {NOW} LIMIT 500)"
            ),
        )
        .index("ix_deliveries_acked_at"),
        // Head and floor (session open, claim, delivery detail, metrics).
        hot(
            "journal::position",
            format!("SELECT head_sequence, retention_floor FROM queues WHERE id = '{queue}'"),
        ),
        // The deliveries listing, newest first, first and later pages,
        // with and without a state filter.
        hot(
            "deliveries::list_page",
            format!(
                "SELECT * FROM deliveries WHERE subscription_id = '{sub}' \
                 ORDER BY created_at DESC, id DESC LIMIT 51"
            ),
        ),
        hot(
            "deliveries::list_page (after a position)",
            format!(
                "SELECT * FROM deliveries WHERE subscription_id = '{sub}' \
                 AND (created_at, id) < ({NOW}, '{DELIVERY}') \
                 ORDER BY created_at DESC, id DESC LIMIT 51"
            ),
        ),
        hot(
            "deliveries::list_page (state)",
            format!(
                "SELECT * FROM deliveries WHERE subscription_id = '{sub}' AND state = 'PENDING' \
                 ORDER BY created_at DESC, id DESC LIMIT 51"
            ),
        )
        .index("ix_deliveries_subscription_state_created"),
        hot(
            "deliveries::list_page (state, after a position)",
            format!(
                "SELECT * FROM deliveries WHERE subscription_id = '{sub}' AND state = 'PENDING' \
                 AND (created_at, id) < ({NOW}, '{DELIVERY}') \
                 ORDER BY created_at DESC, id DESC LIMIT 51"
            ),
        )
        .index("ix_deliveries_subscription_state_created"),
        // store::publish::publish_batch: the keys of a batch of publishes
        // (decisions 0063, 0091), `key IN (..)` per credential.
        hot(
            "idempotency::live_records (expired)",
            format!(
                "DELETE FROM idempotency_records WHERE credential_id = '{SESSION}' \
                 AND key IN ('k1', 'k2') AND expires_at <= {NOW}"
            ),
        )
        .index("ux_idempotency_records_key_credential"),
        hot(
            "idempotency::live_records (read)",
            format!(
                "SELECT * FROM idempotency_records WHERE credential_id = '{SESSION}' \
                 AND key IN ('k1', 'k2')"
            ),
        )
        .index("ux_idempotency_records_key_credential"),
    ]
}

/// The mirrors above whose statements SQLite no longer runs: there the
/// store runs `store::sqlite::HOT_STATEMENTS` (decision 0095), which are
/// explained as they are.
const MIRRORED_ON_POSTGRES_ONLY: &[&str] = &[
    "journal::append (counter row)",
    "journal::append (insert)",
    "materialize (subscription row)",
    "journal::position_for_materialize",
    "journal::read_after",
    "materialize (insert deliveries)",
    "materialize (advance the cursor)",
    "tenancy::principals_by_id",
    "claim::subscriptions_with_positions",
    "claim (held by the session)",
    "claim::pick_and_lease",
    "journal::render",
    "ack (read the delivery)",
    "ack (update)",
    "ack (pending_count, SQLite)",
    "idempotency::live_records (expired)",
    "idempotency::live_records (read)",
];

/// The SQLite hot statements as the store runs them, each with the index
/// it must use where one index serves it best.
fn sqlite_hot_statements() -> Vec<HotPath> {
    orbit_events::store::sqlite::HOT_STATEMENTS
        .iter()
        .map(|&(name, sql)| {
            let path = hot(name, sql);
            match name {
                "claim::ANY_LAPSED" => path.index("ix_deliveries_leased_until"),
                "claim::HELD" => path
                    .index_among(&["ix_deliveries_leased_session", "ix_deliveries_leased_until"]),
                "claim::PICK" => path.index("ix_deliveries_pending_claim"),
                "materialize::READ_AFTER" => path.index("ux_result_events_queue_sequence"),
                "publish::EXPIRE_RECORD" | "publish::READ_RECORD" => {
                    path.index("ux_idempotency_records_key_credential")
                }
                _ => path,
            }
        })
        .collect()
}

/// `EXPLAIN QUERY PLAN` of `sql` on the SQLite file at `path`, with its
/// parameters unbound: the plan SQLite prepares for the text.
fn sqlite_plan(path: &str, sql: &str) -> Vec<String> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut explain = conn
        .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
        .unwrap_or_else(|e| panic!("{e}\n{sql}"));
    // Unbound: every parameter is NULL, which the plan does not depend on.
    let mut rows = explain.raw_query();
    let mut details = Vec::new();
    while let Some(row) = rows.next().unwrap() {
        details.push(row.get::<_, String>(3).unwrap());
    }
    details
}

/// The plan's lines that break the rule ("full scan …", "sort …"), and
/// whether the plan names `index`.
fn sqlite_violations(rows: &[String], path: &HotPath) -> (Vec<String>, bool) {
    let mut bad = Vec::new();
    for detail in rows {
        let on_history = ["result_events", "deliveries"]
            .iter()
            .any(|t| detail.split_whitespace().nth(1) == Some(t));
        // "SCAN t", "SCAN t USING [COVERING] INDEX i": every row of t (or
        // of its index) is visited. "SEARCH t USING INDEX i (a=? AND b>?)"
        // is the range scan we want.
        if detail.starts_with("SCAN ") && on_history {
            bad.push(format!("full scan: {detail}"));
        }
        if detail.starts_with("USE TEMP B-TREE") && !path.sort_ok {
            bad.push(format!("sort: {detail}"));
        }
    }
    let uses_index = path.index.is_empty()
        || path
            .index
            .iter()
            .any(|ix| rows.iter().any(|d| d.contains(&format!("INDEX {ix} "))));
    (bad, uses_index)
}

fn pg_violations(node: &Value, path: &HotPath, bad: &mut Vec<String>, indexes: &mut Vec<String>) {
    let node_type = node["Node Type"].as_str().unwrap_or_default();
    let relation = node["Relation Name"].as_str().unwrap_or_default();
    let on_history = relation == "result_events" || relation == "deliveries";
    if let Some(ix) = node["Index Name"].as_str() {
        indexes.push(ix.to_owned());
    }
    match node_type {
        "Seq Scan" if on_history => bad.push(format!("full scan: Seq Scan on {relation}")),
        // An index scan without an index condition walks the whole index.
        "Index Scan" | "Index Only Scan" if on_history && node.get("Index Cond").is_none() => {
            bad.push(format!(
                "full scan: {node_type} using {} on {relation} without an index condition",
                node["Index Name"].as_str().unwrap_or("?")
            ));
        }
        "Sort" | "Incremental Sort" if !path.sort_ok => {
            bad.push(format!("sort: {node_type} on {}", node["Sort Key"]));
        }
        _ => {}
    }
    if let Some(children) = node["Plans"].as_array() {
        for child in children {
            pg_violations(child, path, bad, indexes);
        }
    }
}

/// PostgreSQL only: a history of 20,000 entries, 19,800 of them delivered
/// and ACKED, 100 LEASED to ten sessions and 100 PENDING, then ANALYZE, so
/// that the planner weighs the indexes as on a long-running node (on empty
/// tables its choice among indexes is arbitrary).
fn pg_history(queue: &str, sub: &str) -> String {
    format!(
        "INSERT INTO result_events (id, queue_id, sequence, type, aggregate_kind, \
           aggregate_id, aggregate_revision, occurred_at, details, snapshot, appended_at, \
           created_at) \
         SELECT md5('e' || n), '{queue}', 1000000 + n, 'task.succeeded', 'task', \
           md5('a' || n), '1', n, '{{}}', '{{}}', n, n FROM generate_series(1, 20000) AS n; \
         INSERT INTO deliveries (id, subscription_id, event_id, sequence, revision, state, \
           available_at, lease_epoch, lease_until, lease_digest, lease_session_id, attempts, \
           attempt_budget, acknowledged_at, created_at) \
         SELECT md5('d' || n), '{sub}', md5('e' || n), 1000000 + n, 3, \
           CASE WHEN n <= 19800 THEN 'ACKED' WHEN n <= 19900 THEN 'LEASED' ELSE 'PENDING' END, \
           n, 1, CASE WHEN n > 19800 AND n <= 19900 THEN {NOW} + 30000000 END, NULL, \
           CASE WHEN n > 19800 AND n <= 19810 THEN '{SESSION}' \
             WHEN n > 19810 AND n <= 19900 THEN md5('s' || (n % 9)) END, 1, 5, \
           CASE WHEN n <= 19800 THEN n END, n FROM generate_series(1, 20000) AS n; \
         ANALYZE result_events; ANALYZE deliveries"
    )
}

/// A long history must not slow the hot paths: every hot-path statement
/// reaches `result_events` and `deliveries` through an index range scan.
///
/// How this stays robust on a small test database: SQLite's planner is not
/// given statistics (no ANALYZE, as in production), so it costs every table
/// as large, which is the case this rule is about. PostgreSQL's planner
/// would rightly pick a sequential scan (or a sort) for a small table, so
/// the statements are explained in one transaction that first writes a
/// history and ANALYZEs it ([`pg_history`]), then sets
/// `SET LOCAL enable_seqscan = off` and `SET LOCAL enable_sort = off`: both
/// then cost 10^10, and a plan that still has one has no index serving the
/// statement; a full index scan (no index condition) is caught as well.
#[actix_web::test]
async fn hot_path_queries_use_index_range_scans() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    let backend = app.db.backend();
    let pg = backend == DbBackend::Postgres;

    // A transaction that is rolled back: EXPLAIN without ANALYZE runs
    // nothing, and the history, the statistics and the SET LOCALs end with it.
    let txn = app.db.reader().begin().await.unwrap();
    if pg {
        txn.execute_unprepared(&pg_history(&cred.queue_id, &sub_id))
            .await
            .unwrap();
        txn.execute_unprepared("SET LOCAL enable_seqscan = off; SET LOCAL enable_sort = off")
            .await
            .unwrap();
    }
    let mut failures = Vec::new();
    let mut paths = statements(pg, &cred.queue_id, &sub_id);
    if !pg {
        paths.retain(|p| !MIRRORED_ON_POSTGRES_ONLY.contains(&p.name));
    }
    let exact = if pg { 0 } else { paths.len() };
    if !pg {
        paths.extend(sqlite_hot_statements());
    }
    let file = orbit_events::store::sqlite_path(&app.settings.database.url).map(str::to_owned);
    for (i, path) in paths.iter().enumerate() {
        let (bad, uses_index, plan) = if pg {
            let row = txn
                .query_one_raw(Statement::from_string(
                    backend,
                    format!("EXPLAIN (FORMAT JSON) {}", path.sql),
                ))
                .await
                .unwrap_or_else(|e| panic!("{}: {e}\n{}", path.name, path.sql))
                .unwrap();
            let plan: Value = row.try_get_by_index(0).unwrap();
            let mut bad = Vec::new();
            let mut indexes = Vec::new();
            pg_violations(&plan[0]["Plan"], path, &mut bad, &mut indexes);
            let uses_index = path.index.is_empty()
                || path.index.iter().any(|ix| indexes.iter().any(|i| i == ix));
            (bad, uses_index, format!("{plan:#}"))
        } else if i >= exact {
            let details = sqlite_plan(file.as_deref().unwrap(), &path.sql);
            let (bad, uses_index) = sqlite_violations(&details, path);
            (bad, uses_index, details.join("\n"))
        } else {
            let rows = txn
                .query_all_raw(Statement::from_string(
                    backend,
                    format!("EXPLAIN QUERY PLAN {}", path.sql),
                ))
                .await
                .unwrap_or_else(|e| panic!("{}: {e}\n{}", path.name, path.sql));
            let details: Vec<String> = rows
                .iter()
                .map(|r| r.try_get::<String>("", "detail").unwrap())
                .collect();
            let (bad, uses_index) = sqlite_violations(&details, path);
            (bad, uses_index, details.join("\n"))
        };
        if !bad.is_empty() || !uses_index {
            let mut why = bad;
            if !uses_index {
                why.push(format!("does not use {}", path.index.join(" or ")));
            }
            failures.push(format!(
                "{}: {}\n  {}\n  plan:\n{plan}",
                path.name,
                why.join("; "),
                path.sql
            ));
        }
    }
    txn.rollback().await.unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} hot-path statements are not index range scans:\n\n{}",
        failures.len(),
        paths.len(),
        failures.join("\n\n")
    );
    app.assert_invariants().await;
}

/// PostgreSQL's generic plan of `sql` (parameters `types`), made on the
/// fresh database of `app` while `deliveries` is empty: the plan sqlx's
/// prepared statement keeps from its sixth execution until the next
/// `ANALYZE`. `args` are the parameters EXPLAIN executes it with.
async fn generic_plan_on_empty_tables(app: &TestApp, sql: &str, types: &str, args: &str) -> Value {
    let txn = app.db.reader().begin().await.unwrap();
    let n: i64 = txn
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT count(*) AS n FROM deliveries",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get("", "n")
        .unwrap();
    assert_eq!(n, 0, "a fresh database");
    txn.execute_unprepared(&format!(
        "SET LOCAL plan_cache_mode = force_generic_plan; PREPARE orbit_plan({types}) AS {sql}"
    ))
    .await
    .unwrap();
    let row = txn
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            format!("EXPLAIN (FORMAT JSON) EXECUTE orbit_plan({args})"),
        ))
        .await
        .unwrap()
        .unwrap();
    txn.execute_unprepared("DEALLOCATE orbit_plan")
        .await
        .unwrap();
    txn.rollback().await.unwrap();
    row.try_get_by_index(0).unwrap()
}

/// Decision 0104, PostgreSQL: the ACK batch statement takes its row locks
/// by primary-key lookups even in a plan made while `deliveries` is empty.
/// sqlx prepares it once per connection and PostgreSQL keeps the generic
/// plan it builds at the sixth execution until the next `ANALYZE`; when the
/// lock step was a semi join, that plan scanned the whole table on every
/// batch once the table had grown (9.4 ms at 7,000 rows).
#[actix_web::test]
async fn the_ack_batch_locks_its_rows_by_primary_key_in_a_plan_made_on_an_empty_table() {
    if skip_unless_backend("postgres", "generic plans are PostgreSQL's") {
        return;
    }
    let app = spawn_app().await;
    let plan = generic_plan_on_empty_tables(
        &app,
        orbit_events::store::ack::WRITE_ACKS,
        "text, text, text, text, bigint",
        "'a,b', '1,1', 's,s', 'c,c', 0",
    )
    .await;

    fn find<'a>(node: &'a Value, name: &str) -> Option<&'a Value> {
        if node["Subplan Name"] == name {
            return Some(node);
        }
        node["Plans"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|child| find(child, name))
    }
    let locked = find(&plan[0]["Plan"], "CTE locked")
        .unwrap_or_else(|| panic!("no lock step in the plan:\n{plan:#}"));
    // The sort is over the batch's ids, not the table.
    let path = hot(
        "ack batch (lock step)",
        orbit_events::store::ack::WRITE_ACKS,
    )
    .sort_ok();
    let (mut bad, mut indexes) = (Vec::new(), Vec::new());
    pg_violations(locked, &path, &mut bad, &mut indexes);
    assert!(
        bad.is_empty() && indexes == ["deliveries_pkey"],
        "the lock step reads deliveries by primary key only ({bad:?}, {indexes:?}):\n{plan:#}"
    );
}

/// Decision 0106, PostgreSQL: a claim counts its sessions' live leases
/// through `ix_deliveries_leased_session` even in a plan made while
/// `deliveries` is empty. Such a plan had read `ix_deliveries_leased_until`
/// above now, where every row ACKED since the last VACUUM keeps an entry
/// (4.3 ms, 2,008 heap pages at 36,334 entries in a benchmark run).
#[actix_web::test]
async fn a_claim_counts_live_leases_by_session_in_a_plan_made_on_an_empty_table() {
    if skip_unless_backend("postgres", "generic plans are PostgreSQL's") {
        return;
    }
    let app = spawn_app().await;
    let sql = orbit_events::store::claim::LIVE_LEASES;
    let plan = generic_plan_on_empty_tables(&app, sql, "text, bigint", "'a,b', 0").await;
    let path = hot("claim (held by the session)", sql);
    let (mut bad, mut indexes) = (Vec::new(), Vec::new());
    pg_violations(&plan[0]["Plan"], &path, &mut bad, &mut indexes);
    assert!(
        bad.is_empty() && indexes == ["ix_deliveries_leased_session"],
        "the count reads the sessions' index only ({bad:?}, {indexes:?}):\n{plan:#}"
    );
    // An index scan from `(session, now)`: a bitmap scan never marks the
    // entries of ACKED rows dead, and a range over the whole session would
    // walk them all.
    fn scans(node: &Value, out: &mut Vec<(String, String)>) {
        if node["Index Name"] == "ix_deliveries_leased_session" {
            out.push((
                node["Node Type"].as_str().unwrap_or_default().to_owned(),
                node["Index Cond"].as_str().unwrap_or_default().to_owned(),
            ));
        }
        for child in node["Plans"].as_array().into_iter().flatten() {
            scans(child, out);
        }
    }
    let mut found = Vec::new();
    scans(&plan[0]["Plan"], &mut found);
    assert!(
        matches!(found.as_slice(), [(node, cond)]
            if (node == "Index Scan" || node == "Index Only Scan") && cond.contains("lease_until")),
        "an index scan bounded by the session and now ({found:?}):\n{plan:#}"
    );
}

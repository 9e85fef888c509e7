//! PostgreSQL only: `orbit_publish_alone(…)`, a publish batch as one
//! statement committed as it ends (decision 0111). `orbit_publish_batch`
//! (migration 0110) ran between `BEGIN` and `COMMIT` because the node
//! decided two things after it: roll back when another transaction had
//! recorded one of the keys meanwhile, and leave out a request whose
//! deadline passed while the call waited for a lock. This function is
//! that one with both decided inside: a key recorded meanwhile raises
//! SQLSTATE 40001 (`serialization_failure`: the node runs it again, and
//! the next run answers from that record), and `p_lock_timeout_ms` > 0
//! bounds the call's lock waits together (`lock_timeout`, for this
//! transaction only, set before each statement that can wait to what is
//! left of the budget since the statement began; past it the call fails
//! with 55P03 and writes nothing). The node commits to its requests before
//! the call and passes the time left before the earliest of their
//! deadlines. Built from migration 0110's text by the checked edits below,
//! so that the two keep one body.

use sea_orm_migration::prelude::*;

use crate::m20261207_000110_publish_function::FUNCTION as BATCH;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// `(what 0110 says, what this function says instead)`.
const EDITS: [(&str, &str); 3] = [
    (
        "CREATE OR REPLACE FUNCTION orbit_publish_batch(\n  \
         p_requests jsonb, p_events jsonb, p_now bigint, p_expires_at bigint)",
        "CREATE OR REPLACE FUNCTION orbit_publish_alone(\n  \
         p_requests jsonb, p_events jsonb, p_now bigint, p_expires_at bigint, \
         p_lock_timeout_ms int)",
    ),
    (
        "  v_inserted bigint;\nBEGIN\n",
        "  v_inserted bigint;\n  v_budget text;\nBEGIN\n",
    ),
    (
        "  GET DIAGNOSTICS v_inserted = ROW_COUNT;\n",
        "  GET DIAGNOSTICS v_inserted = ROW_COUNT;\n  \
         IF v_inserted < coalesce(cardinality(array_positions(v_appended, true)), 0) THEN\n    \
         RAISE EXCEPTION USING ERRCODE = 'serialization_failure',\n      \
         MESSAGE = 'orbit_publish_alone: an idempotency key was recorded meanwhile';\n  \
         END IF;\n",
    ),
];

/// The statements of 0110's body that wait for locks: the expired records'
/// lock, each queue's counter update, the records' insert (a key another
/// transaction is inserting). Before each, [`LOCK_BUDGET`] is inserted at
/// the statement's indentation.
const LOCKING: [&str; 3] = [
    "  PERFORM 1 FROM idempotency_records r, unnest(a_creds, a_keys) AS u(c, k)\n",
    "    UPDATE queues SET head_sequence = head_sequence + v_total WHERE id = v_queue\n",
    "  INSERT INTO idempotency_records (id, credential_id, key, operation, target, \
     request_digest,\n",
];

/// What is left of the call's lock budget (`p_lock_timeout_ms` from the
/// statement's start, 1 ms at least) as `lock_timeout`, so that all lock
/// waits of the call together end by the earliest deadline.
const LOCK_BUDGET: &str = "IF p_lock_timeout_ms > 0 THEN\n\
     {i}  v_budget := set_config('lock_timeout', greatest(1, p_lock_timeout_ms - floor(\
     extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000)::int) || 'ms', \
     true);\n\
     {i}END IF;\n";

/// The function: migration 0110's text with [`EDITS`] applied and
/// [`LOCK_BUDGET`] before each of [`LOCKING`].
fn function() -> Result<String, DbErr> {
    let budgeted = LOCKING.iter().map(|statement| {
        let indent = &statement[..statement.len() - statement.trim_start().len()];
        (
            *statement,
            format!("{indent}{}{statement}", LOCK_BUDGET.replace("{i}", indent)),
        )
    });
    let edits = EDITS.iter().map(|&(from, to)| (from, to.to_owned()));
    crate::edited("0111", BATCH, edits.chain(budgeted))
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::on_postgres(manager, &function()?).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::on_postgres(
            manager,
            "DROP FUNCTION IF EXISTS orbit_publish_alone(jsonb, jsonb, bigint, bigint, int)",
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_edit_applies_to_migration_0110s_text() {
        let text = function().expect("an edit did not apply");
        assert!(text.contains("orbit_publish_alone("));
        assert!(!text.contains("orbit_publish_batch("));
        assert!(text.contains("serialization_failure"));
        assert_eq!(
            text.matches("v_budget := set_config('lock_timeout'")
                .count(),
            3
        );
    }
}

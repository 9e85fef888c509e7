//! PostgreSQL only: `orbit_publish_alone(…)`, a publish batch as one
//! statement committed as it ends (decision 0111). `orbit_publish_batch`
//! (migration 0110) ran between `BEGIN` and `COMMIT` because the node
//! decided two things after it: roll back when another transaction had
//! recorded one of the keys meanwhile, and leave out a request whose
//! deadline passed while the call waited for a lock. This function is
//! that one with both decided inside: a key recorded meanwhile raises
//! SQLSTATE 40001 (`serialization_failure`: the node runs it again, and
//! the next run answers from that record), and `p_lock_timeout_ms` > 0
//! bounds each lock wait (`lock_timeout` for this transaction only; past
//! it the call fails with 55P03 and writes nothing). The node commits to
//! its requests before the call and passes the time left before the
//! earliest of their deadlines. Built from migration 0110's text by the
//! three edits below, so that the two keep one body.

use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

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
        "  v_inserted bigint;\nBEGIN\n  IF p_lock_timeout_ms > 0 THEN\n    \
         PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);\n  END IF;\n",
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

/// The function: migration 0110's text with [`EDITS`] applied.
fn function() -> Result<String, DbErr> {
    let mut text = BATCH.to_owned();
    for (from, to) in EDITS {
        if !text.contains(from) {
            return Err(DbErr::Migration(format!(
                "migration 0111: migration 0110's function lacks {from:?}"
            )));
        }
        text = text.replacen(from, to, 1);
    }
    Ok(text)
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared(&function()?).await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared(
            "DROP FUNCTION IF EXISTS orbit_publish_alone(jsonb, jsonb, bigint, bigint, int)",
        )
        .await?;
        Ok(())
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
    }
}

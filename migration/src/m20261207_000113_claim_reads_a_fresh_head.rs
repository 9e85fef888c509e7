//! PostgreSQL only: `orbit_claim_batch(…)` of migration 0112 with one
//! statement added back (decision 0112, amended). 0112 locked the
//! subscription's row and read its queue's head in one statement; that
//! statement's snapshot is taken before it waits for the subscription's
//! row, and its key-share lock on the queue's row does not refresh a row
//! whose key did not change. A claim that waited (another node
//! materializing) could read a head older than the one committed: it then
//! materialized less than it could and reported the subscription caught
//! up. Migration 0108 read the queue in a statement of its own after the
//! lock, with a fresh snapshot; this does again. Built from 0112's text by
//! the checked edits below. Found by a helper's review.

use sea_orm_migration::prelude::*;

use crate::m20261207_000112_lean_claim_function::function as lean;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// `(what 0112 says, what this function says instead)`.
const EDITS: [(&str, &str); 2] = [
    (
        "      locked := FOUND;\n",
        "      locked := FOUND;\n      \
         -- The queue's position as committed now, read after the lock.\n      \
         IF locked THEN\n        \
         SELECT q.head_sequence, q.retention_floor INTO m_head, m_floor\n          \
         FROM queues q WHERE q.id = srow.queue_id;\n      \
         END IF;\n",
    ),
    (
        "        m_head := srow.head_sequence;\n        m_floor := srow.retention_floor;\n",
        "",
    ),
];

/// The function: migration 0112's text with [`EDITS`] applied.
fn function() -> Result<String, DbErr> {
    let edits = EDITS.iter().map(|&(from, to)| (from, to.to_owned()));
    crate::edited("0113", &lean(), edits)
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::on_postgres(manager, &function()?).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // Migration 0112's function again.
        crate::m20261207_000112_lean_claim_function::Migration
            .up(manager)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_edit_applies_to_migration_0112s_text() {
        let text = function().expect("an edit did not apply");
        assert!(text.contains("INTO m_head, m_floor"));
        assert!(!text.contains("m_head := srow.head_sequence"));
    }
}

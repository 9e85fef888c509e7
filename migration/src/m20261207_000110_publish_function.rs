//! PostgreSQL only: `orbit_publish_batch(…)`, the statements of a publish
//! batch in one call (decision 0110). The node's publish transaction ran
//! five statements between `BEGIN` and `COMMIT`, each a round trip: the
//! expired idempotency records' `DELETE`, the live records' `SELECT`, the
//! queue counter's `UPDATE`, the events' `INSERT` and the records'
//! `INSERT`. The rules are those of `src/store/publish.rs`,
//! `src/journal.rs` (`append_many`) and `src/store/idempotency.rs`
//! (http-api.md §2, delivery-model.md §3); the event and record ids come
//! from the node.

use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

#[derive(DeriveMigrationName)]
pub struct Migration;

pub(crate) const FUNCTION: &str = r#"
-- A batch of publish requests, each the first of its key in the batch.
-- p_requests: a JSON list (jsonb: parsed once, its fields read cheaply), request i (from 1) is [credential id, key,
-- operation, target, request digest, record id, queue id, result count].
-- p_events: a JSON list, each [i, offset within request i (from 0), event
-- id, type, aggregate id, aggregate revision, occurred at, details,
-- snapshot]; details and snapshot are the stored texts, byte for byte.
-- Rows, by o_kind:
--   'record': the live record under request i's key (r_*); nothing of
--     request i is written;
--   'appended': request i's results have the sequences from o_sequence
--     on, in order (NULL: it had none), and its record was written with
--     the others;
--   'missing': request i's queue does not exist; nothing written;
--   'records': o_sequence records inserted (fewer than 'appended' rows:
--     another transaction recorded a key meanwhile, and the caller must
--     not commit).
CREATE OR REPLACE FUNCTION orbit_publish_batch(
  p_requests jsonb, p_events jsonb, p_now bigint, p_expires_at bigint)
RETURNS TABLE (
  o_kind text, o_i int, o_sequence bigint,
  r_id text, r_credential_id text, r_key text, r_operation text, r_target text,
  r_request_digest text, r_status int, r_response text, r_expires_at bigint,
  r_created_at bigint)
-- Every statement reads by an index, in a generic plan made once per
-- connection (as orbit_claim_batch, decision 0108).
LANGUAGE plpgsql SET enable_seqscan = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
  a_creds text[];
  a_keys text[];
  a_ops text[];
  a_targets text[];
  a_digests text[];
  a_record_ids text[];
  a_queues text[];
  a_counts bigint[];
  e_req int[];
  e_off bigint[];
  e_ids text[];
  e_types text[];
  e_aggregates text[];
  e_revisions text[];
  e_occurred bigint[];
  e_details text[];
  e_snapshots text[];
  v_n int;
  v_live boolean[];
  v_appended boolean[];
  v_bases bigint[];
  v_responses text[];
  v_queue text;
  v_total bigint;
  v_head bigint;
  v_next bigint;
  v_i int;
  v_k int;
  v_row record;
  v_inserted bigint;
BEGIN
  SELECT array_agg(r.v->>0 ORDER BY r.i), array_agg(r.v->>1 ORDER BY r.i),
         array_agg(r.v->>2 ORDER BY r.i), array_agg(r.v->>3 ORDER BY r.i),
         array_agg(r.v->>4 ORDER BY r.i), array_agg(r.v->>5 ORDER BY r.i),
         array_agg(r.v->>6 ORDER BY r.i), array_agg((r.v->>7)::bigint ORDER BY r.i)
    INTO a_creds, a_keys, a_ops, a_targets, a_digests, a_record_ids, a_queues, a_counts
    FROM jsonb_array_elements(p_requests) WITH ORDINALITY AS r(v, i);
  v_n := coalesce(cardinality(a_creds), 0);
  IF v_n = 0 THEN RETURN; END IF;
  SELECT array_agg((e.v->>0)::int ORDER BY e.o), array_agg((e.v->>1)::bigint ORDER BY e.o),
         array_agg(e.v->>2 ORDER BY e.o), array_agg(e.v->>3 ORDER BY e.o),
         array_agg(e.v->>4 ORDER BY e.o), array_agg(e.v->>5 ORDER BY e.o),
         array_agg((e.v->>6)::bigint ORDER BY e.o), array_agg(e.v->>7 ORDER BY e.o),
         array_agg(e.v->>8 ORDER BY e.o)
    INTO e_req, e_off, e_ids, e_types, e_aggregates, e_revisions, e_occurred, e_details,
         e_snapshots
    FROM jsonb_array_elements(p_events) WITH ORDINALITY AS e(v, o);
  v_live := array_fill(false, ARRAY[v_n]);
  v_appended := array_fill(false, ARRAY[v_n]);
  v_bases := array_fill(NULL::bigint, ARRAY[v_n]);
  v_responses := array_fill(NULL::text, ARRAY[v_n]);

  -- An expired record binds its key no more; a live one answers its
  -- request (a replay or a conflict, decided by the node). The expired
  -- rows are locked first in (credential, key) order, as the records are
  -- inserted: a delete joined in request order could lock them in another
  -- batch's opposite order and deadlock with it.
  PERFORM 1 FROM idempotency_records r, unnest(a_creds, a_keys) AS u(c, k)
    WHERE r.credential_id = u.c AND r.key = u.k AND r.expires_at <= p_now
    ORDER BY r.credential_id COLLATE "C", r.key COLLATE "C"
    FOR UPDATE OF r;
  DELETE FROM idempotency_records r USING unnest(a_creds, a_keys) AS u(c, k)
   WHERE r.credential_id = u.c AND r.key = u.k AND r.expires_at <= p_now;
  FOR v_row IN
    SELECT u.i::int AS i, r.* FROM unnest(a_creds, a_keys) WITH ORDINALITY AS u(c, k, i)
      JOIN idempotency_records r ON r.credential_id = u.c AND r.key = u.k
  LOOP
    v_live[v_row.i] := true;
    o_kind := 'record'; o_i := v_row.i; o_sequence := NULL;
    r_id := v_row.id; r_credential_id := v_row.credential_id; r_key := v_row.key;
    r_operation := v_row.operation; r_target := v_row.target;
    r_request_digest := v_row.request_digest; r_status := v_row.status;
    r_response := v_row.response; r_expires_at := v_row.expires_at;
    r_created_at := v_row.created_at;
    RETURN NEXT;
  END LOOP;
  o_sequence := NULL; r_id := NULL; r_credential_id := NULL; r_key := NULL;
  r_operation := NULL; r_target := NULL; r_request_digest := NULL; r_status := NULL;
  r_response := NULL; r_expires_at := NULL; r_created_at := NULL;

  -- One counter update per queue, in queue id order (two batches never
  -- wait on each other in a cycle); sequences in request order.
  FOR v_queue, v_total IN
    SELECT u.q, sum(u.n) FROM unnest(a_queues, a_counts, v_live) AS u(q, n, l)
     WHERE NOT u.l AND u.n > 0 GROUP BY u.q ORDER BY u.q COLLATE "C"
  LOOP
    UPDATE queues SET head_sequence = head_sequence + v_total WHERE id = v_queue
    RETURNING head_sequence INTO v_head;
    IF FOUND THEN
      v_next := v_head - v_total + 1;
      FOR v_i IN 1..v_n LOOP
        IF a_queues[v_i] = v_queue AND NOT v_live[v_i] AND a_counts[v_i] > 0 THEN
          v_bases[v_i] := v_next;
          v_appended[v_i] := true;
          v_next := v_next + a_counts[v_i];
        END IF;
      END LOOP;
    END IF;
  END LOOP;
  FOR v_i IN 1..v_n LOOP
    IF NOT v_live[v_i] AND a_counts[v_i] = 0 THEN v_appended[v_i] := true; END IF;
  END LOOP;

  INSERT INTO result_events (id, queue_id, sequence, type, aggregate_kind, aggregate_id,
                             aggregate_revision, occurred_at, details, snapshot, appended_at,
                             created_at)
  SELECT u.id, a_queues[u.req], v_bases[u.req] + u.ofs, u.ty, 'task', u.aggregate,
         u.revision, u.occurred, u.details, u.snapshot, p_now, p_now
    FROM unnest(e_req, e_off, e_ids, e_types, e_aggregates, e_revisions, e_occurred,
                e_details, e_snapshots)
         AS u(req, ofs, id, ty, aggregate, revision, occurred, details, snapshot)
   WHERE v_bases[u.req] IS NOT NULL;

  -- Each appended request's answer, as the node renders it
  -- (`PublishResult`): its events' ids and sequences in request order.
  FOR v_k IN 1..coalesce(cardinality(e_req), 0) LOOP
    v_i := e_req[v_k];
    IF v_bases[v_i] IS NOT NULL THEN
      v_responses[v_i] := coalesce(v_responses[v_i] || ',', '')
        || '{"id":"' || e_ids[v_k] || '","sequence":"' || (v_bases[v_i] + e_off[v_k]) || '"}';
    END IF;
  END LOOP;
  INSERT INTO idempotency_records (id, credential_id, key, operation, target, request_digest,
                                   status, response, expires_at, created_at)
  SELECT a_record_ids[g.i], a_creds[g.i], a_keys[g.i], a_ops[g.i], a_targets[g.i],
         a_digests[g.i], 201,
         '{"events":[' || coalesce(v_responses[g.i], '') || '],"deduplicated":false}',
         p_expires_at, p_now
    FROM generate_series(1, v_n) AS g(i)
   WHERE v_appended[g.i]
   ORDER BY a_creds[g.i] COLLATE "C", a_keys[g.i] COLLATE "C"
  ON CONFLICT (credential_id, key) DO NOTHING;
  GET DIAGNOSTICS v_inserted = ROW_COUNT;

  FOR v_i IN 1..v_n LOOP
    IF v_appended[v_i] THEN
      o_kind := 'appended'; o_i := v_i; o_sequence := v_bases[v_i]; RETURN NEXT;
    ELSIF NOT v_live[v_i] THEN
      o_kind := 'missing'; o_i := v_i; o_sequence := NULL; RETURN NEXT;
    END IF;
  END LOOP;
  o_kind := 'records'; o_i := NULL; o_sequence := v_inserted;
  RETURN NEXT;
END $$;
"#;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared(FUNCTION).await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared(
            "DROP FUNCTION IF EXISTS orbit_publish_batch(jsonb, jsonb, bigint, bigint)",
        )
        .await?;
        Ok(())
    }
}

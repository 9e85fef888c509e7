//! PostgreSQL only: `orbit_events.append_result(queue_id, result,
//! idempotency_key)`, the transactional outbox for producers in any
//! language (decision 0087, docs/outbox.md). It checks a result by the
//! rules of `POST …/results`, appends it under the queue's head row lock
//! (commit order = sequence order) and queues a `NOTIFY` for the commit.
//! `SECURITY DEFINER`: a producer role needs only `USAGE` on the schema and
//! `EXECUTE` on the function, no right on the service's tables.

use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// The function body; `{schema}` is the service's schema, fixed in the
/// function's `search_path` so a caller's path cannot redirect it.
const FUNCTIONS: &str = r#"
CREATE SCHEMA IF NOT EXISTS orbit_events;

CREATE OR REPLACE FUNCTION orbit_events.refuse(code text, message text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  -- The SQLSTATE says the class, the message starts with the spec's code.
  RAISE EXCEPTION '%: %', code, message USING ERRCODE = CASE code
    WHEN 'NOT_FOUND' THEN 'P0002'
    WHEN 'IDEMPOTENCY_CONFLICT' THEN '23505'
    ELSE '22023' END;
END $$;

CREATE OR REPLACE FUNCTION orbit_events.has_duplicate_keys(doc json)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  k text;
  v json;
BEGIN
  IF json_typeof(doc) = 'object' THEN
    IF (SELECT count(*) <> count(DISTINCT key) FROM json_object_keys(doc) AS key) THEN
      RETURN true;
    END IF;
    FOR k, v IN SELECT * FROM json_each(doc) LOOP
      IF orbit_events.has_duplicate_keys(v) THEN RETURN true; END IF;
    END LOOP;
  ELSIF json_typeof(doc) = 'array' THEN
    FOR v IN SELECT * FROM json_array_elements(doc) LOOP
      IF orbit_events.has_duplicate_keys(v) THEN RETURN true; END IF;
    END LOOP;
  END IF;
  RETURN false;
END $$;

CREATE OR REPLACE FUNCTION orbit_events.append_result(
  queue_id text, result text, idempotency_key text DEFAULT NULL)
RETURNS TABLE (event_id text, sequence bigint, deduplicated boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
DECLARE
  doc json;
  snap json;
  rtype text;
  state text;
  at_micros bigint;
  now_micros bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
  digest text := encode(sha256(convert_to(result, 'UTF8')), 'hex');
  rec record;
  new_id text;
  seq bigint;
  allowed text[] := ARRAY['type','aggregate_id','aggregate_revision','occurred_at','details','snapshot'];
  snap_allowed text[] := ARRAY['schema_version','task_id','queue_id','state','revision',
                               'effect_uncertain','result','current_attempt_id'];
  snap_required text[] := ARRAY['schema_version','task_id','queue_id','state','revision','effect_uncertain'];
  k text;
BEGIN
  IF queue_id IS NULL OR queue_id !~ '^[0-9a-f]{32}$' THEN
    PERFORM orbit_events.refuse('NOT_FOUND', 'queue not found');
  END IF;
  BEGIN
    doc := result::json;
  EXCEPTION WHEN others THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result: not a JSON document');
  END;
  IF doc IS NULL OR json_typeof(doc) <> 'object' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result: must be a JSON object');
  END IF;
  IF orbit_events.has_duplicate_keys(doc) THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result: a key appears twice in one object');
  END IF;
  FOR k IN SELECT json_object_keys(doc) LOOP
    IF NOT k = ANY (allowed) THEN
      PERFORM orbit_events.refuse('INVALID_ARGUMENT', format('result.%s: unknown field', k));
    END IF;
  END LOOP;
  FOREACH k IN ARRAY allowed LOOP
    IF doc -> k IS NULL THEN
      PERFORM orbit_events.refuse('INVALID_ARGUMENT', format('result.%s: missing field', k));
    END IF;
  END LOOP;
  rtype := CASE WHEN json_typeof(doc -> 'type') = 'string' THEN doc ->> 'type' END;
  state := CASE rtype WHEN 'task.succeeded' THEN 'SUCCEEDED' WHEN 'task.failed' THEN 'FAILED'
                      WHEN 'task.cancelled' THEN 'CANCELLED' WHEN 'task.needs_review' THEN 'NEEDS_REVIEW' END;
  IF state IS NULL THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT',
      'result.type: must be task.succeeded, task.failed, task.cancelled or task.needs_review');
  END IF;
  IF json_typeof(doc -> 'aggregate_id') <> 'string' OR doc ->> 'aggregate_id' !~ '^[0-9a-f]{32}$' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.aggregate_id: must be 32 lowercase hex characters');
  END IF;
  IF json_typeof(doc -> 'aggregate_revision') <> 'string'
     OR doc ->> 'aggregate_revision' !~ '^(0|[1-9][0-9]{0,19})$'
     OR (doc ->> 'aggregate_revision')::numeric > 18446744073709551615 THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT',
      'result.aggregate_revision: must be a canonical uint64 decimal string');
  END IF;
  IF json_typeof(doc -> 'occurred_at') <> 'string'
     OR doc ->> 'occurred_at' !~ '^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.occurred_at: must be an RFC 3339 time');
  END IF;
  IF substring(doc ->> 'occurred_at' FROM '\.\d{7,}') !~ '^\.\d{6}0*$' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.occurred_at: must have at most microsecond precision');
  END IF;
  BEGIN
    at_micros := (extract(epoch FROM (doc ->> 'occurred_at')::timestamptz) * 1000000)::bigint;
  EXCEPTION WHEN others THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.occurred_at: must be an RFC 3339 time');
  END;
  IF json_typeof(doc -> 'details') <> 'object' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.details: must be a JSON object');
  END IF;
  snap := doc -> 'snapshot';
  IF json_typeof(snap) <> 'object' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.snapshot: must be a JSON object');
  END IF;
  FOR k IN SELECT json_object_keys(snap) LOOP
    IF NOT k = ANY (snap_allowed) THEN
      PERFORM orbit_events.refuse('INVALID_ARGUMENT', format('result.snapshot.%s: unknown field', k));
    END IF;
  END LOOP;
  FOREACH k IN ARRAY snap_required LOOP
    IF snap -> k IS NULL THEN
      PERFORM orbit_events.refuse('INVALID_ARGUMENT', format('result.snapshot.%s: missing field', k));
    END IF;
  END LOOP;
  IF json_typeof(snap -> 'schema_version') <> 'number' OR (snap -> 'schema_version')::text <> '1' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.snapshot.schema_version: must be 1');
  END IF;
  IF json_typeof(snap -> 'task_id') <> 'string' OR snap ->> 'task_id' <> doc ->> 'aggregate_id' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.snapshot.task_id: must equal aggregate_id');
  END IF;
  IF json_typeof(snap -> 'queue_id') <> 'string' OR snap ->> 'queue_id' <> queue_id THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.snapshot.queue_id: must equal the queue in the path');
  END IF;
  IF json_typeof(snap -> 'revision') <> 'string' OR snap ->> 'revision' <> doc ->> 'aggregate_revision' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.snapshot.revision: must equal aggregate_revision');
  END IF;
  IF json_typeof(snap -> 'state') <> 'string' OR snap ->> 'state' <> state THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT',
      format('result.snapshot.state: must be %s for %s', state, rtype));
  END IF;
  IF json_typeof(snap -> 'effect_uncertain') <> 'boolean' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'result.snapshot.effect_uncertain: must be a boolean');
  END IF;
  IF snap -> 'current_attempt_id' IS NOT NULL AND (json_typeof(snap -> 'current_attempt_id') <> 'string'
     OR snap ->> 'current_attempt_id' !~ '^[0-9a-f]{32}$') THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT',
      'result.snapshot.current_attempt_id: must be 32 lowercase hex characters');
  END IF;
  IF idempotency_key IS NOT NULL AND idempotency_key !~ '^[!-~]{1,255}$' THEN
    PERFORM orbit_events.refuse('INVALID_ARGUMENT', 'idempotency_key: must be 1-255 visible ASCII characters');
  END IF;

  IF idempotency_key IS NOT NULL THEN
    -- Keys are scoped to the queue (its id in the credential column).
    DELETE FROM idempotency_records r
     WHERE r.credential_id = append_result.queue_id AND r.key = idempotency_key AND r.expires_at <= now_micros;
    INSERT INTO idempotency_records (id, credential_id, key, operation, target, request_digest,
                                     status, response, expires_at, created_at)
    VALUES (replace(gen_random_uuid()::text, '-', ''), append_result.queue_id, idempotency_key,
            'outbox.append_result', append_result.queue_id, digest, 0, '',
            now_micros + 604800000000, now_micros)
    ON CONFLICT (credential_id, key) DO NOTHING;
    IF NOT FOUND THEN
      SELECT * INTO rec FROM idempotency_records r
       WHERE r.credential_id = append_result.queue_id AND r.key = idempotency_key;
      IF rec.operation = 'outbox.append_result' AND rec.request_digest = digest AND rec.status <> 0 THEN
        RETURN QUERY SELECT (rec.response::json) ->> 'event_id',
                            ((rec.response::json) ->> 'sequence')::bigint, true;
        RETURN;
      END IF;
      PERFORM orbit_events.refuse('IDEMPOTENCY_CONFLICT',
        'this idempotency key was used for another result');
    END IF;
  END IF;

  UPDATE queues q SET head_sequence = q.head_sequence + 1
   WHERE q.id = append_result.queue_id RETURNING q.head_sequence INTO seq;
  IF seq IS NULL THEN
    PERFORM orbit_events.refuse('NOT_FOUND', 'queue not found');
  END IF;
  -- Insert-ordered like the node's ids: milliseconds first.
  new_id := lpad(to_hex((now_micros / 1000)::bigint), 12, '0')
            || substr(replace(gen_random_uuid()::text, '-', ''), 13, 20);
  INSERT INTO result_events (id, queue_id, sequence, type, aggregate_kind, aggregate_id,
                             aggregate_revision, occurred_at, details, snapshot, appended_at, created_at)
  VALUES (new_id, append_result.queue_id, seq, rtype, 'task', doc ->> 'aggregate_id',
          doc ->> 'aggregate_revision', at_micros, (doc -> 'details')::text, (snap)::text,
          now_micros, now_micros);
  IF idempotency_key IS NOT NULL THEN
    UPDATE idempotency_records r
       SET status = 201, response = json_build_object('event_id', new_id, 'sequence', seq::text)::text
     WHERE r.credential_id = append_result.queue_id AND r.key = idempotency_key;
  END IF;
  -- Sent at commit, dropped on rollback: every node wakes at once.
  PERFORM pg_notify('orbit_events', format('journal %s -', append_result.queue_id));
  RETURN QUERY SELECT new_id, seq, false;
END $$;

REVOKE ALL ON FUNCTION orbit_events.append_result(text, text, text) FROM PUBLIC;
"#;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        let schema = db
            .query_one_raw(sea_orm_migration::sea_orm::Statement::from_string(
                DbBackend::Postgres,
                "SELECT quote_ident(current_schema())".to_owned(),
            ))
            .await?
            .map(|row| row.try_get_by_index::<String>(0))
            .transpose()?
            .unwrap_or_else(|| "public".to_owned());
        db.execute_unprepared(&FUNCTIONS.replace("{schema}", &schema))
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared("DROP SCHEMA IF EXISTS orbit_events CASCADE")
            .await?;
        Ok(())
    }
}

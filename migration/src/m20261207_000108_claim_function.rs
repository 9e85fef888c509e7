//! PostgreSQL only: `orbit_claim_batch(…)`, a batch of claims in one
//! statement (decision 0108). The node's claim on PostgreSQL was twelve
//! statements between `BEGIN` and `COMMIT`, each a round trip; the function
//! runs the same steps in the server, in the caller's transaction, and
//! returns what the node needs to answer each claim. The rules are those of
//! `src/store/claim.rs` and `src/store/materialize.rs` (delivery-model.md
//! §5, §6); the lease secrets and the delivery ids come from the node.

use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// The delivery columns of a returned row, from the record `{r}`.
pub(crate) const DELIVERY: &str = "{r}.id::text, {r}.subscription_id::text, {r}.event_id::text, \
    {r}.sequence, {r}.revision, {r}.state::text, {r}.available_at, {r}.lease_epoch, \
    {r}.leased_at, {r}.lease_until, {r}.lease_digest::text, {r}.lease_session_id::text, \
    {r}.attempts, {r}.attempt_budget, {r}.acknowledged_at, {r}.ack_epoch, \
    {r}.ack_session_id::text, {r}.created_at";

/// A returned row's columns that no delivery fills.
pub(crate) const NO_DELIVERY: &str = "NULL::text, NULL::text, NULL::text, NULL::bigint, NULL::bigint, \
    NULL::text, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::text, NULL::text, \
    NULL::int, NULL::int, NULL::bigint, NULL::bigint, NULL::text, NULL::bigint";

/// A returned row's columns that no event fills.
pub(crate) const NO_EVENT: &str = "NULL::text, NULL::bigint, NULL::text, NULL::text, NULL::text, \
    NULL::text, NULL::bigint, NULL::text, NULL::text";

/// The functions; `{DELIVERY:x}` stands for [`DELIVERY`] of record `x`.
const FUNCTIONS: &str = r#"
-- Leases up to cardinality(p_sessions) claimable rows of the subscription,
-- the n-th picked in (sequence, id) order to p_sessions[n] with the digest
-- p_digests[n]. The picked rows are materialized once: a plan that scanned
-- them again (SKIP LOCKED) could rank other rows the second time.
CREATE OR REPLACE FUNCTION orbit_claim_pick(
  p_subscription text, p_sessions text[], p_digests text[], p_now bigint, p_lease_until bigint)
RETURNS SETOF deliveries LANGUAGE plpgsql AS $$
BEGIN
  RETURN QUERY
  WITH picked AS MATERIALIZED (
    SELECT c.id AS picked_id, row_number() OVER (ORDER BY c.sequence, c.id) AS picked_rank
      FROM (SELECT d.id, d.sequence FROM deliveries d
             WHERE d.subscription_id = p_subscription AND d.state = 'PENDING'
               AND d.available_at <= p_now AND d.attempts < d.attempt_budget
             ORDER BY d.sequence, d.id LIMIT cardinality(p_sessions)
             FOR UPDATE SKIP LOCKED) AS c)
  UPDATE deliveries d
     SET state = 'LEASED', lease_epoch = d.lease_epoch + 1, attempts = d.attempts + 1,
         revision = d.revision + 1, leased_at = p_now, lease_until = p_lease_until,
         lease_session_id = a.session_id, lease_digest = a.digest
    FROM picked
    JOIN unnest(p_sessions, p_digests) WITH ORDINALITY AS a(session_id, digest, rank)
      ON a.rank = picked.picked_rank
   WHERE d.id = picked.picked_id AND d.state = 'PENDING'
  RETURNING d.*;
END $$;

-- A batch of claims (decision 0108). Claim i is (p_credentials[i],
-- p_subscriptions[i], p_sessions[i], p_wants[i], p_capacities[i]); the
-- lists are comma-joined. p_digests and p_ids hold at least sum(p_wants)
-- lease digests and delivery ids, used in order. Rows, by o_kind:
--   'claim' (one per claim, o_k = i): o_code revoked | gone | paused |
--     history_expired (o_n1 the earliest sequence) | open (o_n1 its take);
--   'lapsed': a lapsed lease this batch recovered (d_*, the row after);
--   'leased': a row leased to claim o_k (d_*);
--   'subscription' (one per subscription with an open claim, o_sub, its
--     queue in o_code):
--     o_flags 1 behind the head after this transaction, 2 materialized,
--     4 more, 8 idle, 16 caught up, 32 window full; o_n1 inserted,
--     o_n2 the cursor found under the row lock, o_n3 refill_after,
--     o_n4 the earliest sequence of a history gap;
--   'event': an event of a leased row (e_*).
CREATE OR REPLACE FUNCTION orbit_claim_batch(
  p_credentials text, p_subscriptions text, p_sessions text, p_wants text,
  p_capacities text, p_digests text, p_ids text,
  p_now bigint, p_lease_until bigint, p_batch int)
RETURNS TABLE (
  o_kind text, o_k int, o_code text, o_sub text, o_flags int,
  o_n1 bigint, o_n2 bigint, o_n3 bigint, o_n4 bigint,
  d_id text, d_subscription_id text, d_event_id text, d_sequence bigint, d_revision bigint,
  d_state text, d_available_at bigint, d_lease_epoch bigint, d_leased_at bigint,
  d_lease_until bigint, d_lease_digest text, d_lease_session_id text, d_attempts int,
  d_attempt_budget int, d_acknowledged_at bigint, d_ack_epoch bigint,
  d_ack_session_id text, d_created_at bigint,
  e_id text, e_sequence bigint, e_type text, e_aggregate_kind text, e_aggregate_id text,
  e_aggregate_revision text, e_occurred_at bigint, e_details text, e_snapshot text)
-- Every statement here reads by an index, in a generic plan made once per
-- connection. Left to itself PostgreSQL planned some statements again on
-- every call (a custom plan looked cheaper: 0.1 ms for the recovery), and
-- a generic plan made while a table was small (a fresh database, before
-- its first ANALYZE) kept a sequential scan as the table grew (the event
-- read: 2.2 ms a call at 10,000 events).
LANGUAGE plpgsql SET enable_seqscan = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
  credentials text[] := string_to_array(p_credentials, ',');
  subs text[] := string_to_array(p_subscriptions, ',');
  sessions text[] := string_to_array(p_sessions, ',');
  wants int[] := string_to_array(p_wants, ',')::int[];
  capacities int[] := string_to_array(p_capacities, ',')::int[];
  digests text[] := string_to_array(p_digests, ',');
  ids text[] := string_to_array(p_ids, ',');
  n int := coalesce(cardinality(sessions), 0);
  codes text[] := array_fill(NULL::text, ARRAY[n]);
  numbers bigint[] := array_fill(NULL::bigint, ARRAY[n]);
  cursors bigint[] := array_fill(0::bigint, ARRAY[n]);
  heads bigint[] := array_fill(0::bigint, ARRAY[n]);
  queue_ids text[] := array_fill(NULL::text, ARRAY[n]);
  queue_read text;
  open_subs text[] := '{}';
  seen_sessions text[] := '{}';
  busy int[] := '{}';
  leased deliveries[] := '{}';
  leased_k int[] := '{}';
  event_ids text[] := '{}';
  sub_ids text[] := '{}';
  sub_queues text[] := '{}';
  sub_flags int[] := '{}';
  sub_n1 bigint[] := '{}';
  sub_n2 bigint[] := '{}';
  sub_n3 bigint[] := '{}';
  sub_n4 bigint[] := '{}';
  next_digest int := 1;
  next_id int := 1;
  i int;
  j int;
  chk record;
  held bigint;
  sub text;
  slot_k int[];
  slot_sessions text[];
  slot_digests text[];
  slots int;
  filled int;
  cursor_read bigint;
  head_read bigint;
  behind boolean;
  flags int;
  inserted bigint;
  found_cursor bigint;
  refill bigint;
  gap bigint;
  srow subscriptions%ROWTYPE;
  t bigint;
  m_head bigint;
  m_floor bigint;
  folded bigint;
  pending bigint;
  room bigint;
  types text[];
  m_cursor bigint;
  entries int;
  stopped_for_slots boolean;
  stopped_for_room boolean;
  ins_ids text[];
  ins_events text[];
  ins_sequences bigint[];
  ins_slots int[];
  e record;
  rec deliveries%ROWTYPE;
BEGIN
  -- Each claim checked as if alone: its credential, then its subscription
  -- (in scope, enabled, no history gap), all read in one statement, so
  -- every claim of the batch sees the same commits. A scope is a JSON list
  -- of queue ids; anything else scopes nothing.
  FOR chk IN
    SELECT u.i::int AS i, c.id IS NOT NULL AS credential_ok, s.id IS NOT NULL AS found,
           c.queue_scope::jsonb AS scope, s.queue_id::text AS queue_id, s.enabled,
           s.cursor_sequence, q.head_sequence, q.retention_floor
      FROM unnest(credentials, subs) WITH ORDINALITY AS u(credential_id, subscription_id, i)
      LEFT JOIN credentials c ON c.id = u.credential_id AND c.revoked_at IS NULL
      LEFT JOIN subscriptions s ON s.id = u.subscription_id
      LEFT JOIN queues q ON q.id = s.queue_id
  LOOP
    i := chk.i;
    IF NOT chk.credential_ok THEN codes[i] := 'revoked'; CONTINUE; END IF;
    IF NOT chk.found OR jsonb_typeof(chk.scope) <> 'array'
       OR EXISTS (SELECT 1 FROM jsonb_array_elements(chk.scope) AS x(v)
                   WHERE jsonb_typeof(x.v) <> 'string')
       OR NOT chk.scope ? chk.queue_id THEN
      codes[i] := 'gone'; CONTINUE;
    END IF;
    IF NOT chk.enabled THEN codes[i] := 'paused'; CONTINUE; END IF;
    IF chk.head_sequence IS NOT NULL AND chk.cursor_sequence < chk.retention_floor THEN
      codes[i] := 'history_expired'; numbers[i] := greatest(chk.retention_floor, 0) + 1; CONTINUE;
    END IF;
    codes[i] := 'open';
    cursors[i] := chk.cursor_sequence;
    heads[i] := coalesce(chk.head_sequence, 0);
    queue_ids[i] := chk.queue_id;
    IF NOT subs[i] = ANY(open_subs) THEN open_subs := open_subs || subs[i]; END IF;
  END LOOP;

  IF cardinality(open_subs) > 0 THEN
    -- The open subscriptions' lapsed leases: PENDING again, or EXPIRED at
    -- the attempt budget, each recorded in the history. An expression,
    -- not the column: the lapsed range of ix_deliveries_leased_until is
    -- read, not every live lease of the subscriptions (decision 0093).
    RETURN QUERY
    WITH r AS (
      UPDATE deliveries d SET revision = d.revision + 1,
             state = CASE WHEN d.attempts < d.attempt_budget THEN 'PENDING' ELSE 'EXPIRED' END,
             available_at = CASE WHEN d.attempts < d.attempt_budget
                                 THEN d.lease_until ELSE d.available_at END
       WHERE d.state = 'LEASED' AND d.lease_until <= p_now
         AND coalesce(d.subscription_id, '') = ANY(open_subs)
      RETURNING d.*),
    h AS (
      INSERT INTO delivery_history (delivery_id, step, at, lease_epoch, session_id, leased_at,
                                    lease_until, state_after, attempts, attempt_budget)
      SELECT r.id, 'LEASE_LAPSED', p_now, r.lease_epoch, r.lease_session_id, r.leased_at,
             r.lease_until, r.state, r.attempts, r.attempt_budget FROM r)
    SELECT 'lapsed'::text, NULL::int, NULL::text, NULL::text, NULL::int, NULL::bigint,
           NULL::bigint, NULL::bigint, NULL::bigint, {DELIVERY:r}, {NO_EVENT} FROM r;

    -- min(want, capacity - live leases), a session met twice also
    -- counting what its earlier claim takes. The row comparison keeps the
    -- count on ix_deliveries_leased_session (decision 0106).
    FOR i IN 1 .. n LOOP
      CONTINUE WHEN codes[i] <> 'open';
      j := array_position(seen_sessions, sessions[i]);
      IF j IS NULL THEN
        SELECT count(*) INTO held FROM deliveries d
         WHERE d.lease_session_id = sessions[i] AND d.state = 'LEASED'
           AND (d.lease_session_id, d.lease_until) > (sessions[i], p_now);
        seen_sessions := seen_sessions || sessions[i];
        busy := busy || held::int;
        j := cardinality(seen_sessions);
      END IF;
      numbers[i] := greatest(0, least(wants[i], capacities[i] - busy[j]));
      busy[j] := busy[j] + numbers[i]::int;
    END LOOP;
  END IF;

  -- One run per subscription, in id order (its row lock is taken in that
  -- order), the batch's order within it: one slot per row to lease.
  FOR sub IN SELECT u.id FROM unnest(open_subs) AS u(id) ORDER BY u.id COLLATE "C" LOOP
    slot_k := '{}'; slot_sessions := '{}'; slot_digests := '{}';
    FOR i IN 1 .. n LOOP
      CONTINUE WHEN codes[i] <> 'open' OR subs[i] <> sub;
      cursor_read := cursors[i];
      queue_read := queue_ids[i];
      head_read := heads[i];
      FOR j IN 1 .. numbers[i] LOOP
        IF digests[next_digest] IS NULL THEN
          RAISE EXCEPTION 'orbit_claim_batch: fewer lease digests than rows to lease';
        END IF;
        slot_k := slot_k || i;
        slot_sessions := slot_sessions || sessions[i];
        slot_digests := slot_digests || digests[next_digest];
        next_digest := next_digest + 1;
      END LOOP;
    END LOOP;
    slots := cardinality(slot_k);
    filled := 0;
    behind := cursor_read < head_read;
    flags := 0; inserted := 0; found_cursor := 0; refill := 0; gap := NULL;

    IF slots > 0 THEN
      FOR rec IN SELECT * FROM orbit_claim_pick(sub, slot_sessions, slot_digests, p_now, p_lease_until) LOOP
        leased := leased || rec;
        leased_k := leased_k || slot_k[array_position(slot_digests, rec.lease_digest)];
        event_ids := event_ids || rec.event_id::text;
        filled := filled + 1;
      END LOOP;
    END IF;

    -- Short of PENDING rows while entries wait below the head: materialize
    -- here, inserting one LEASED row per open slot, and stop (0103).
    IF filled < slots AND behind THEN
      flags := 2;
      SELECT s.* INTO srow FROM subscriptions s WHERE s.id = sub FOR UPDATE;
      -- Rows are stamped after the lock, as materialized then: the node's
      -- time of the call plus what the call took so far on the server.
      t := p_now + floor(extract(epoch FROM clock_timestamp() - statement_timestamp())
                         * 1000000)::bigint;
      IF FOUND AND srow.enabled THEN
        SELECT q.head_sequence, q.retention_floor INTO m_head, m_floor
          FROM queues q WHERE q.id = srow.queue_id FOR KEY SHARE;
        IF NOT FOUND THEN
          flags := flags | 8;
        ELSIF srow.cursor_sequence < m_floor THEN
          gap := m_floor + 1;
        ELSE
          WITH t AS (DELETE FROM subscription_ack_tallies a WHERE a.subscription_id = sub
                     RETURNING a.acked)
          SELECT coalesce(sum(t.acked), 0) INTO folded FROM t;
          pending := srow.pending_count - folded;
          room := srow.max_pending - pending;
          types := string_to_array(srow.types, ',');
          m_cursor := srow.cursor_sequence;
          entries := 0;
          stopped_for_slots := false;
          stopped_for_room := false;
          ins_ids := '{}'; ins_events := '{}'; ins_sequences := '{}'; ins_slots := '{}';
          FOR e IN SELECT r.id, r.sequence, r.type FROM result_events r
                    WHERE r.queue_id = srow.queue_id AND r.sequence > srow.cursor_sequence
                      AND r.sequence <= m_head
                    ORDER BY r.sequence LIMIT p_batch LOOP
            entries := entries + 1;
            IF e.type = ANY(types) THEN
              IF filled + cardinality(ins_ids) >= slots THEN stopped_for_slots := true; EXIT; END IF;
              IF room <= 0 THEN stopped_for_room := true; EXIT; END IF;
              room := room - 1;
              IF ids[next_id] IS NULL THEN
                RAISE EXCEPTION 'orbit_claim_batch: fewer delivery ids than rows to insert';
              END IF;
              ins_ids := ins_ids || ids[next_id];
              next_id := next_id + 1;
              ins_events := ins_events || e.id::text;
              ins_sequences := ins_sequences || e.sequence;
              ins_slots := ins_slots || (filled + cardinality(ins_ids));
            END IF;
            m_cursor := e.sequence;
          END LOOP;
          inserted := cardinality(ins_ids);
          IF inserted > 0 THEN
            FOR rec IN
              INSERT INTO deliveries (id, subscription_id, event_id, sequence, revision, state,
                                      available_at, lease_epoch, leased_at, lease_until,
                                      lease_digest, lease_session_id, attempts, attempt_budget,
                                      created_at)
              SELECT u.id, sub, u.event_id, u.sequence, 2, 'LEASED', t, 1, t,
                     p_lease_until, slot_digests[u.slot], slot_sessions[u.slot], 1,
                     srow.max_attempts, t
                FROM unnest(ins_ids, ins_events, ins_sequences, ins_slots)
                     AS u(id, event_id, sequence, slot)
              RETURNING * LOOP
              leased := leased || rec;
              leased_k := leased_k || slot_k[array_position(slot_digests, rec.lease_digest)];
              event_ids := event_ids || rec.event_id::text;
            END LOOP;
            filled := filled + inserted::int;
          END IF;
          -- The counter row is written when the cursor moved or tallies
          -- were folded into pending_count (decision 0094).
          IF m_cursor <> srow.cursor_sequence OR folded <> 0 THEN
            UPDATE subscriptions s SET cursor_sequence = m_cursor, pending_count = pending + inserted
             WHERE s.id = sub;
          END IF;
          found_cursor := srow.cursor_sequence;
          refill := greatest(1, least(greatest(srow.max_pending, 0) / 4, greatest(p_batch, 1)));
          IF NOT stopped_for_room AND NOT stopped_for_slots AND entries = p_batch THEN
            flags := flags | 4;
          END IF;
          IF m_cursor = m_head THEN flags := flags | 16; END IF;
          IF stopped_for_room THEN flags := flags | 32; END IF;
        END IF;
      ELSE
        flags := flags | 8;
      END IF;
      behind := flags & 16 = 0;
      -- Another node materialized meanwhile (the cursor moved while this
      -- claim waited for the row): its PENDING rows are visible now (0105).
      IF found_cursor > cursor_read AND filled < slots THEN
        FOR rec IN SELECT * FROM orbit_claim_pick(sub, slot_sessions[filled + 1:],
                                                 slot_digests[filled + 1:], p_now, p_lease_until) LOOP
          leased := leased || rec;
          leased_k := leased_k || slot_k[array_position(slot_digests, rec.lease_digest)];
          event_ids := event_ids || rec.event_id::text;
        END LOOP;
      END IF;
    END IF;
    IF behind THEN flags := flags | 1; END IF;
    sub_ids := sub_ids || sub;
    sub_queues := sub_queues || queue_read;
    sub_flags := sub_flags || flags;
    sub_n1 := sub_n1 || inserted;
    sub_n2 := sub_n2 || found_cursor;
    sub_n3 := sub_n3 || refill;
    sub_n4 := sub_n4 || gap;
  END LOOP;

  RETURN QUERY
  SELECT 'claim'::text, g.i, codes[g.i], NULL::text, NULL::int, numbers[g.i],
         NULL::bigint, NULL::bigint, NULL::bigint, {NO_DELIVERY}, {NO_EVENT}
    FROM generate_series(1, n) AS g(i);
  RETURN QUERY
  SELECT 'subscription'::text, NULL::int, u.queue_id, u.id, u.flags, u.n1, u.n2, u.n3, u.n4,
         {NO_DELIVERY}, {NO_EVENT}
    FROM unnest(sub_ids, sub_queues, sub_flags, sub_n1, sub_n2, sub_n3, sub_n4)
         AS u(id, queue_id, flags, n1, n2, n3, n4);
  RETURN QUERY
  SELECT 'leased'::text, k.k, NULL::text, NULL::text, NULL::int, NULL::bigint, NULL::bigint,
         NULL::bigint, NULL::bigint, {DELIVERY:r}, {NO_EVENT}
    FROM unnest(leased) WITH ORDINALITY AS r
    JOIN unnest(leased_k) WITH ORDINALITY AS k(k, o) ON k.o = r.ordinality;
  RETURN QUERY
  SELECT 'event'::text, NULL::int, NULL::text, NULL::text, NULL::int, NULL::bigint,
         NULL::bigint, NULL::bigint, NULL::bigint, {NO_DELIVERY},
         ev.id::text, ev.sequence, ev.type::text, ev.aggregate_kind::text,
         ev.aggregate_id::text, ev.aggregate_revision::text, ev.occurred_at, ev.details,
         ev.snapshot
    FROM result_events ev WHERE ev.id = ANY(event_ids);
END $$;
"#;

/// [`FUNCTIONS`] with its placeholders filled.
fn functions() -> String {
    FUNCTIONS
        .replace("{DELIVERY:r}", &DELIVERY.replace("{r}", "r"))
        .replace("{NO_DELIVERY}", NO_DELIVERY)
        .replace("{NO_EVENT}", NO_EVENT)
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared(&functions()).await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared(
            "DROP FUNCTION IF EXISTS orbit_claim_batch(text, text, text, text, text, text, text, \
             bigint, bigint, int); \
             DROP FUNCTION IF EXISTS orbit_claim_pick(text, text[], text[], bigint, bigint)",
        )
        .await?;
        Ok(())
    }
}

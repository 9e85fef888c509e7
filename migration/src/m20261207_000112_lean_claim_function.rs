//! PostgreSQL only: `orbit_claim_batch(…)` again (decision 0112), the same
//! signature, rules and rows as migration 0108, in about half the
//! statements. Each statement a PL/pgSQL function runs pays its executor's
//! start and end (plan checks, opening relations and indexes, compiling
//! expressions) whatever it reads; paced at 1,000 results/s a claim ran
//! about twenty of them, and the function took 1.2 ms of server time for
//! 0.45 ms of its statements' own work. Now: the scope check inside the
//! claims' read; one count of live leases for all sessions; the
//! subscription and its queue locked in one statement; the pick inline
//! (`orbit_claim_pick` only for the rare second pick); the rows returned
//! by one query.

use sea_orm_migration::prelude::*;

use crate::m20261207_000108_claim_function::{DELIVERY, NO_DELIVERY, NO_EVENT};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// The function; `{DELIVERY:x}` stands for [`DELIVERY`] of record `x`.
const FUNCTION: &str = r#"
-- A batch of claims (decisions 0108, 0112); arguments and rows as
-- described in migration 0108.
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
-- Generic plans by index, as in 0108.
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
  seen_sessions text[];
  busy int[];
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
  srow record;
  locked boolean;
  t bigint;
  m_queue text;
  m_head bigint;
  m_floor bigint;
  m_start bigint;
  m_max_pending bigint;
  m_max_attempts int;
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
    SELECT u.i::int AS i, c.id IS NOT NULL AS credential_ok,
           s.id IS NOT NULL AND jsonb_typeof(j.scope) = 'array'
             AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(
                               CASE WHEN jsonb_typeof(j.scope) = 'array' THEN j.scope
                                    ELSE '[]'::jsonb END) AS x(v)
                              WHERE jsonb_typeof(x.v) <> 'string')
             AND coalesce(j.scope ? s.queue_id::text, false) AS in_scope,
           s.queue_id::text AS queue_id, s.enabled,
           s.cursor_sequence, q.head_sequence, q.retention_floor
      FROM unnest(credentials, subs) WITH ORDINALITY AS u(credential_id, subscription_id, i)
      LEFT JOIN credentials c ON c.id = u.credential_id AND c.revoked_at IS NULL
      LEFT JOIN LATERAL (SELECT c.queue_scope::jsonb AS scope) j ON true
      LEFT JOIN subscriptions s ON s.id = u.subscription_id
      LEFT JOIN queues q ON q.id = s.queue_id
  LOOP
    i := chk.i;
    IF NOT chk.credential_ok THEN codes[i] := 'revoked'; CONTINUE; END IF;
    IF NOT chk.in_scope THEN codes[i] := 'gone'; CONTINUE; END IF;
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

    -- The live leases of every session of an open claim, in one statement;
    -- the row comparison keeps each count on ix_deliveries_leased_session
    -- (decision 0106).
    SELECT coalesce(array_agg(u.s), '{}'),
           coalesce(array_agg((SELECT count(*) FROM deliveries d
                                WHERE d.lease_session_id = u.s AND d.state = 'LEASED'
                                  AND (d.lease_session_id, d.lease_until) > (u.s, p_now))::int),
                    '{}')
      INTO seen_sessions, busy
      FROM (SELECT DISTINCT x.s FROM unnest(sessions, codes) AS x(s, code)
             WHERE x.code = 'open') AS u;
    -- min(want, capacity - live leases), a session met twice also
    -- counting what its earlier claim takes.
    FOR i IN 1 .. n LOOP
      CONTINUE WHEN codes[i] <> 'open';
      j := array_position(seen_sessions, sessions[i]);
      numbers[i] := greatest(0, least(wants[i], capacities[i] - busy[j]));
      busy[j] := busy[j] + numbers[i]::int;
    END LOOP;
  END IF;

  -- One run per subscription, in id order (its row lock is taken in that
  -- order), the batch's order within it: one slot per row to lease.
  IF cardinality(open_subs) > 1 THEN
    SELECT array_agg(u.id ORDER BY u.id COLLATE "C") INTO open_subs FROM unnest(open_subs) AS u(id);
  END IF;
  FOREACH sub IN ARRAY open_subs LOOP
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
      -- Up to `slots` claimable rows, the n-th in (sequence, id) order to
      -- slot n; picked once (MATERIALIZED): a plan that scanned them again
      -- (SKIP LOCKED) could rank other rows the second time.
      FOR rec IN
        WITH picked AS MATERIALIZED (
          SELECT c.id AS picked_id, row_number() OVER (ORDER BY c.sequence, c.id) AS picked_rank
            FROM (SELECT d.id, d.sequence FROM deliveries d
                   WHERE d.subscription_id = sub AND d.state = 'PENDING'
                     AND d.available_at <= p_now AND d.attempts < d.attempt_budget
                   ORDER BY d.sequence, d.id LIMIT slots
                   FOR UPDATE SKIP LOCKED) AS c)
        UPDATE deliveries d
           SET state = 'LEASED', lease_epoch = d.lease_epoch + 1, attempts = d.attempts + 1,
               revision = d.revision + 1, leased_at = p_now, lease_until = p_lease_until,
               lease_session_id = a.session_id, lease_digest = a.digest
          FROM picked
          JOIN unnest(slot_sessions, slot_digests) WITH ORDINALITY AS a(session_id, digest, rank)
            ON a.rank = picked.picked_rank
         WHERE d.id = picked.picked_id AND d.state = 'PENDING'
        RETURNING d.*
      LOOP
        leased := leased || rec;
        leased_k := leased_k || slot_k[array_position(slot_digests, rec.lease_digest)];
        event_ids := event_ids || rec.event_id::text;
        filled := filled + 1;
      END LOOP;
    END IF;

    -- Short of PENDING rows while entries wait below the head: materialize
    -- here, inserting one LEASED row per open slot, and stop (0103). The
    -- subscription's row is locked, and its queue's for key share, in one
    -- statement (a missing queue reads as a missing subscription: both
    -- leave the subscription idle).
    IF filled < slots AND behind THEN
      flags := 2;
      SELECT s.queue_id::text AS queue_id, s.enabled, s.cursor_sequence, s.pending_count,
             s.max_pending, s.types, s.max_attempts, q.head_sequence, q.retention_floor
        INTO srow
        FROM subscriptions s JOIN queues q ON q.id = s.queue_id
       WHERE s.id = sub
         FOR UPDATE OF s FOR KEY SHARE OF q;
      locked := FOUND;
      -- Rows are stamped after the lock, as materialized then: the node's
      -- time of the call plus what the call took so far on the server.
      t := p_now + floor(extract(epoch FROM clock_timestamp() - statement_timestamp())
                         * 1000000)::bigint;
      IF locked AND srow.enabled THEN
        m_queue := srow.queue_id;
        m_head := srow.head_sequence;
        m_floor := srow.retention_floor;
        m_start := srow.cursor_sequence;
        m_max_pending := srow.max_pending;
        m_max_attempts := srow.max_attempts;
        IF m_start < m_floor THEN
          gap := m_floor + 1;
        ELSE
          WITH ta AS (DELETE FROM subscription_ack_tallies a WHERE a.subscription_id = sub
                      RETURNING a.acked)
          SELECT coalesce(sum(ta.acked), 0) INTO folded FROM ta;
          pending := srow.pending_count - folded;
          room := m_max_pending - pending;
          types := string_to_array(srow.types, ',');
          m_cursor := m_start;
          entries := 0;
          stopped_for_slots := false;
          stopped_for_room := false;
          ins_ids := '{}'; ins_events := '{}'; ins_sequences := '{}'; ins_slots := '{}';
          FOR e IN SELECT r.id, r.sequence, r.type FROM result_events r
                    WHERE r.queue_id = m_queue AND r.sequence > m_start
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
                     m_max_attempts, t
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
          IF m_cursor <> m_start OR folded <> 0 THEN
            UPDATE subscriptions s SET cursor_sequence = m_cursor, pending_count = pending + inserted
             WHERE s.id = sub;
          END IF;
          found_cursor := m_start;
          refill := greatest(1, least(greatest(m_max_pending, 0) / 4, greatest(p_batch, 1)));
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
    FROM generate_series(1, n) AS g(i)
  UNION ALL
  SELECT 'subscription'::text, NULL::int, u.queue_id, u.id, u.flags, u.n1, u.n2, u.n3, u.n4,
         {NO_DELIVERY}, {NO_EVENT}
    FROM unnest(sub_ids, sub_queues, sub_flags, sub_n1, sub_n2, sub_n3, sub_n4)
         AS u(id, queue_id, flags, n1, n2, n3, n4)
  UNION ALL
  SELECT 'leased'::text, k.k, NULL::text, NULL::text, NULL::int, NULL::bigint, NULL::bigint,
         NULL::bigint, NULL::bigint, {DELIVERY:r}, {NO_EVENT}
    FROM unnest(leased) WITH ORDINALITY AS r
    JOIN unnest(leased_k) WITH ORDINALITY AS k(k, o) ON k.o = r.ordinality
  UNION ALL
  SELECT 'event'::text, NULL::int, NULL::text, NULL::text, NULL::int, NULL::bigint,
         NULL::bigint, NULL::bigint, NULL::bigint, {NO_DELIVERY},
         ev.id::text, ev.sequence, ev.type::text, ev.aggregate_kind::text,
         ev.aggregate_id::text, ev.aggregate_revision::text, ev.occurred_at, ev.details,
         ev.snapshot
    FROM result_events ev WHERE ev.id = ANY(event_ids);
END $$;
"#;

/// [`FUNCTION`] with its placeholders filled.
pub(crate) fn function() -> String {
    FUNCTION
        .replace("{DELIVERY:r}", &DELIVERY.replace("{r}", "r"))
        .replace("{NO_DELIVERY}", NO_DELIVERY)
        .replace("{NO_EVENT}", NO_EVENT)
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::on_postgres(manager, &function()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // Migration 0108's function again.
        crate::m20261207_000108_claim_function::Migration
            .up(manager)
            .await
    }
}

//! ScannerActor: knows which subscriptions have bound sessions on this node;
//! on a wake (a journal append here or, by NOTIFY, on another node; an ACK,
//! resume or retry; a new session; the fallback timer) it materializes their
//! deliveries and enqueues at most `claims_per_scan_round` claim requests
//! into the pool, round-robin over applications, then subscriptions, then
//! sessions, so the pool can be fair among what it receives (spec:
//! architecture.md §1, delivery-model.md §5). Database work runs as futures
//! off the connection actors: a slow round never delays a ping reply.

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use actix::prelude::*;

mod settle;

use crate::{
    delivery::{
        listener::Announcer,
        pool::{ClaimRequest, ClaimResult, LeasePoolActor},
    },
    domain::{ApplicationId, CredentialId, QueueId, SessionId, SubscriptionId},
    metrics::{Metrics, Operation},
    store::{
        Database, Waiter,
        claim::{ClaimOutcome, ClaimTarget},
        materialize::{Materialized, materialize},
        wakes::Wake,
    },
};

/// A session bound on this node (sent by its connection after the welcome).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SessionBound {
    pub session_id: SessionId,
    pub subscription_id: SubscriptionId,
    pub queue_id: QueueId,
    pub application_id: ApplicationId,
    pub credential_id: CredentialId,
    pub capacity: u32,
    /// Deliveries the connection can take right now.
    pub room: u32,
    pub connection: Recipient<ClaimResult>,
    /// Alive while the connection holds the session (see [`Waiter`]).
    pub waiter: Waiter,
}

/// The session's connection is gone.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SessionClosed {
    pub session_id: SessionId,
}

/// The connection's room changed (capacity minus held leases, bounded by
/// its free write-queue slots).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Demand {
    pub session_id: SessionId,
    pub room: u32,
}

/// New entries were appended to `queue_id`'s log on this node: committed
/// on PostgreSQL; on SQLite written in the open write round, whose commit
/// a claim started now can still share (decision 0098).
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub struct JournalAppended {
    pub queue_id: QueueId,
    /// How many.
    pub entries: u64,
    /// SQLite: the publish batch, whose [`JournalCommitted`] follows.
    pub batch: Option<u64>,
}

/// The transaction holding appends to `queue_id` committed (SQLite, where
/// [`JournalAppended`] came before the commit, decision 0098): the queue's
/// subscriptions are due a materialization pass, which now sees the rows.
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub struct JournalCommitted {
    pub queue_id: QueueId,
    /// The publish batch of the [`JournalAppended`] before it.
    pub batch: u64,
}

/// Something freed room or made deliveries available on a subscription
/// (an ACK, a resume, an HTTP retry, a recovered lease).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SubscriptionChanged {
    pub subscription_id: SubscriptionId,
    /// The change may have made PENDING rows available (a resume, a
    /// retry). False for an ACK: it frees room in the backlog window and
    /// the session, but makes no row claimable, so it does not undo what an
    /// exhausted claim learned (no claims that can only find nothing).
    pub rows_available: bool,
}

/// Another node announced a wake (PostgreSQL NOTIFY). Unlike the local
/// messages it also marks the subscriptions as maybe having PENDING rows:
/// the other node may already have materialized them, so a materialization
/// here can find nothing new while claims would.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RemoteWake(pub Wake);

/// Every subscription may have work (expired leases recovered in bulk).
#[derive(Message)]
#[rtype(result = "()")]
pub struct WakeAll;

/// A claim request finished, failed or was refused by the pool.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ClaimSettled {
    pub session_id: SessionId,
    pub subscription_id: SubscriptionId,
    pub requested: u32,
    pub leased: u32,
    /// Fewer rows were available than requested.
    pub exhausted: bool,
    /// The pool was full; retry on a later round.
    pub refused: bool,
    /// The claim transaction failed.
    pub failed: bool,
    /// What the claim's own materialization did, if it ran one.
    pub materialized: Option<Materialized>,
    /// The cursor was still behind the head after the claim.
    pub behind_head: bool,
}

struct SessionEntry {
    subscription_id: SubscriptionId,
    application_id: ApplicationId,
    credential_id: CredentialId,
    capacity: u32,
    room: u32,
    claiming: bool,
    /// A claim leased to it and its connection has not yet reported the
    /// room left after queueing those deliveries (`room` is 0 until then).
    reporting: bool,
    /// The subscription's `generation` when the running claim was asked for.
    claim_generation: u64,
    connection: Recipient<ClaimResult>,
    waiter: Waiter,
}

impl SessionEntry {
    /// Has room and no claim running: a claim asked for now is its.
    fn idle(&self) -> bool {
        self.room > 0 && !self.claiming
    }

    /// Has room, or will report it once it has queued a claim's
    /// deliveries: its subscription is left to its claims
    /// (decision 0103).
    fn waits(&self) -> bool {
        self.room > 0 || self.reporting
    }
}

struct SubscriptionEntry {
    queue_id: QueueId,
    application_id: ApplicationId,
    /// Bound sessions in round-robin order.
    sessions: VecDeque<SessionId>,
    /// Needs a materialization pass.
    dirty: bool,
    /// Entries appended on this node to the queue since the last round
    /// (0: none, or only wakes whose count is unknown).
    appended: u64,
    /// The publish batch of the last [`JournalAppended`] (SQLite).
    appended_batch: Option<u64>,
    /// The publish batch whose entries were left to a session's claim.
    claimed_batch: Option<u64>,
    /// The last materialization read every entry up to the head: until an
    /// append (or the timer), an ACK frees room but finds nothing to read,
    /// so it needs no materialization, only a claim.
    caught_up: bool,
    /// May have available PENDING rows (worth a claim).
    maybe_pending: bool,
    /// A claim stopped below the head with every slot filled (decision
    /// 0103): the entries after its cursor are the next claims' to insert.
    left_behind: bool,
    /// A claim found nothing to lease below a full backlog window: the next
    /// round refills the window here, once (decision 0062); left to claims,
    /// they would find it full again.
    refill: bool,
    /// Entries below the head were left to the claims of sessions with
    /// room: if every session runs out of room first, the scanner
    /// materializes them, so the backlog stays visible (decision 0103).
    deferred: bool,
    /// The last materialization stopped at a full backlog window: ACKs
    /// count down `refill_in` before the next one (decision 0062).
    window_full: bool,
    /// ACKs (or other changes) still to come before a full window is worth
    /// a materialization.
    refill_in: u64,
    /// Grows each time `maybe_pending` is set: a claim that started before
    /// new rows appeared must not clear the flag when it finds none.
    generation: u64,
    /// Available PENDING rows as far as this node knows: `Some(n)` after a
    /// claim found the rows exhausted, plus what materializations here
    /// inserted since; `None` (unknown) after anything else that may have
    /// made rows available. With `Some(n)`, claims are only asked for while
    /// the rooms of the running ones do not cover `n`: one new row wakes one
    /// claim, not one per session that has room.
    known_available: Option<u64>,
    /// The sum of the `want`s of this subscription's claims asked for and
    /// not yet settled.
    wanted_in_flight: u64,
}

impl SubscriptionEntry {
    fn may_have_pending(&mut self) {
        self.maybe_pending = true;
        self.generation += 1;
        self.known_available = None;
    }

    /// A materialization here inserted `n` PENDING rows.
    fn materialized(&mut self, n: u64) {
        let known = self.known_available.map(|a| a + n);
        self.may_have_pending();
        self.known_available = known;
    }

    /// Whether another claim may find rows the running ones will not take.
    fn worth_another_claim(&self) -> bool {
        self.maybe_pending
            && self
                .known_available
                .is_none_or(|n| self.wanted_in_flight < n)
    }
}

/// The scanner actor (one per node).
pub struct ScannerActor {
    db: Database,
    pool: Addr<LeasePoolActor>,
    claims_per_round: usize,
    scan_interval: Duration,
    /// Other nodes to tell about local wakes (PostgreSQL only).
    announcer: Option<Announcer>,
    metrics: Arc<Metrics>,
    sessions: HashMap<SessionId, SessionEntry>,
    subscriptions: HashMap<SubscriptionId, SubscriptionEntry>,
    /// Applications with bound sessions, in round-robin order.
    app_ring: VecDeque<ApplicationId>,
    /// Each application's subscriptions with bound sessions, in
    /// round-robin order.
    app_subscriptions: HashMap<ApplicationId, VecDeque<SubscriptionId>>,
    round_running: bool,
    round_again: bool,
}

impl ScannerActor {
    pub fn new(
        db: Database,
        pool: Addr<LeasePoolActor>,
        claims_per_round: usize,
        scan_interval: Duration,
        announcer: Option<Announcer>,
        metrics: Arc<Metrics>,
    ) -> ScannerActor {
        ScannerActor {
            db,
            pool,
            claims_per_round,
            scan_interval,
            announcer,
            metrics,
            sessions: HashMap::new(),
            subscriptions: HashMap::new(),
            app_ring: VecDeque::new(),
            app_subscriptions: HashMap::new(),
            round_running: false,
            round_again: false,
        }
    }

    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.round_running {
            self.round_again = true;
        } else {
            self.start_round(ctx);
        }
    }

    /// One round: materialize the dirty subscriptions (sequentially, each
    /// its own transaction), then enqueue claims.
    fn start_round(&mut self, ctx: &mut Context<Self>) {
        self.round_running = true;
        self.round_again = false;
        // A dirty subscription with a session that has room (idle, claiming
        // and due to ask again, or about to report its room after a claim)
        // and an open backlog window is left to the claims, which insert
        // what they lease in their own transaction (delivery-model.md §5,
        // decision 0103): one commit less between an append and its
        // `event.deliver`, and one write per row instead of an insert and a
        // lease. The others are materialized here, so a backlog stays
        // visible; a full window is refilled here (decision 0062). Both
        // backends (decision 0105).
        let sessions = &self.sessions;
        let dirty: Vec<SubscriptionId> = self
            .subscriptions
            .iter_mut()
            .filter(|(_, s)| s.dirty)
            .filter_map(|(id, s)| {
                s.dirty = false;
                let waiting = s
                    .sessions
                    .iter()
                    .any(|sid| sessions.get(sid).is_some_and(SessionEntry::waits));
                let appended = std::mem::take(&mut s.appended);
                let behind = std::mem::take(&mut s.left_behind);
                let refill = std::mem::take(&mut s.refill);
                if !waiting || s.window_full || refill {
                    return Some(id.clone());
                }
                // The batch is left to a claim asked for in this round, which
                // can share its write round (decision 0098); otherwise its
                // commit marks the subscription again.
                if appended > 0
                    && s.sessions
                        .iter()
                        .any(|sid| sessions.get(sid).is_some_and(SessionEntry::idle))
                {
                    s.claimed_batch = s.appended_batch;
                }
                s.deferred = true;
                // Entries appended here have a known count: at most
                // `appended` new rows, so one new row still wakes one claim
                // (decision 0064). Entries a claim left below the head, or
                // below a cursor an ACK or the poll found behind, are not
                // counted: every session with room may claim.
                let known = s
                    .known_available
                    .filter(|_| !behind && appended > 0)
                    .map(|a| a + appended);
                s.may_have_pending();
                s.known_available = known;
                None
            })
            .collect();
        let db = self.db.clone();
        let fut = async move {
            let mut results = Vec::with_capacity(dirty.len());
            for id in dirty {
                let result = materialize(&db, &id).await;
                results.push((id, result));
            }
            results
        };
        ctx.spawn(fut.into_actor(self).map(|results, act, ctx| {
            for (id, result) in results {
                act.after_materialize(&id, result);
            }
            act.enqueue_claims(ctx);
            act.round_running = false;
            if act.round_again {
                act.kick(ctx);
            }
        }));
    }

    fn after_materialize(
        &mut self,
        id: &SubscriptionId,
        result: Result<Materialized, crate::store::StoreError>,
    ) {
        let Some(sub) = self.subscriptions.get_mut(id) else {
            return;
        };
        sub.deferred = false;
        sub.caught_up = matches!(&result, Ok(m) if m.caught_up);
        sub.window_full = matches!(&result, Ok(m) if m.window_full);
        sub.refill_in = result.as_ref().map_or(0, |m| m.refill_after);
        match result {
            Ok(m) => {
                if m.inserted > 0 {
                    self.metrics.materialized(&sub.queue_id, m.inserted);
                    sub.materialized(m.inserted);
                }
                if m.more {
                    sub.dirty = true;
                    self.round_again = true;
                }
                if let Some(earliest) = m.history_gap {
                    // Never advanced silently: every bound session is told.
                    for session in &sub.sessions {
                        if let Some(entry) = self.sessions.get(session) {
                            entry.connection.do_send(ClaimResult {
                                outcome: Ok(ClaimOutcome::HistoryExpired(earliest)),
                            });
                        }
                    }
                }
            }
            Err(err) => {
                // Retried on the next timer tick; claims report UNAVAILABLE.
                materialize_failed(&self.metrics, id, &err);
                sub.dirty = true;
            }
        }
    }

    /// Up to `claims_per_round` requests: one per application per pass,
    /// round-robin over applications, then over each application's
    /// subscriptions, then over a subscription's sessions. Only sessions
    /// with room, no claim running, and a subscription that may have
    /// available PENDING rows are asked for.
    fn enqueue_claims(&mut self, ctx: &mut Context<Self>) {
        let budget = self.claims_per_round;
        let settled = ctx.address().recipient::<ClaimSettled>();
        let mut sent = 0;
        while sent < budget {
            let mut any = false;
            for _ in 0..self.app_ring.len() {
                if sent == budget {
                    break;
                }
                let Some(app) = self.app_ring.pop_front() else {
                    break;
                };
                self.app_ring.push_back(app.clone());
                let Some(session_id) = self.next_session_of(&app) else {
                    continue;
                };
                let Some(entry) = self.sessions.get_mut(&session_id) else {
                    continue;
                };
                let generation = match self.subscriptions.get_mut(&entry.subscription_id) {
                    Some(sub) => {
                        sub.wanted_in_flight += u64::from(entry.room);
                        sub.generation
                    }
                    None => 0,
                };
                entry.claiming = true;
                entry.claim_generation = generation;
                sent += 1;
                any = true;
                self.pool.do_send(ClaimRequest {
                    target: ClaimTarget {
                        session_id,
                        subscription_id: entry.subscription_id.clone(),
                        credential_id: entry.credential_id.clone(),
                        capacity: entry.capacity,
                        waiter: entry.waiter.clone(),
                    },
                    application_id: entry.application_id.clone(),
                    want: entry.room,
                    enqueued_at: Instant::now(),
                    reply: entry.connection.clone(),
                    settled: settled.clone(),
                });
            }
            if !any {
                break;
            }
        }
    }

    /// The next session of `app` that wants a claim, rotating the
    /// application's subscriptions and the chosen subscription's sessions.
    fn next_session_of(&mut self, app: &ApplicationId) -> Option<SessionId> {
        let subs = self.app_subscriptions.get_mut(app)?;
        for _ in 0..subs.len() {
            let sub_id = subs.pop_front()?;
            subs.push_back(sub_id.clone());
            let Some(sub) = self.subscriptions.get_mut(&sub_id) else {
                continue;
            };
            if !sub.worth_another_claim() {
                continue;
            }
            for _ in 0..sub.sessions.len() {
                let Some(session_id) = sub.sessions.pop_front() else {
                    break;
                };
                sub.sessions.push_back(session_id.clone());
                let wants = self
                    .sessions
                    .get(&session_id)
                    .is_some_and(SessionEntry::idle);
                if wants {
                    return Some(session_id);
                }
            }
        }
        None
    }
}

impl ScannerActor {
    /// The last materialization of a subscription no longer bound here:
    /// batch after batch until it caught up or its backlog window is full
    /// (delivery-model.md §5), since this node forgets it afterwards.
    fn materialize_unbound(
        &mut self,
        id: SubscriptionId,
        queue_id: QueueId,
        ctx: &mut Context<Self>,
    ) {
        let db = self.db.clone();
        let fut = async move {
            let mut inserted = 0;
            let result = loop {
                match materialize(&db, &id).await {
                    Ok(m) => {
                        inserted += m.inserted;
                        if !m.more || m.window_full {
                            break Ok(());
                        }
                    }
                    Err(err) => break Err(err),
                }
            };
            (id, inserted, result)
        };
        ctx.spawn(
            fut.into_actor(self)
                .map(move |(id, inserted, result), act, _| {
                    act.metrics.materialized(&queue_id, inserted);
                    if let Err(err) = result {
                        materialize_failed(&act.metrics, &id, &err);
                    }
                }),
        );
    }

    /// Entries left to claims whose sessions all ran out of room are
    /// materialized PENDING (delivery-model.md §5: the backlog stays
    /// visible and bounded by `max_pending`).
    fn materialize_if_nobody_waits(
        &mut self,
        subscription_id: &SubscriptionId,
        ctx: &mut Context<Self>,
    ) {
        let Some(sub) = self.subscriptions.get_mut(subscription_id) else {
            return;
        };
        let sessions = &self.sessions;
        let waiting = sub
            .sessions
            .iter()
            .any(|sid| sessions.get(sid).is_some_and(|e| e.waits() || e.claiming));
        if sub.deferred && !waiting {
            sub.dirty = true;
            self.kick(ctx);
        }
    }
}

/// Counts and logs a failed materialization.
fn materialize_failed(metrics: &Metrics, id: &SubscriptionId, err: &crate::store::StoreError) {
    metrics.database_error(Operation::Materialize);
    crate::store::writer::log_failure(err, &format!("materialization of subscription {id} failed"));
}

impl Actor for ScannerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // The fallback poll: covers lost wakes, expired leases becoming
        // claimable again, and changes made on other nodes.
        ctx.run_interval(self.scan_interval, |act, ctx| {
            for sub in act.subscriptions.values_mut() {
                sub.dirty = true;
                sub.may_have_pending();
            }
            act.kick(ctx);
        });
    }
}

impl Handler<SessionBound> for ScannerActor {
    type Result = ();

    fn handle(&mut self, msg: SessionBound, ctx: &mut Context<Self>) {
        let sub = match self.subscriptions.entry(msg.subscription_id.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let app = msg.application_id.clone();
                let ring = self.app_subscriptions.entry(app.clone()).or_default();
                if ring.is_empty() {
                    self.app_ring.push_back(app.clone());
                }
                ring.push_back(msg.subscription_id.clone());
                e.insert(SubscriptionEntry {
                    queue_id: msg.queue_id.clone(),
                    application_id: app,
                    sessions: VecDeque::new(),
                    dirty: true,
                    appended: 0,
                    appended_batch: None,
                    claimed_batch: None,
                    caught_up: false,
                    maybe_pending: true,
                    left_behind: false,
                    refill: false,
                    deferred: false,
                    known_available: None,
                    wanted_in_flight: 0,
                    window_full: false,
                    refill_in: 0,
                    generation: 0,
                })
            }
        };
        sub.sessions.push_back(msg.session_id.clone());
        sub.dirty = true;
        sub.may_have_pending();
        self.sessions.insert(
            msg.session_id,
            SessionEntry {
                subscription_id: msg.subscription_id,
                application_id: msg.application_id,
                credential_id: msg.credential_id,
                capacity: msg.capacity,
                room: msg.room,
                claiming: false,
                reporting: false,
                claim_generation: 0,
                connection: msg.connection,
                waiter: msg.waiter,
            },
        );
        self.kick(ctx);
    }
}

impl Handler<SessionClosed> for ScannerActor {
    type Result = ();

    fn handle(&mut self, msg: SessionClosed, ctx: &mut Context<Self>) {
        let Some(entry) = self.sessions.remove(&msg.session_id) else {
            return;
        };
        let Some(sub) = self.subscriptions.get_mut(&entry.subscription_id) else {
            return;
        };
        sub.sessions.retain(|s| s != &msg.session_id);
        if !sub.sessions.is_empty() {
            self.materialize_if_nobody_waits(&entry.subscription_id, ctx);
            return;
        }
        let app = sub.application_id.clone();
        let deferred = sub.deferred.then(|| sub.queue_id.clone());
        self.subscriptions.remove(&entry.subscription_id);
        if let Some(queue_id) = deferred {
            // Entries left to the claims of the last session: materialized
            // once more, as they would have been had it never had room.
            self.materialize_unbound(entry.subscription_id.clone(), queue_id, ctx);
        }
        if let Some(ring) = self.app_subscriptions.get_mut(&app) {
            ring.retain(|s| s != &entry.subscription_id);
            if ring.is_empty() {
                self.app_subscriptions.remove(&app);
                self.app_ring.retain(|a| a != &app);
            }
        }
    }
}

impl Handler<Demand> for ScannerActor {
    type Result = ();

    fn handle(&mut self, msg: Demand, ctx: &mut Context<Self>) {
        let Some(entry) = self.sessions.get_mut(&msg.session_id) else {
            return;
        };
        let grew = msg.room > entry.room;
        entry.room = msg.room;
        entry.reporting = false;
        if grew && !entry.claiming {
            self.kick(ctx);
        } else if msg.room == 0 {
            let subscription_id = entry.subscription_id.clone();
            self.materialize_if_nobody_waits(&subscription_id, ctx);
        }
    }
}

impl Handler<JournalAppended> for ScannerActor {
    type Result = ();

    fn handle(&mut self, msg: JournalAppended, ctx: &mut Context<Self>) {
        if let Some(announcer) = &self.announcer {
            announcer.announce(Wake::Journal(msg.queue_id.clone()));
        }
        let mut any = false;
        for sub in self.subscriptions.values_mut() {
            if sub.queue_id == msg.queue_id {
                sub.dirty = true;
                sub.appended += msg.entries;
                // The same batch again: it runs again (a round spoiled, a
                // request refused), in a transaction the claim that took
                // it may not have seen; its commit marks the subscription.
                if msg.batch.is_some() && sub.claimed_batch == msg.batch {
                    sub.claimed_batch = None;
                }
                sub.appended_batch = msg.batch;
                any = true;
            }
        }
        if any {
            self.kick(ctx);
        }
    }
}

impl Handler<JournalCommitted> for ScannerActor {
    type Result = ();

    fn handle(&mut self, msg: JournalCommitted, ctx: &mut Context<Self>) {
        let mut any = false;
        for sub in self.subscriptions.values_mut() {
            // A subscription whose session claim took this batch's
            // entries (in the same round or after it) needs nothing more.
            if sub.queue_id == msg.queue_id && sub.claimed_batch != Some(msg.batch) {
                sub.dirty = true;
                any = true;
            }
        }
        if any {
            self.kick(ctx);
        }
    }
}

impl Handler<SubscriptionChanged> for ScannerActor {
    type Result = ();

    fn handle(&mut self, msg: SubscriptionChanged, ctx: &mut Context<Self>) {
        if let Some(announcer) = &self.announcer {
            announcer.announce(Wake::Subscription(msg.subscription_id.clone()));
        }
        if let Some(sub) = self.subscriptions.get_mut(&msg.subscription_id) {
            if sub.window_full {
                // The window is full and PENDING rows remain: one
                // materialization per `refill_after` ACKs instead of one
                // per scan round (an exhausted claim refills at once).
                sub.refill_in = sub.refill_in.saturating_sub(1);
                sub.dirty |= sub.refill_in == 0;
            } else {
                sub.dirty |= !sub.caught_up;
            }
            if msg.rows_available {
                sub.may_have_pending();
            }
            self.kick(ctx);
        }
    }
}

impl Handler<RemoteWake> for ScannerActor {
    type Result = ();

    fn handle(&mut self, msg: RemoteWake, ctx: &mut Context<Self>) {
        let mut any = false;
        for (id, sub) in self.subscriptions.iter_mut() {
            let hit = match &msg.0 {
                Wake::Journal(queue_id) => &sub.queue_id == queue_id,
                Wake::Subscription(subscription_id) => id == subscription_id,
            };
            if hit {
                sub.dirty = true;
                sub.may_have_pending();
                any = true;
            }
        }
        if any {
            self.kick(ctx);
        }
    }
}

impl Handler<WakeAll> for ScannerActor {
    type Result = ();

    fn handle(&mut self, _: WakeAll, ctx: &mut Context<Self>) {
        for sub in self.subscriptions.values_mut() {
            sub.dirty = true;
            sub.may_have_pending();
        }
        self.kick(ctx);
    }
}

//! The requests a connection answers (hello, `event.ack`,
//! `events.ping`); each runs its
//! database work as a future off the actor (protocol.md §3).

use std::time::Instant;

use actix::prelude::*;
use actix_ws::CloseCode;
use tokio::sync::OwnedSemaphorePermit;

use crate::{
    delivery::scanner::{SessionBound, SubscriptionChanged},
    domain::{MessageId, Permission, QueueId, SubscriptionId, U64Str, now},
    error::ErrorCode,
    metrics::{Operation, Outcome},
    store::{
        self, StoreError, Waiter,
        ack::{AckOutcome, AckRequest, LeaseProof},
        sessions::OpenSession,
    },
    ws::frames::{self, ClientEnvelope},
};

use super::*;

impl ConnectionActor {
    pub(super) fn on_hello(
        &mut self,
        ctx: &mut Context<Self>,
        env: ClientEnvelope,
        permit: OwnedSemaphorePermit,
    ) {
        let hello = match env.hello() {
            Ok(h) => h,
            Err(err) => {
                let text = frames::error(None, Some(&env.message_id), err.code(), err.message());
                return self.send_now(ctx, text);
            }
        };
        self.phase = Phase::HelloPending;
        let db = self.state.db.clone();
        let principal = self.principal.clone();
        let node_id = self.state.node_id.clone();
        let capacity = hello.capacity.get();
        let sub_id = hello.subscription_id.clone();
        let fut = async move {
            let result =
                store::sessions::open_session(&db, &principal, &sub_id, capacity, &node_id).await;
            drop(permit);
            result
        };
        let reply_to = env.message_id;
        self.in_flight += 1;
        ctx.spawn(
            tracing::Instrument::instrument(fut, self.span.clone())
                .into_actor(self)
                .map(move |result, act, ctx| {
                    act.in_flight -= 1;
                    act.after_hello(ctx, result, reply_to, hello, capacity);
                    act.finish_drain_if_idle(ctx);
                }),
        );
    }

    fn after_hello(
        &mut self,
        ctx: &mut Context<Self>,
        result: Result<OpenSession, StoreError>,
        reply_to: MessageId,
        hello: frames::Hello,
        capacity: u32,
    ) {
        if !matches!(self.phase, Phase::HelloPending) {
            return;
        }
        match result {
            Ok(OpenSession::Opened {
                session_id,
                subscription,
            }) => {
                let timing = &self.state.settings.timing;
                let welcome = frames::welcome(
                    &reply_to,
                    &frames::Welcome {
                        session_id: &session_id,
                        subscription_id: &hello.subscription_id,
                        capacity,
                        lease_duration_ms: timing.lease_ms,
                        heartbeat_interval_ms: timing.heartbeat_interval_ms,
                        server_time: now(),
                        enabled: subscription.enabled,
                    },
                );
                self.span
                    .record("session_id", tracing::field::display(&session_id));
                tracing::info!(
                    %session_id,
                    subscription_id = %hello.subscription_id,
                    capacity,
                    "session bound"
                );
                let queue_id = QueueId::from_db(subscription.queue_id);
                self.phase = Phase::Bound(Bound {
                    session_id: session_id.clone(),
                    subscription_id: hello.subscription_id.clone(),
                    queue_id: queue_id.clone(),
                    capacity,
                    acks_waiting: Arc::new(Semaphore::new(capacity as usize)),
                });
                self.send_now(ctx, welcome);
                if self.draining {
                    return;
                }
                let room = self.room();
                self.last_reported_room = Some(room);
                self.state.scanner.do_send(SessionBound {
                    session_id,
                    subscription_id: hello.subscription_id,
                    queue_id,
                    application_id: self.principal.application_id.clone(),
                    credential_id: self.principal.credential_id.clone(),
                    capacity,
                    room,
                    connection: ctx.address().recipient(),
                    waiter: Waiter::while_alive(&self.session_alive),
                });
            }
            Ok(OpenSession::NotFound) => self.fail(
                ctx,
                Some(&reply_to),
                ErrorCode::NotFound,
                "subscription not found",
                CloseCode::Policy,
            ),
            Ok(OpenSession::HistoryExpired(earliest)) => self.fail(
                ctx,
                Some(&reply_to),
                ErrorCode::EventHistoryExpired,
                &history_message(earliest),
                CloseCode::Policy,
            ),
            Ok(OpenSession::Revoked) => self.fail(
                ctx,
                Some(&reply_to),
                ErrorCode::Unauthenticated,
                REVOKED,
                CloseCode::Policy,
            ),
            Err(err) => {
                self.state.metrics.database_error(Operation::Hello);
                store::writer::log_failure(&err, "hello failed on the database");
                self.fail(
                    ctx,
                    Some(&reply_to),
                    ErrorCode::Unavailable,
                    UNAVAILABLE,
                    CloseCode::Error,
                )
            }
        }
    }

    pub(super) fn on_ack(
        &mut self,
        ctx: &mut Context<Self>,
        bound: Bound,
        env: ClientEnvelope,
        permit: OwnedSemaphorePermit,
    ) {
        let reply_to = env.message_id.clone();
        let ack = match env.ack() {
            Ok(a) => a,
            Err(err) => {
                let text = frames::error(
                    Some(&bound.session_id),
                    Some(&reply_to),
                    err.code(),
                    err.message(),
                );
                return self.send_now(ctx, text);
            }
        };
        let writes = self.state.writes.clone();
        let tx = self.write_tx.clone();
        let timeout = self.state.settings.timing.write_timeout();
        let credential_id = self.principal.credential_id.clone();
        let delivery_id = ack.delivery_id.clone();
        let session_id = bound.session_id.clone();
        let subscription_id = bound.subscription_id.clone();
        let queue_id = bound.queue_id.clone();
        let received = Instant::now();
        let fut = async move {
            let proof = LeaseProof {
                delivery_id: ack.delivery_id.clone(),
                epoch: ack.epoch,
                secret: ack.lease_secret,
            };
            // protocol.md §3: at most `capacity` ACKs wait for their commit;
            // past that this one waits here, holding its read permit.
            let waiting = bound.acks_waiting.clone().acquire_owned().await;
            let joined = writes
                .join_ack(AckRequest {
                    subscription_id: bound.subscription_id.clone(),
                    session_id: bound.session_id.clone(),
                    credential_id,
                    proof: proof.clone(),
                })
                .await;
            // In the group commit: the read queue takes the next frame.
            drop(permit);
            let outcome = joined.outcome().await;
            let text = match &outcome {
                Ok(AckOutcome::Acked {
                    event_id,
                    epoch,
                    acknowledged_at,
                    deduplicated,
                }) => frames::ack_reply(
                    &session_id,
                    &reply_to,
                    &frames::AckReply {
                        delivery_id: proof.delivery_id.to_string(),
                        event_id: event_id.to_string(),
                        epoch: U64Str(*epoch),
                        acknowledged_at: *acknowledged_at,
                        deduplicated: *deduplicated,
                    },
                ),
                Ok(AckOutcome::LeaseLost) => frames::error(
                    Some(&session_id),
                    Some(&reply_to),
                    ErrorCode::DeliveryLeaseLost,
                    "the lease proof is not the delivery's latest; wait for a new delivery",
                ),
                Ok(AckOutcome::NotFound) => frames::error(
                    Some(&session_id),
                    Some(&reply_to),
                    ErrorCode::NotFound,
                    "delivery not found in this subscription",
                ),
                Ok(AckOutcome::Revoked) => frames::error(
                    Some(&session_id),
                    Some(&reply_to),
                    ErrorCode::Unauthenticated,
                    REVOKED,
                ),
                Err(err) => {
                    store::writer::log_failure(err, "ACK failed on the database");
                    frames::error(
                        Some(&session_id),
                        Some(&reply_to),
                        ErrorCode::Unavailable,
                        UNAVAILABLE,
                    )
                }
            };
            // The reply leaves only after the commit; waiting for room here
            // holds the ACK's place among the `capacity` waiting, which is
            // the backpressure on a client that does not read.
            let queued = socket::queue_text(&tx, text, timeout).await;
            drop(waiting);
            (outcome, queued)
        };
        self.in_flight += 1;
        ctx.spawn(
            tracing::Instrument::instrument(fut, self.span.clone())
                .into_actor(self)
                .map(move |(outcome, queued), act, ctx| {
                    act.in_flight -= 1;
                    let metrics = &act.state.metrics;
                    metrics.ack_finished(received.elapsed());
                    match &outcome {
                        Ok(AckOutcome::Acked {
                            deduplicated: false,
                            ..
                        }) => metrics.acked(&queue_id),
                        Ok(AckOutcome::Acked { .. }) => {
                            metrics.outcome(Outcome::AckDeduplicated, 1)
                        }
                        Ok(AckOutcome::LeaseLost) => metrics.outcome(Outcome::LeaseLost, 1),
                        Ok(AckOutcome::NotFound | AckOutcome::Revoked) => {}
                        Err(_) => metrics.database_error(Operation::Ack),
                    }
                    if !queued {
                        return ctx.stop();
                    }
                    match outcome {
                        Ok(AckOutcome::Acked { deduplicated, .. }) => {
                            if act.held.remove(&delivery_id).is_some() || !deduplicated {
                                act.report_demand();
                            }
                            if !deduplicated {
                                act.state.scanner.do_send(SubscriptionChanged {
                                    subscription_id,
                                    rows_available: false,
                                });
                            }
                        }
                        Ok(AckOutcome::LeaseLost) => {}
                        Ok(AckOutcome::NotFound) => {
                            act.close(ctx, CloseCode::Policy, "delivery not found")
                        }
                        Ok(AckOutcome::Revoked) => act.close(ctx, CloseCode::Policy, REVOKED),
                        Err(_) => act.close(ctx, CloseCode::Error, UNAVAILABLE),
                    }
                    act.finish_drain_if_idle(ctx);
                }),
        );
    }

    pub(super) fn on_ping(
        &mut self,
        ctx: &mut Context<Self>,
        bound: Bound,
        env: ClientEnvelope,
        permit: OwnedSemaphorePermit,
    ) {
        let reply_to = env.message_id.clone();
        if let Err(err) = env.ping() {
            let text = frames::error(
                Some(&bound.session_id),
                Some(&reply_to),
                err.code(),
                err.message(),
            );
            return self.send_now(ctx, text);
        }
        let db = self.state.db.clone();
        let credential_id = self.principal.credential_id.clone();
        let tx = self.write_tx.clone();
        let timeout = self.state.settings.timing.write_timeout();
        let session_id = bound.session_id.clone();
        let reply = reply_to.clone();
        let fut = async move {
            let result = revalidate(&db, &credential_id, &bound.subscription_id).await;
            // Like an ACK reply, a ping reply waits for room in the write
            // queue while holding its read permit: a client that pings
            // without reading is slowed down (backpressure), never buffered.
            let mut queued = true;
            if let Ok(Revalidation::Ok { enabled }) = &result {
                let text = frames::ping_reply(
                    &session_id,
                    &reply,
                    &frames::PingReply {
                        server_time: now(),
                        enabled: *enabled,
                    },
                );
                queued = socket::queue_text(&tx, text, timeout).await;
            }
            drop(permit);
            (result, queued)
        };
        self.in_flight += 1;
        ctx.spawn(
            tracing::Instrument::instrument(fut, self.span.clone())
                .into_actor(self)
                .map(move |(result, queued), act, ctx| {
                    act.in_flight -= 1;
                    match result {
                        Ok(Revalidation::Ok { .. }) if !queued => ctx.stop(),
                        Ok(Revalidation::Ok { .. }) => {}
                        Ok(Revalidation::Revoked) => act.fail(
                            ctx,
                            Some(&reply_to),
                            ErrorCode::Unauthenticated,
                            REVOKED,
                            CloseCode::Policy,
                        ),
                        Ok(Revalidation::Denied) => act.fail(
                            ctx,
                            Some(&reply_to),
                            ErrorCode::PermissionDenied,
                            "the credential lacks the events:consume permission",
                            CloseCode::Policy,
                        ),
                        Ok(Revalidation::OutOfScope) => act.fail(
                            ctx,
                            Some(&reply_to),
                            ErrorCode::NotFound,
                            "subscription not found",
                            CloseCode::Policy,
                        ),
                        Err(err) => {
                            act.state.metrics.database_error(Operation::Ping);
                            store::writer::log_failure(
                                &err,
                                "ping re-validation failed on the database",
                            );
                            act.fail(
                                ctx,
                                Some(&reply_to),
                                ErrorCode::Unavailable,
                                UNAVAILABLE,
                                CloseCode::Error,
                            )
                        }
                    }
                    act.finish_drain_if_idle(ctx);
                }),
        );
    }
}

pub(super) const UNAVAILABLE: &str = "the service is temporarily unavailable; reconnect later";
pub(super) const REVOKED: &str = "the credential was revoked";

pub(super) fn history_message(earliest: u64) -> String {
    format!("event history was purged; the earliest available sequence is {earliest}")
}

enum Revalidation {
    Ok {
        enabled: bool,
    },
    Revoked,
    /// The credential no longer holds `events:consume`.
    Denied,
    OutOfScope,
}

/// Re-checks the credential (revoked, `events:consume`) and the
/// subscription scope (on ping; protocol.md §3).
async fn revalidate(
    db: &store::Database,
    credential_id: &crate::domain::CredentialId,
    subscription_id: &SubscriptionId,
) -> Result<Revalidation, StoreError> {
    let Some(principal) = store::tenancy::principal_by_id(db.reader(), credential_id).await? else {
        return Ok(Revalidation::Revoked);
    };
    if !principal.permissions.contains(Permission::EventsConsume) {
        return Ok(Revalidation::Denied);
    }
    let owned =
        store::subscriptions::find_owned(db.reader(), &principal, subscription_id.as_str()).await?;
    Ok(match owned {
        Some(sub) => Revalidation::Ok {
            enabled: sub.enabled,
        },
        None => Revalidation::OutOfScope,
    })
}

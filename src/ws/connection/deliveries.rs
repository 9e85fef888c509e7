//! The leases a claim brings this connection (sent by the lease pool): each
//! becomes an `event.deliver` frame, queued only after its lease committed
//! (protocol.md §3), or the claim's refusal closes the connection.

use std::time::{Duration, Instant};

use actix::prelude::*;
use actix_ws::CloseCode;

use crate::{
    domain::DeliveryId,
    error::ErrorCode,
    store::{StoreError, claim::ClaimOutcome, deliveries::DeliveryView},
    ws::frames::{self},
};

use super::requests::{UNAVAILABLE, history_message};
use super::*;

impl ConnectionActor {
    pub(super) fn on_leased(
        &mut self,
        ctx: &mut Context<Self>,
        outcome: Result<ClaimOutcome, StoreError>,
    ) {
        let Phase::Bound(bound) = &self.phase else {
            // Closing: the leases expire and are redelivered.
            return;
        };
        let session_id = bound.session_id.clone();
        match outcome {
            Ok(ClaimOutcome::Leased { deliveries, .. }) => {
                if deliveries.is_empty() {
                    return self.report_demand();
                }
                let lease = self.state.settings.timing.lease();
                let deadline = Instant::now() + lease;
                let mut texts = Vec::with_capacity(deliveries.len());
                for leased in &deliveries {
                    self.held
                        .insert(DeliveryId::from_db(leased.delivery.id.clone()), deadline);
                    texts.push(frames::deliver(
                        &session_id,
                        &frames::Deliver {
                            delivery: DeliveryView::from(&leased.delivery),
                            event: &leased.event,
                            lease_secret: leased.secret.encode(),
                        },
                    ));
                }
                let tx = self.write_tx.clone();
                let timeout = self.state.settings.timing.write_timeout();
                let fut = async move {
                    for text in texts {
                        if !socket::queue_text(&tx, text, timeout).await {
                            return false;
                        }
                    }
                    true
                };
                ctx.spawn(
                    tracing::Instrument::instrument(fut, self.span.clone())
                        .into_actor(self)
                        .map(|queued, act, ctx| {
                            if queued {
                                // The scanner set this session's room to 0 when the
                                // claim settled: always tell it the real room now.
                                act.last_reported_room = None;
                                act.report_demand();
                            } else {
                                ctx.stop();
                            }
                        }),
                );
                self.arm_lapse_timer(ctx);
            }
            Ok(ClaimOutcome::Paused) => self.report_demand(),
            Ok(ClaimOutcome::HistoryExpired(earliest)) => self.fail(
                ctx,
                None,
                ErrorCode::EventHistoryExpired,
                &history_message(earliest),
                CloseCode::Policy,
            ),
            Ok(ClaimOutcome::Revoked) => self.fail(
                ctx,
                None,
                ErrorCode::Unauthenticated,
                "the credential was revoked",
                CloseCode::Policy,
            ),
            Ok(ClaimOutcome::Gone) => self.fail(
                ctx,
                None,
                ErrorCode::NotFound,
                "subscription not found",
                CloseCode::Policy,
            ),
            Err(_) => self.fail(
                ctx,
                None,
                ErrorCode::Unavailable,
                UNAVAILABLE,
                CloseCode::Error,
            ),
        }
    }

    /// Forgets leases locally once they lapse, so room comes back: one timer
    /// at the earliest deadline held, set again after it fired while leases
    /// remain.
    fn arm_lapse_timer(&mut self, ctx: &mut Context<Self>) {
        if self.lapse_timer.is_some() {
            return;
        }
        let Some(earliest) = self.held.values().min().copied() else {
            return;
        };
        let wait = earliest.saturating_duration_since(Instant::now()) + Duration::from_millis(1);
        self.lapse_timer = Some(ctx.run_later(wait, |act, ctx| {
            act.lapse_timer = None;
            let now = Instant::now();
            act.held.retain(|_, deadline| *deadline > now);
            act.report_demand();
            act.arm_lapse_timer(ctx);
        }));
    }
}

//! How the scanner learns what a claim did: the session may claim again,
//! the subscription's known rows and backlog window, and entries a claim
//! left below the head (delivery-model.md §5, decisions 0062, 0064).

use actix::prelude::*;

use super::{ClaimSettled, ScannerActor};

impl Handler<ClaimSettled> for ScannerActor {
    type Result = ();

    fn handle(&mut self, msg: ClaimSettled, ctx: &mut Context<Self>) {
        let behind = msg.behind_head;
        let (leased, exhausted) = (msg.leased, msg.exhausted);
        let subscription_id = msg.subscription_id.clone();
        self.claim_settled(msg, ctx);
        // Entries still wait below the head (the claim found enough
        // PENDING rows, or its batch was full): the next round materializes
        // them, or leaves them to the next claim of a session still waiting.
        // A claim granted nothing (its session full by the database's
        // count, or gone) changed nothing: a session with room is left to
        // its claims, so marking it would ask the same claim again, in a
        // loop.
        let granted = leased > 0 || exhausted;
        if behind
            && granted
            && let Some(sub) = self.subscriptions.get_mut(&subscription_id)
            && !sub.window_full
        {
            sub.dirty = true;
            sub.left_behind = true;
            self.kick(ctx);
        }
        if leased == 0 {
            // Its session may have been the last one with room.
            self.materialize_if_nobody_waits(&subscription_id, ctx);
        }
    }
}

impl ScannerActor {
    fn claim_settled(&mut self, msg: ClaimSettled, ctx: &mut Context<Self>) {
        if let Some(sub) = self.subscriptions.get_mut(&msg.subscription_id) {
            sub.wanted_in_flight = sub
                .wanted_in_flight
                .saturating_sub(u64::from(msg.requested));
            if let Some(m) = msg.materialized {
                sub.caught_up = m.caught_up;
                sub.window_full = m.window_full;
                sub.refill_in = m.refill_after;
            }

            if msg.refused || msg.failed {
                // The rows it would have taken were not: the next round
                // asks every session with room again.
                sub.known_available = None;
            }
        }
        let Some(entry) = self.sessions.get_mut(&msg.session_id) else {
            return;
        };
        entry.claiming = false;
        if msg.refused || msg.failed {
            // Retried on a later round (the timer), never in a tight loop.
            return;
        }
        if msg.leased > 0 {
            // The connection reports its new room once it has queued these
            // deliveries (protocol.md §3: room in both its capacity and its
            // write queue); until then it has none.
            entry.room = 0;
            entry.reporting = true;
        }
        if let Some(sub) = self.subscriptions.get_mut(&msg.subscription_id) {
            if msg.exhausted && sub.window_full {
                // Nothing left to claim below a full window: refill now
                // (once: if it inserts nothing, claims stop as below).
                sub.window_full = false;
                sub.dirty = true;
                sub.refill = true;
                if sub.generation == entry.claim_generation {
                    sub.maybe_pending = false;
                    sub.known_available = Some(0);
                }
                self.kick(ctx);
            } else if msg.exhausted && sub.generation == entry.claim_generation {
                sub.maybe_pending = false;
                sub.known_available = Some(0);
            } else if msg.leased > 0 || msg.exhausted {
                // Not exhausted, or rows appeared (a materialization here, a
                // wake from another node) while this claim ran: look again.
                if !msg.exhausted {
                    sub.known_available = None;
                }
                self.kick(ctx);
            }
        }
    }
}

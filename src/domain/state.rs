//! Delivery states (spec: delivery-model.md §6): the wire and storage
//! vocabulary, defined once in `orbit-events-wire`.

pub use orbit_events_wire::DeliveryState;

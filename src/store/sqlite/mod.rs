//! The hot transactions' statements on SQLite (decision 0095): run in
//! place on the write round's own connection ([`WriteTxn::sqlite`]), with
//! fixed text prepared once per connection and rows read straight into the
//! store's types. The rules they carry out are decided in `store/` (the
//! ACK's proof, the claim's order and room); here is only how SQLite
//! states them cheaply.
//!
//! Every write here changes one row and says `OR FAIL`: a statement that
//! may abort half way makes SQLite copy each page it changes into a
//! statement journal first (5–10 % of the delivery thread, decision
//! 0096). One row cannot be half written, and a failed statement fails
//! its whole round, which is rolled back.
//!
//! [`WriteTxn::sqlite`]: crate::store::WriteTxn::sqlite

pub mod ack;
pub mod claim;
pub mod materialize;
pub mod publish;
pub mod reads;

/// Every hot statement of this module, by name, as it is run: the
/// history test explains each (`tests/api/history.rs`), so none walks the
/// history.
pub const HOT_STATEMENTS: &[(&str, &str)] = &[
    ("ack::READ", ack::READ),
    ("ack::REVOKED", ack::REVOKED),
    ("ack::ACK", ack::ACK),
    ("ack::PENDING_COUNT", ack::PENDING_COUNT),
    ("claim::SCOPE", claim::SCOPE),
    ("claim::SUBSCRIPTION_POSITION", claim::SUBSCRIPTION_POSITION),
    ("claim::ANY_LAPSED", claim::ANY_LAPSED),
    ("claim::HELD", claim::HELD),
    ("claim::PICK", claim::PICK),
    ("claim::LEASE", claim::LEASE),
    ("claim::RENDER", claim::RENDER),
    ("materialize::FIND", materialize::FIND),
    ("materialize::READ_AFTER", materialize::READ_AFTER),
    ("materialize::INSERT", materialize::INSERT),
    ("materialize::ADVANCE", materialize::ADVANCE),
    ("publish::EXPIRE_RECORD", publish::EXPIRE_RECORD),
    ("publish::READ_RECORD", publish::READ_RECORD),
    ("publish::ADVANCE_HEAD", publish::ADVANCE_HEAD),
    ("publish::APPEND", publish::APPEND),
    ("publish::RECORD", publish::RECORD),
    ("reads::PRINCIPAL", reads::PRINCIPAL),
];

use rusqlite::{CachedStatement, Connection};

use crate::store::{StoreError, WriteTxn, writer::sqlite_error};

/// `sql`, prepared once per connection and kept.
fn prepared<'c>(conn: &'c Connection, sql: &str) -> Result<CachedStatement<'c>, StoreError> {
    conn.prepare_cached(sql).map_err(sqlite_error)
}

/// Runs `f` on `txn`'s SQLite connection; on a transaction without one (a
/// database not on a file, refused at start) it is an invariant broken.
pub(crate) fn on<T>(
    txn: &WriteTxn,
    f: impl FnOnce(&Connection) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    txn.sqlite(f).unwrap_or_else(|| {
        Err(StoreError::invariant(
            "an SQLite write without its round connection",
        ))
    })
}

//! An SQLite write round's statements, run in place on a connection the
//! rounds own (decision 0090). sqlx runs each statement on its
//! connection's worker thread, one hand-off per statement and per row; a
//! round runs every member's statements through rusqlite on the task's own
//! thread: the hot ones directly (decision 0095), the rest behind a
//! sea-orm mock connection so their bodies keep their queries. Its
//! `BEGIN IMMEDIATE` and `COMMIT` run in place too, `BEGIN` on a blocking
//! thread only when another process holds the write lock (decision 0096).
//! The connection, and the statements it keeps prepared, live across
//! rounds; its hooks feed the writer's health (0076).

use std::{
    borrow::Cow,
    cell::Cell,
    collections::{BTreeMap, HashMap},
    ffi::c_int,
    fmt,
    sync::{Arc, LazyLock, Mutex, PoisonError, atomic::Ordering},
};

use super::WriterHealth;

use rusqlite::types::{Null, ValueRef};
use sea_orm::{
    ColumnTrait, ColumnType, DbBackend, DbErr, EntityTrait, ExecResult, IdenStatic, Iterable,
    MockDatabase, MockDatabaseTrait, MockExecResult, QueryResult, RuntimeErr, Statement,
    Transaction,
    sea_query::{OptionEnum, Value},
    sqlx,
};

/// Statements a round connection keeps prepared.
const PREPARED: usize = 256;

/// The statement runner of one write round, on the rounds' connection
/// until [`Direct::close`] gives it back. Cheap to clone; every clone is
/// the same runner.
#[derive(Clone)]
pub(crate) struct Direct(Arc<Mutex<State>>);

struct State {
    /// `None` once closed, or while a blocking thread runs `BEGIN` or
    /// `COMMIT` on it.
    conn: Option<rusqlite::Connection>,
    /// The failure of the last `BEGIN`, `COMMIT` or `ROLLBACK` (sea-orm's
    /// mock connection cannot return it; the writer asks for it).
    failure: Option<DbErr>,
    /// `BEGIN IMMEDIATE` ran before the mock transaction began.
    begun: bool,
    /// How long `BEGIN IMMEDIATE` may wait for another process's lock.
    busy_timeout: std::time::Duration,
    /// WAL frames after which a commit checkpoints.
    wal_autocheckpoint: u64,
    /// Nested transactions a member began (refused, see `begin`).
    nested: usize,
}

impl fmt::Debug for Direct {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Direct")
    }
}

impl Direct {
    /// A runner on `conn`, a round connection opened with `settings`
    /// ([`open`]).
    pub(crate) fn new(conn: rusqlite::Connection, settings: &RoundSettings) -> Direct {
        Direct(Arc::new(Mutex::new(State {
            conn: Some(conn),
            failure: None,
            begun: false,
            busy_timeout: settings.busy_timeout,
            wal_autocheckpoint: settings.wal_autocheckpoint,
            nested: 0,
        })))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The failure of the last `BEGIN`, `COMMIT` or `ROLLBACK`, once.
    pub(crate) fn take_failure(&self) -> Option<DbErr> {
        self.state().failure.take()
    }

    /// Ends the runner: a transaction still open is rolled back. Returns
    /// the connection when it is left outside a transaction (to be used
    /// again), `None` when it is not (it is dropped: closed).
    pub(crate) fn close(&self) -> Option<rusqlite::Connection> {
        let conn = self.state().conn.take()?;
        if !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        conn.is_autocommit().then_some(conn)
    }

    /// Runs `BEGIN IMMEDIATE`: in place when the file's write lock is free
    /// (always, unless a command such as `bootstrap` writes beside the
    /// node), else on a blocking thread, where it may wait up to the busy
    /// timeout without stalling the runtime the round's members run on.
    /// The mock transaction's own `begin` then does nothing.
    pub(crate) async fn begin(&self) -> Result<(), DbErr> {
        if !self.begin_in_place()? {
            self.off_thread("BEGIN IMMEDIATE").await?;
        }
        self.state().begun = true;
        Ok(())
    }

    /// `BEGIN IMMEDIATE` without waiting for a lock: false when another
    /// connection holds it (SQLITE_BUSY), and nothing began.
    fn begin_in_place(&self) -> Result<bool, DbErr> {
        let state = self.state();
        let conn = state.conn.as_ref().ok_or_else(closed)?;
        conn.busy_timeout(std::time::Duration::ZERO)
            .map_err(|e| exec_err(e, true))?;
        let begun = conn.execute_batch("BEGIN IMMEDIATE");
        conn.busy_timeout(state.busy_timeout)
            .map_err(|e| exec_err(e, true))?;
        match begun {
            Ok(()) => Ok(true),
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DatabaseBusy =>
            {
                Ok(false)
            }
            Err(e) => Err(exec_err(e, true)),
        }
    }

    /// Runs `COMMIT` in place; not when a member failed the round (a
    /// nested transaction). Its fsync holds this thread, but the next
    /// round could not begin before it anyway, and a hand-off to another
    /// thread and back cost more than the stall (decision 0096). Returns
    /// the frames the WAL holds after it (`None` when it wrote nothing),
    /// and checkpoints (`PASSIVE`) once they reach `wal_autocheckpoint`,
    /// as SQLite's own hook would have inside the `COMMIT` (decision 0107).
    pub(crate) fn commit(&self) -> Result<Option<u64>, DbErr> {
        if let Some(failure) = self.take_failure() {
            return Err(failure);
        }
        let state = self.state();
        let conn = state.conn.as_ref().ok_or_else(closed)?;
        WAL_FRAMES.with(|frames| frames.set(None));
        conn.execute_batch("COMMIT")
            .map_err(|e| exec_err(e, true))?;
        let frames = WAL_FRAMES.with(Cell::take);
        if frames.is_some_and(|frames| frames >= state.wal_autocheckpoint) {
            // Best effort, as SQLite's: one that fails or finds a reader in
            // the way is tried again after a later commit.
            if let Err(err) = super::checkpoints::passive(conn) {
                tracing::debug!(error = %err, "WAL autocheckpoint failed");
            }
        }
        Ok(frames)
    }

    /// Ends a nested transaction of a member (see `begin`): true when one
    /// was open.
    fn unnest(&self) -> bool {
        let mut state = self.state();
        let nested = state.nested > 0;
        state.nested = state.nested.saturating_sub(1);
        nested
    }

    /// Runs `sql` on a blocking thread that owns the connection for the
    /// time being. If this future is dropped meanwhile, that thread drops
    /// (closes) the connection and the next round opens another.
    async fn off_thread(&self, sql: &'static str) -> Result<(), DbErr> {
        let conn = self.state().conn.take().ok_or_else(closed)?;
        let ran = tokio::task::spawn_blocking(move || {
            let done = conn.execute_batch(sql);
            (conn, done)
        })
        .await;
        match ran {
            Ok((conn, done)) => {
                self.state().conn = Some(conn);
                done.map_err(|e| exec_err(e, true))
            }
            Err(err) => Err(DbErr::Conn(RuntimeErr::Internal(format!(
                "the thread of {sql} failed: {err}"
            )))),
        }
    }

    /// Runs `sql` (`BEGIN IMMEDIATE`, `COMMIT`, `ROLLBACK`); a failure is
    /// kept for [`Direct::take_failure`].
    fn control(&self, sql: &str) {
        let mut state = self.state();
        let failure = match &state.conn {
            Some(conn) => conn.execute_batch(sql).err().map(|e| exec_err(e, true)),
            None => Some(closed()),
        };
        if failure.is_some() {
            state.failure = failure;
        }
    }

    /// Runs `f` in place on the round's connection, inside its
    /// transaction: the hot statements without sea-orm (decision 0095).
    pub(crate) fn with_conn<T>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> Result<T, crate::store::StoreError>,
    ) -> Result<T, crate::store::StoreError> {
        let state = self.state();
        let conn = state.conn.as_ref().ok_or_else(closed)?;
        f(conn)
    }

    fn run<T>(
        &self,
        statement: &Statement,
        query: bool,
        body: impl FnOnce(&rusqlite::Connection, &Statement) -> rusqlite::Result<T>,
    ) -> Result<T, DbErr> {
        let state = self.state();
        let conn = state.conn.as_ref().ok_or_else(closed)?;
        body(conn, statement).map_err(|e| exec_err(e, !query))
    }
}

/// sea-orm's mock connection is its one public seam for a connection of
/// our own: its results are built by a throwaway `MockDatabase`, the only
/// public way to make a `QueryResult` or an `ExecResult` (decision 0090).
impl MockDatabaseTrait for Direct {
    fn execute(&mut self, _: usize, statement: Statement) -> Result<ExecResult, DbErr> {
        let (changes, rowid) = self.run(&statement, false, |conn, s| {
            run_statement(conn, s, drop)?;
            Ok((conn.changes(), conn.last_insert_rowid()))
        })?;
        MockDatabase::new(DbBackend::Sqlite)
            .append_exec_results([MockExecResult {
                last_insert_id: rowid as u64,
                rows_affected: changes,
            }])
            .execute(0, placeholder())
    }

    fn query(&mut self, _: usize, statement: Statement) -> Result<Vec<QueryResult>, DbErr> {
        let rows = self.run(&statement, true, |conn, s| {
            let mut rows = Vec::new();
            run_statement(conn, s, |row| rows.push(row))?;
            Ok(rows)
        })?;
        MockDatabase::new(DbBackend::Sqlite)
            .append_query_results([rows])
            .query(0, placeholder())
    }

    /// Begun already ([`Direct::begin`]), or here. A body that nests a
    /// transaction fails the round (its `COMMIT` would commit the others'
    /// statements half way): nothing of it is written.
    fn begin(&mut self) {
        let mut state = self.state();
        if std::mem::take(&mut state.begun) {
            return;
        }
        if state.conn.as_ref().is_some_and(|c| !c.is_autocommit()) {
            state.nested += 1;
            state.failure = Some(DbErr::Custom(
                "a write round's member began a nested transaction".to_owned(),
            ));
            return;
        }
        drop(state);
        self.control("BEGIN IMMEDIATE");
    }

    fn commit(&mut self) {
        if !self.unnest() {
            self.control("COMMIT");
        }
    }

    /// Also a transaction dropped unfinished: nothing to do when SQLite
    /// already ended it.
    fn rollback(&mut self) {
        if self.unnest() {
            return;
        }
        let open = self
            .state()
            .conn
            .as_ref()
            .is_some_and(|c| !c.is_autocommit());
        if open {
            self.control("ROLLBACK");
        }
    }

    fn drain_transaction_log(&mut self) -> Vec<Transaction> {
        Vec::new()
    }

    fn get_database_backend(&self) -> DbBackend {
        DbBackend::Sqlite
    }

    fn ping(&self) -> Result<(), DbErr> {
        self.state().conn.as_ref().map(drop).ok_or_else(closed)
    }
}

/// The statement handed to the throwaway `MockDatabase` (it only logs it).
fn placeholder() -> Statement {
    Statement::from_string(DbBackend::Sqlite, String::new())
}

/// How a round connection is opened: the settings of the sqlx write pool
/// (`store::connect_sqlite`).
#[derive(Clone, Debug)]
pub(crate) struct RoundSettings {
    pub(crate) path: std::path::PathBuf,
    /// `PRAGMA synchronous` (FULL unless the URL says otherwise).
    pub(crate) synchronous: &'static str,
    pub(crate) busy_timeout: std::time::Duration,
    /// WAL frames after which a commit checkpoints (`PRAGMA
    /// wal_autocheckpoint` on the pools; [`Direct::commit`] here).
    pub(crate) wal_autocheckpoint: u64,
}

thread_local! {
    /// The frames in the WAL after the last commit of a round connection
    /// on this thread, set by its WAL hook ([`wal_committed`]) inside the
    /// `COMMIT` and taken right after it by [`Direct::commit`].
    static WAL_FRAMES: Cell<Option<u64>> = const { Cell::new(None) };
}

/// A round connection's WAL hook, called inside each `COMMIT` that wrote
/// frames: keeps how many the WAL holds now. It replaces SQLite's own
/// hook, the autocheckpoint, which [`Direct::commit`] runs instead. Never
/// fails: an error here would fail a `COMMIT` that has committed.
fn wal_committed(_: &rusqlite::hooks::Wal, frames: c_int) -> rusqlite::Result<()> {
    WAL_FRAMES.with(|cell| cell.set(u64::try_from(frames).ok()));
    Ok(())
}

/// Opens a round connection on the database file with the write pool's
/// pragmas, and hooks that count its commits, rollbacks and changed rows
/// into `health` (decision 0076).
pub(crate) fn open(
    settings: &RoundSettings,
    health: &Arc<WriterHealth>,
) -> Result<rusqlite::Connection, DbErr> {
    use rusqlite::OpenFlags;
    let conn = rusqlite::Connection::open_with_flags(
        &settings.path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(open_err)?;
    conn.busy_timeout(settings.busy_timeout).map_err(open_err)?;
    let mut pragmas = format!(
        "PRAGMA journal_mode = WAL; PRAGMA foreign_keys = ON; PRAGMA synchronous = {}; \
         PRAGMA temp_store = memory;",
        settings.synchronous
    );
    let pages = health.max_page_count.load(Ordering::Acquire);
    if pages > 0 {
        pragmas.push_str(&format!(" PRAGMA max_page_count = {pages};"));
    }
    conn.execute_batch(&pragmas).map_err(open_err)?;
    conn.set_prepared_statement_cache_capacity(PREPARED);
    conn.wal_hook(Some(wal_committed));
    let commits = health.clone();
    // `false`: let the commit go on.
    conn.commit_hook(Some(move || {
        commits.rounds.commits.fetch_add(1, Ordering::AcqRel);
        false
    }))
    .map_err(open_err)?;
    let rollbacks = health.clone();
    conn.rollback_hook(Some(move || {
        rollbacks.rounds.rollbacks.fetch_add(1, Ordering::AcqRel);
    }))
    .map_err(open_err)?;
    let changes = health.clone();
    conn.update_hook(Some(
        move |_: rusqlite::hooks::Action, _: &str, _: &str, _: i64| {
            changes.rounds.changes.fetch_add(1, Ordering::AcqRel);
        },
    ))
    .map_err(open_err)?;
    Ok(conn)
}

/// Prepares (or reuses) `statement`, binds its values and steps it, handing
/// each returned row to `row`.
fn run_statement(
    conn: &rusqlite::Connection,
    statement: &Statement,
    mut row: impl FnMut(BTreeMap<String, Value>),
) -> rusqlite::Result<()> {
    let values = statement.values.as_ref().map_or(&[][..], |v| &v.0[..]);
    let mut prepared = match conn.prepare_cached(&statement.sql) {
        Ok(prepared) => prepared,
        // Several statements in one text (migrations, tests): no values.
        Err(rusqlite::Error::MultipleStatement) if values.is_empty() => {
            return conn.execute_batch(&statement.sql);
        }
        Err(err) => return Err(err),
    };
    if prepared.parameter_count() != values.len() {
        return Err(rusqlite::Error::InvalidParameterCount(
            values.len(),
            prepared.parameter_count(),
        ));
    }
    for (i, value) in values.iter().enumerate() {
        bind(&mut prepared, i + 1, value)?;
    }
    if prepared.column_count() == 0 {
        prepared.raw_execute()?;
        return Ok(());
    }
    let columns = columns(&prepared);
    let mut rows = prepared.raw_query();
    while let Some(r) = rows.next()? {
        let mut values = BTreeMap::new();
        for (i, column) in columns.iter().enumerate() {
            let value = decode(r.get_ref(i)?, column.kind, i)?;
            values.insert(column.position.clone(), value.clone());
            // The first column of a name wins, as with sqlx.
            values.entry(column.name.clone()).or_insert(value);
        }
        row(values);
    }
    Ok(())
}

/// A result column: its name, a key that sorts in column order (sea-orm's
/// mock row reads by position in key order), and the value it decodes to.
struct Column {
    name: String,
    position: String,
    kind: Kind,
}

fn columns(prepared: &rusqlite::Statement<'_>) -> Vec<Column> {
    let declared = prepared.columns();
    prepared
        .columns_with_metadata()
        .iter()
        .zip(&declared)
        .enumerate()
        .map(|(i, (c, d))| Column {
            name: c.name().to_owned(),
            // U+0001 sorts before every name; at most 1,000 columns.
            position: format!("\u{1}{i:03}"),
            kind: kind_of(c.table_name(), c.origin_name(), d.decl_type()),
        })
        .collect()
}

/// The `sea_query::Value` variant a column decodes to: sea-orm's mock
/// rows convert only from the variant of the field's Rust type (`i32` from
/// `Int`, `i64` from `BigInt`), which SQLite's `INTEGER` does not tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    TinyInt,
    SmallInt,
    Int,
    BigInt,
    Bool,
    Float,
    Double,
    Text,
    Bytes,
    /// An expression: by the value's storage class (integers as `i64`).
    Storage,
}

/// The entities' columns by table, from their sea-orm definitions.
static ENTITY_KINDS: LazyLock<HashMap<&'static str, HashMap<&'static str, Kind>>> =
    LazyLock::new(|| {
        let mut kinds = HashMap::new();
        add::<entity::application::Entity>(&mut kinds);
        add::<entity::audit_record::Entity>(&mut kinds);
        add::<entity::credential::Entity>(&mut kinds);
        add::<entity::delivery::Entity>(&mut kinds);
        add::<entity::delivery_history::Entity>(&mut kinds);
        add::<entity::event_session::Entity>(&mut kinds);
        add::<entity::idempotency_record::Entity>(&mut kinds);
        add::<entity::namespace::Entity>(&mut kinds);
        add::<entity::queue::Entity>(&mut kinds);
        add::<entity::result_event::Entity>(&mut kinds);
        add::<entity::signing_key::Entity>(&mut kinds);
        add::<entity::subscription::Entity>(&mut kinds);
        kinds
    });

fn add<E: EntityTrait>(kinds: &mut HashMap<&'static str, HashMap<&'static str, Kind>>) {
    let table = kinds.entry(E::default().table_name()).or_default();
    for column in E::Column::iter() {
        let kind = match column.def().get_column_type() {
            ColumnType::TinyInteger | ColumnType::TinyUnsigned => Kind::TinyInt,
            ColumnType::SmallInteger | ColumnType::SmallUnsigned => Kind::SmallInt,
            ColumnType::Integer | ColumnType::Unsigned => Kind::Int,
            ColumnType::BigInteger | ColumnType::BigUnsigned => Kind::BigInt,
            ColumnType::Boolean => Kind::Bool,
            ColumnType::Float => Kind::Float,
            ColumnType::Double => Kind::Double,
            ColumnType::Char(_) | ColumnType::String(_) | ColumnType::Text => Kind::Text,
            ColumnType::Binary(_) | ColumnType::VarBinary(_) | ColumnType::Blob => Kind::Bytes,
            _ => Kind::Storage,
        };
        table.insert(column.as_str(), kind);
    }
}

fn kind_of(table: Option<&str>, origin: Option<&str>, declared: Option<&str>) -> Kind {
    if let (Some(table), Some(origin)) = (table, origin)
        && let Some(kind) = ENTITY_KINDS.get(table).and_then(|t| t.get(origin))
    {
        return *kind;
    }
    // Another table: SQLite's affinity rules on the declared type.
    let Some(declared) = declared.map(str::to_ascii_uppercase) else {
        return Kind::Storage;
    };
    if declared.contains("BOOL") {
        Kind::Bool
    } else if declared.contains("INT") {
        Kind::BigInt
    } else if ["CHAR", "CLOB", "TEXT"]
        .iter()
        .any(|t| declared.contains(t))
    {
        Kind::Text
    } else if declared.contains("BLOB") {
        Kind::Bytes
    } else if ["REAL", "FLOA", "DOUB"]
        .iter()
        .any(|t| declared.contains(t))
    {
        Kind::Double
    } else {
        Kind::Storage
    }
}

fn decode(value: ValueRef<'_>, kind: Kind, column: usize) -> rusqlite::Result<Value> {
    let narrow = |i: i64| rusqlite::Error::IntegralValueOutOfRange(column, i);
    Ok(match (value, kind) {
        (ValueRef::Null, kind) => match kind {
            Kind::TinyInt => Value::TinyInt(None),
            Kind::SmallInt => Value::SmallInt(None),
            Kind::Int => Value::Int(None),
            Kind::Bool => Value::Bool(None),
            Kind::Float => Value::Float(None),
            Kind::Double => Value::Double(None),
            Kind::Text => Value::String(None),
            Kind::Bytes => Value::Bytes(None),
            Kind::BigInt | Kind::Storage => Value::BigInt(None),
        },
        (ValueRef::Integer(i), Kind::TinyInt) => {
            Value::TinyInt(Some(i8::try_from(i).map_err(|_| narrow(i))?))
        }
        (ValueRef::Integer(i), Kind::SmallInt) => {
            Value::SmallInt(Some(i16::try_from(i).map_err(|_| narrow(i))?))
        }
        (ValueRef::Integer(i), Kind::Int) => {
            Value::Int(Some(i32::try_from(i).map_err(|_| narrow(i))?))
        }
        (ValueRef::Integer(i), Kind::Bool) => Value::Bool(Some(i != 0)),
        (ValueRef::Integer(i), _) => Value::BigInt(Some(i)),
        (ValueRef::Real(f), Kind::Float) => Value::Float(Some(f as f32)),
        (ValueRef::Real(f), _) => Value::Double(Some(f)),
        (ValueRef::Text(t), _) => Value::String(Some(
            std::str::from_utf8(t)
                .map_err(|e| rusqlite::Error::Utf8Error(column, e))?
                .to_owned(),
        )),
        (ValueRef::Blob(b), _) => Value::Bytes(Some(b.to_vec())),
    })
}

/// Binds `value` as sqlx binds it on SQLite (sea-query-sqlx), so rows
/// written here read the same through sqlx.
fn bind(prepared: &mut rusqlite::Statement<'_>, i: usize, value: &Value) -> rusqlite::Result<()> {
    match value {
        Value::Bool(Some(b)) => prepared.raw_bind_parameter(i, b),
        Value::TinyInt(Some(n)) => prepared.raw_bind_parameter(i, n),
        Value::SmallInt(Some(n)) => prepared.raw_bind_parameter(i, n),
        Value::Int(Some(n)) => prepared.raw_bind_parameter(i, n),
        Value::BigInt(Some(n)) => prepared.raw_bind_parameter(i, n),
        Value::TinyUnsigned(Some(n)) => prepared.raw_bind_parameter(i, n),
        Value::SmallUnsigned(Some(n)) => prepared.raw_bind_parameter(i, n),
        Value::Unsigned(Some(n)) => prepared.raw_bind_parameter(i, n),
        Value::BigUnsigned(Some(n)) => {
            let n = i64::try_from(*n)
                .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
            prepared.raw_bind_parameter(i, n)
        }
        Value::Float(Some(f)) => prepared.raw_bind_parameter(i, f64::from(*f)),
        Value::Double(Some(f)) => prepared.raw_bind_parameter(i, f),
        Value::String(Some(s)) => prepared.raw_bind_parameter(i, s.as_str()),
        Value::Enum(OptionEnum::Some(e)) => prepared.raw_bind_parameter(i, e.value.as_ref()),
        Value::Char(Some(c)) => prepared.raw_bind_parameter(i, c.to_string()),
        Value::Bytes(Some(b)) => prepared.raw_bind_parameter(i, b.as_slice()),
        Value::Json(Some(j)) => {
            let text = serde_json::to_string(j)
                .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
            prepared.raw_bind_parameter(i, text)
        }
        Value::Bool(None)
        | Value::TinyInt(None)
        | Value::SmallInt(None)
        | Value::Int(None)
        | Value::BigInt(None)
        | Value::TinyUnsigned(None)
        | Value::SmallUnsigned(None)
        | Value::Unsigned(None)
        | Value::BigUnsigned(None)
        | Value::Float(None)
        | Value::Double(None)
        | Value::String(None)
        | Value::Enum(OptionEnum::None(_))
        | Value::Char(None)
        | Value::Bytes(None)
        | Value::Json(None) => prepared.raw_bind_parameter(i, Null),
        other => Err(rusqlite::Error::ToSqlConversionFailure(
            format!("no SQLite binding for {other:?}").into(),
        )),
    }
}

/// An error SQLite returned, as sqlx would report it: its extended result
/// code, read by the writer's fault rules (`health::sqlite_fault`).
#[derive(Debug)]
pub struct DirectError {
    code: i32,
    message: String,
}

impl fmt::Display for DirectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "(code: {}) {}", self.code, self.message)
    }
}

impl std::error::Error for DirectError {}

impl sqlx::error::DatabaseError for DirectError {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Owned(self.code.to_string()))
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        use sqlx::error::ErrorKind;
        match self.code {
            // SQLITE_CONSTRAINT_UNIQUE, _PRIMARYKEY
            2067 | 1555 => ErrorKind::UniqueViolation,
            // SQLITE_CONSTRAINT_FOREIGNKEY
            787 => ErrorKind::ForeignKeyViolation,
            // SQLITE_CONSTRAINT_NOTNULL
            1299 => ErrorKind::NotNullViolation,
            // SQLITE_CONSTRAINT_CHECK
            275 => ErrorKind::CheckViolation,
            _ => ErrorKind::Other,
        }
    }
}

/// `err` as sea-orm reports a failed statement: an SQLite error carries its
/// code; anything else (a value that does not bind or decode) is the
/// statement's own failure, not the connection's.
fn exec_err(err: rusqlite::Error, exec: bool) -> DbErr {
    let runtime = match err {
        rusqlite::Error::SqliteFailure(code, message) => {
            RuntimeErr::SqlxError(Arc::new(sqlx::Error::Database(Box::new(DirectError {
                code: code.extended_code,
                message: message.unwrap_or_else(|| code.to_string()),
            }))))
        }
        other => return DbErr::Type(other.to_string()),
    };
    if exec {
        DbErr::Exec(runtime)
    } else {
        DbErr::Query(runtime)
    }
}

/// A failed statement of the hot path (decision 0095) as the writer's
/// fault rules read it: an SQLite error keeps its extended code.
pub(crate) fn sqlite_error(err: rusqlite::Error) -> crate::store::StoreError {
    exec_err(err, true).into()
}

/// An error opening a round connection: an SQLite one keeps its code
/// (CANTOPEN, READONLY: `io`; FULL: `disk_full`).
fn open_err(err: rusqlite::Error) -> DbErr {
    match err {
        rusqlite::Error::SqliteFailure(..) => exec_err(err, true),
        other => DbErr::Conn(RuntimeErr::Internal(other.to_string())),
    }
}

fn closed() -> DbErr {
    DbErr::Conn(RuntimeErr::Internal(
        "the write round ended; its connection was given back".to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_connection_keeps_the_write_pools_durability_and_counts_its_commits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.db");
        rusqlite::Connection::open(&path)
            .unwrap()
            .execute_batch("PRAGMA journal_mode = WAL; CREATE TABLE t (v TEXT)")
            .unwrap();
        let health = Arc::new(WriterHealth::default());
        let settings = RoundSettings {
            path,
            synchronous: "FULL",
            busy_timeout: std::time::Duration::from_secs(5),
            wal_autocheckpoint: 8192,
        };
        let conn = open(&settings, &health).unwrap();
        let pragma = |name: &str| -> String {
            conn.query_row(&format!("PRAGMA {name}"), [], |r| {
                r.get::<_, rusqlite::types::Value>(0)
            })
            .map(|v| format!("{v:?}"))
            .unwrap()
        };
        // FULL is 2; WAL; foreign keys on.
        assert_eq!(pragma("synchronous"), "Integer(2)");
        assert_eq!(pragma("journal_mode"), "Text(\"wal\")");
        assert_eq!(pragma("foreign_keys"), "Integer(1)");
        conn.execute_batch("BEGIN IMMEDIATE; INSERT INTO t VALUES ('a'); COMMIT")
            .unwrap();
        assert_eq!(health.rounds.commits(), 1);
        assert_eq!(health.pool.commits(), 0);
        assert_eq!(health.rounds.changes(), 1);
        conn.execute_batch("BEGIN IMMEDIATE; INSERT INTO t VALUES ('b'); ROLLBACK")
            .unwrap();
        assert_eq!(health.rounds.rollbacks(), 1);
    }

    #[test]
    fn entity_columns_decode_to_their_rust_types_variant() {
        assert_eq!(
            kind_of(Some("deliveries"), Some("attempts"), Some("INTEGER")),
            Kind::Int
        );
        assert_eq!(
            kind_of(Some("deliveries"), Some("sequence"), Some("INTEGER")),
            Kind::BigInt
        );
        assert_eq!(
            kind_of(Some("subscriptions"), Some("enabled"), Some("boolean")),
            Kind::Bool
        );
        assert_eq!(
            kind_of(Some("deliveries"), Some("state"), Some("varchar(16)")),
            Kind::Text
        );
        assert_eq!(kind_of(None, None, None), Kind::Storage);
        assert_eq!(kind_of(Some("t"), Some("v"), Some("TEXT")), Kind::Text);
    }
}

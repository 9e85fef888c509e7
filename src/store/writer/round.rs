//! Write rounds on SQLite (decision 0078): SQLite has one writer, so the
//! writes that come while a round is open take a seat in it, run their
//! statements in turn on its transaction, and share its one commit (one
//! fsync). Nothing is answered before the writer confirmed that commit;
//! `Err` means nothing of that member was written. A member failing on a
//! fault fails every member; one failing on its own rules spoils the round
//! and the others run again alone (no savepoints: after a fault SQLite has
//! rolled the whole transaction back, and later statements would commit on
//! their own). A round seats at most [`MAX_SEATS`] members and begins as
//! soon as the previous one committed, so grouping costs no waiting; once
//! its members have left it yields to its thread a few times before it
//! closes, so that writes already runnable there (the claim its publish
//! woke) share its commit (decision 0098).

use std::sync::{
    Arc, Mutex, PoisonError,
    atomic::{AtomicU64, Ordering},
};

use tokio::sync::{Notify, watch};

use super::{StoreError, WriteError, WriteTxn, direct::Direct};
use crate::store::Database;

/// Members of one round at most.
pub const MAX_SEATS: usize = 32;

/// Yields, with every seated member gone and nobody new, before a round
/// closes (decision 0098): enough for a claim woken by a publish of the
/// round to reach its seat through the scanner and the pool, which run on
/// the same thread. No timer: an idle node commits at once.
const LATE_SEAT_YIELDS: u32 = 3;

/// The rounds of one SQLite database (one per [`Database`]).
#[derive(Debug, Default)]
pub(crate) struct Rounds {
    /// The round newcomers join while it admits them.
    current: Mutex<Option<Arc<Round>>>,
    /// Rounds started so far.
    started: AtomicU64,
}

#[derive(Debug)]
struct Round {
    seats: Mutex<Seats>,
    /// The round's transaction; a member holds the lock while its
    /// statements run, so members never interleave.
    txn: tokio::sync::Mutex<Option<WriteTxn>>,
    phase: watch::Sender<Phase>,
    /// Signalled when a member leaves its seat.
    left: Notify,
}

#[derive(Debug, Default)]
struct Seats {
    taken: usize,
    left: usize,
    /// True once the round began to commit (or failed to begin).
    closed: bool,
    /// A member failed or was dropped half way: roll back.
    spoiled: bool,
    /// The fault of the database a member failed on, or the transaction was
    /// found rolled back: every member answers it.
    fault: Option<StoreError>,
}

#[derive(Debug, Clone)]
enum Phase {
    /// Waiting for the previous round's commit.
    Forming,
    /// The transaction began; members run.
    Open,
    /// Committed (`Ok`), or failed to begin or commit, or rolled back
    /// (`Err`).
    Done(Result<(), StoreError>),
    /// Its driver was dropped before the round ended (the runtime it ran
    /// on stopped): nobody will commit it.
    Abandoned,
}

impl Rounds {
    /// Runs `body` as a member of the current round (or of a new one) on
    /// `db`'s writer; see the module documentation for the guarantees. A
    /// member whose round another member spoiled runs `body` again, alone
    /// in a round of its own (so on the same connection, decision 0095);
    /// one whose own body asks to run again ([`super::runs_again`]) takes a
    /// seat in a later round.
    pub(crate) async fn run<T, E, F>(&self, db: &Database, mut body: F) -> Result<T, E>
    where
        E: WriteError,
        F: for<'t> AsyncFnMut(&'t WriteTxn) -> Result<T, E>,
    {
        let mut attempt = 1;
        let mut alone = false;
        loop {
            let mut seat = self.take_seat(db, alone);
            let round = seat.round.clone();
            let mut phase = round.phase.subscribe();
            let opened = phase
                .wait_for(|p| !matches!(p, Phase::Forming))
                .await
                .map(|p| p.clone());
            match opened {
                Ok(Phase::Open) => {}
                Ok(Phase::Done(Err(err))) => return Err(err.into()),
                _ => return Err(round.abandon().await.into()),
            }
            // `None`: another member spoiled the round before this one's
            // turn, or SQLite rolled its transaction back (then a member's
            // statements would each commit on their own).
            let answer = {
                let txn = round.txn.lock().await;
                match txn.as_ref() {
                    Some(txn) if !txn.intact() => {
                        round.fault(rolled_back());
                        None
                    }
                    Some(txn) if !round.spoiled() => Some(body(txn).await),
                    _ => None,
                }
            };
            let fault = match &answer {
                Some(Err(err)) => err.store_error().filter(|e| e.fault().is_some()).cloned(),
                _ => None,
            };
            seat.leave(matches!(answer, Some(Err(_))), fault);
            // Even a member that failed waits for the round's end: once it
            // answers, its statements are rolled back, and a retry of its
            // caller never joins this round.
            let done = phase
                .wait_for(|p| matches!(p, Phase::Done(_) | Phase::Abandoned))
                .await
                .map(|p| p.clone());
            match (answer, done) {
                (Some(Err(err)), _) if attempt < super::ATTEMPTS && super::runs_again(&err) => {
                    attempt += 1;
                    continue;
                }
                (Some(Err(err)), _) => return Err(err),
                (Some(Ok(answer)), Ok(Phase::Done(Ok(())))) => return Ok(answer),
                // A fault of the database: rolled back for every member.
                (_, Ok(Phase::Done(Err(_)))) if let Some(fault) = round.fault_seen() => {
                    return Err(fault.into());
                }
                // Spoiled by another member: rolled back, nothing of this
                // one was written; it runs again alone, where another
                // member's failure never becomes this one's outcome.
                (_, Ok(Phase::Done(Err(_)))) if round.spoiled() && !alone => {
                    alone = true;
                    continue;
                }
                // The commit failed: rolled back for every member.
                (_, Ok(Phase::Done(Err(err)))) => return Err(err.into()),
                _ => return Err(round.abandon().await.into()),
            }
        }
    }

    /// Rounds started so far (each one `BEGIN`, at most one `COMMIT`).
    pub(crate) fn started(&self) -> u64 {
        self.started.load(Ordering::Relaxed)
    }

    /// Members seated in the round that admits newcomers (0 when none does).
    pub(crate) fn seated(&self) -> usize {
        let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        current.as_ref().map_or(0, |round| {
            let seats = round.seats.lock().unwrap_or_else(PoisonError::into_inner);
            if seats.closed || seats.spoiled {
                0
            } else {
                seats.taken
            }
        })
    }

    /// A seat in the round that admits newcomers, or in a new round whose
    /// driver starts now and begins once the writer is free; `alone`: in a
    /// new round that admits nobody else.
    fn take_seat(&self, db: &Database, alone: bool) -> Seat {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(round) = current.as_ref().filter(|_| !alone) {
            let mut seats = round.seats.lock().unwrap_or_else(PoisonError::into_inner);
            if !seats.closed && !seats.spoiled && seats.taken < MAX_SEATS {
                seats.taken += 1;
                drop(seats);
                return Seat {
                    round: round.clone(),
                    seated: true,
                };
            }
        }
        let round = Arc::new(Round {
            seats: Mutex::new(Seats {
                taken: 1,
                ..Seats::default()
            }),
            txn: tokio::sync::Mutex::new(None),
            phase: watch::Sender::new(Phase::Forming),
            left: Notify::new(),
        });
        if !alone {
            *current = Some(round.clone());
        }
        self.started.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(drive(round.clone(), db.clone()));
        Seat {
            round,
            seated: true,
        }
    }
}

/// A member's place in a round; leaving it (also by being dropped) lets
/// the round commit once everyone has left.
struct Seat {
    round: Arc<Round>,
    seated: bool,
}

impl Seat {
    /// Leaves the seat once; `failed` spoils the round, a `fault` of the
    /// database fails it for every member.
    fn leave(&mut self, failed: bool, fault: Option<StoreError>) {
        if std::mem::take(&mut self.seated) {
            let mut seats = self
                .round
                .seats
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            seats.left += 1;
            seats.spoiled |= failed;
            if seats.fault.is_none() {
                seats.fault = fault;
            }
            drop(seats);
            self.round.left.notify_one();
        }
    }
}

impl Drop for Seat {
    /// A member dropped before it left ran part of its statements at most.
    fn drop(&mut self) {
        self.leave(true, None);
    }
}

impl Round {
    /// Closes the round to newcomers.
    fn close(&self) {
        self.seats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .closed = true;
    }

    /// What a member of an abandoned round answers. Its transaction is
    /// dropped (rolled back) here, on a live runtime, so that the writer
    /// connection goes back to its pool for the rounds after it.
    async fn abandon(&self) -> StoreError {
        drop(self.txn.lock().await.take());
        abandoned()
    }

    fn spoiled(&self) -> bool {
        self.seats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .spoiled
    }

    /// Fails the round for every member with `fault`.
    fn fault(&self, fault: StoreError) {
        let mut seats = self.seats.lock().unwrap_or_else(PoisonError::into_inner);
        seats.spoiled = true;
        if seats.fault.is_none() {
            seats.fault = Some(fault);
        }
    }

    fn fault_seen(&self) -> Option<StoreError> {
        self.seats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .fault
            .clone()
    }
}

/// Begins the round once the writer is free, lets its members run, then
/// closes it and commits when every seated member has left.
async fn drive(round: Arc<Round>, db: Database) {
    // Dropped with this task (its runtime stopped): newcomers then start a
    // new round instead of waiting for this one, and its members stop
    // waiting for it.
    let closer = CloseOnDrop(&round);
    let writer = &db.writer;
    let _turn = writer.take_turn().await;
    writer.keep_headroom().await;
    // The round's statements run in place on the rounds' own connection
    // (decision 0090); on an in-memory database, through sqlx.
    let (begun, closing) = match writer.round_connection().await {
        Some(Ok((generation, direct))) => (
            writer.begin_direct(&direct).await,
            Some(CloseDirect {
                direct,
                writer,
                generation,
            }),
        ),
        Some(Err(err)) => return failed_to_begin(&round, err),
        None => (writer.begin_in_turn().await, None),
    };
    match begun {
        Ok(txn) => *round.txn.lock().await = Some(txn),
        Err(err) => return failed_to_begin(&round, err),
    }
    round.phase.send_replace(Phase::Open);
    // Once everyone has left, the round yields a few times before it
    // closes: work already runnable on this thread (the claim a publish of
    // this round woke, an ACK batch) takes a seat and shares the commit.
    let mut quiet_yields = 0;
    let mut seen = 0;
    let (rolled_back, fault) = loop {
        let left = round.left.notified();
        let all_left = {
            let mut seats = round.seats.lock().unwrap_or_else(PoisonError::into_inner);
            if seats.left == seats.taken {
                if seats.taken > seen {
                    seen = seats.taken;
                    quiet_yields = 0;
                }
                if quiet_yields == LATE_SEAT_YIELDS || seats.spoiled || seats.taken >= MAX_SEATS {
                    seats.closed = true;
                    break (seats.spoiled, seats.fault.clone());
                }
            }
            seats.left == seats.taken
        };
        if all_left {
            quiet_yields += 1;
            tokio::task::yield_now().await;
        } else {
            left.await;
        }
    };
    let txn = round.txn.lock().await.take();
    let outcome = match txn {
        Some(txn) if !rolled_back => txn.commit().await,
        Some(txn) => {
            txn.abort(fault.as_ref()).await;
            Err(fault.unwrap_or_else(spoiled))
        }
        None => Err(abandoned()),
    };
    drop(closing);
    if let Err(err) = &outcome
        && err.fault().is_some()
    {
        // A failed BEGIN or COMMIT (or one that committed nothing): every
        // member answers it.
        round.fault(err.clone());
    }
    round.phase.send_replace(Phase::Done(outcome));
    drop(closer);
}

fn failed_to_begin(round: &Round, err: StoreError) {
    round.close();
    round.phase.send_replace(Phase::Done(Err(err)));
}

/// Ends a round's runner (also when its driver is dropped): the
/// connection is kept for the next round when it is left outside a
/// transaction and no fault ended its trust meanwhile.
struct CloseDirect<'a> {
    direct: Direct,
    writer: &'a super::Writer,
    generation: u64,
}

impl Drop for CloseDirect<'_> {
    fn drop(&mut self) {
        match self.direct.close() {
            Some(conn) => self.writer.keep_round_connection(self.generation, conn),
            None => self.writer.round_connection_lost(),
        }
    }
}

/// Ends a round whose driver is dropped before it ended: newcomers start a
/// new round, and its members stop waiting (they answer an error).
struct CloseOnDrop<'a>(&'a Round);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.close();
        self.0.phase.send_if_modified(|p| match p {
            Phase::Done(_) | Phase::Abandoned => false,
            _ => {
                *p = Phase::Abandoned;
                true
            }
        });
    }
}

fn spoiled() -> StoreError {
    StoreError::Spoiled
}

fn rolled_back() -> StoreError {
    StoreError::RolledBack("found before a member's statements")
}

fn abandoned() -> StoreError {
    StoreError::Abandoned
}

#[cfg(test)]
mod tests {
    use sea_orm::{ConnectionTrait, Statement};
    use tokio::sync::oneshot;

    use super::super::checkpoints;
    use crate::config::DatabaseSettings;
    use crate::store::{Database, StoreError, execute_unprepared};

    async fn database(dir: &tempfile::TempDir) -> Database {
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("w.db").display());
        let db = Database::connect(&DatabaseSettings {
            url,
            max_connections: 4,
        })
        .await
        .unwrap();
        let txn = db.begin_write().await.unwrap();
        execute_unprepared(&*txn, "CREATE TABLE t (name TEXT NOT NULL)")
            .await
            .unwrap();
        txn.commit().await.unwrap();
        db
    }

    async fn insert<C: ConnectionTrait>(conn: &C, name: &str) -> Result<(), StoreError> {
        execute_unprepared(conn, &format!("INSERT INTO t (name) VALUES ('{name}')")).await
    }

    async fn names<C: ConnectionTrait>(conn: &C) -> Vec<String> {
        let rows = conn
            .query_all_raw(Statement::from_string(
                conn.get_database_backend(),
                "SELECT name FROM t ORDER BY name",
            ))
            .await
            .unwrap();
        rows.iter()
            .map(|r| r.try_get::<String>("", "name").unwrap())
            .collect()
    }

    /// One write of one row named `name`.
    async fn write_name(db: &Database, name: &str) -> Result<(), StoreError> {
        db.write::<_, StoreError, _>(async |txn| insert(&**txn, name).await)
            .await
    }

    /// A first write that stays inside its round until `release` fires,
    /// once it has inserted `a`.
    fn held_write(
        db: &Database,
    ) -> (
        tokio::task::JoinHandle<Result<(), StoreError>>,
        oneshot::Sender<()>,
        oneshot::Receiver<()>,
    ) {
        let (release, released) = oneshot::channel::<()>();
        let (inserted, has_inserted) = oneshot::channel::<()>();
        let db = db.clone();
        let (mut inserted, mut released) = (Some(inserted), Some(released));
        let first = tokio::spawn(async move {
            db.write::<_, StoreError, _>(async move |txn| {
                insert(&**txn, "a").await?;
                if let Some(inserted) = inserted.take() {
                    let _ = inserted.send(());
                }
                if let Some(released) = released.take() {
                    let _ = released.await;
                }
                Ok(())
            })
            .await
        });
        (first, release, has_inserted)
    }

    /// Lets every spawned task run until it waits (one thread: FIFO).
    async fn let_others_run() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn writes_that_come_while_a_round_is_open_share_its_transaction_and_commit() {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        let (first, release, inserted) = held_write(&db);
        inserted.await.unwrap();
        let second = {
            let db = db.clone();
            tokio::spawn(async move {
                db.write::<_, StoreError, _>(async |txn| {
                    // The first write's row, not yet committed: the same
                    // transaction.
                    let seen = names(&**txn).await;
                    insert(&**txn, "b").await?;
                    Ok(seen)
                })
                .await
            })
        };
        let_others_run().await;
        // Nothing is committed while a member still runs.
        assert!(names(db.reader()).await.is_empty());
        release.send(()).unwrap();
        first.await.unwrap().unwrap();
        assert_eq!(second.await.unwrap().unwrap(), vec!["a".to_owned()]);
        assert_eq!(names(db.reader()).await, vec!["a", "b"]);
        assert_eq!(db.write_rounds_started(), 1);
    }

    #[tokio::test]
    async fn a_round_waits_for_another_processs_write_lock_and_then_commits() {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        // Another process (say `bootstrap`) writing beside the node.
        let other = rusqlite::Connection::open(dir.path().join("w.db")).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let write = {
            let db = db.clone();
            tokio::spawn(async move {
                db.write::<_, StoreError, _>(async |txn| insert(&**txn, "a").await)
                    .await
            })
        };
        // Its BEGIN waits on a blocking thread, not on this runtime.
        let_others_run().await;
        assert!(!write.is_finished());
        other
            .execute_batch("INSERT INTO t (name) VALUES ('o'); COMMIT")
            .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), write)
            .await
            .expect("the round never began")
            .unwrap()
            .unwrap();
        assert_eq!(names(db.reader()).await, vec!["a", "o"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wal_past_8_mib_is_checkpointed_into_the_database_in_the_background() {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        let file = dir.path().join("w.db");
        let big = "x".repeat(256 * 1024);
        // 12 MiB of WAL, well below SQLite's own checkpoint (32 MiB).
        for i in 0..48 {
            write_name(&db, &format!("{i:02}{big}")).await.unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            // Another round after the WAL grew starts the checkpoint.
            write_name(&db, "z").await.unwrap();
            let copied = std::fs::metadata(&file).unwrap().len();
            if copied >= 8 << 20 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the database file stayed at {copied} bytes"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_background_checkpoint_waits_for_frames_committed_since_the_last_not_the_wal_files_size()
     {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        // One commit of 9 MiB: the WAL file keeps that size from now on,
        // however often it is checkpointed and restarted.
        write_name(&db, &"x".repeat(9 << 20)).await.unwrap();
        let wal = dir.path().join("w.db-wal");
        assert!(std::fs::metadata(&wal).unwrap().len() >= 9 << 20);
        let started = db.writer.background_checkpoints();
        assert!(started >= 1, "no background checkpoint after 9 MiB");
        // Small commits, fewer frames in all than one checkpoint waits
        // for, a quarter of them 20 ms apart as on a node that writes now
        // and then (a trigger on the file's size, looked at every 10 ms,
        // started one after each of those): at most the one a leftover
        // of the big write asks for.
        for i in 0..checkpoints::BACKGROUND_FRAMES / 4 {
            if i % 4 == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            write_name(&db, &format!("z{i}")).await.unwrap();
        }
        let after_small = db.writer.background_checkpoints();
        assert!(
            after_small <= started + 1,
            "{} background checkpoints for {} small commits",
            after_small - started,
            checkpoints::BACKGROUND_FRAMES / 4
        );
        // Another 12 MiB: they start again.
        let big = "x".repeat(256 * 1024);
        for i in 0..48 {
            write_name(&db, &format!("{i:02}{big}")).await.unwrap();
        }
        assert!(db.writer.background_checkpoints() > after_small);
    }

    #[tokio::test]
    async fn a_lone_write_commits_before_it_answers() {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        write_name(&db, "a").await.unwrap();
        assert_eq!(names(db.reader()).await, vec!["a"]);
        write_name(&db, "b").await.unwrap();
        assert_eq!(names(db.reader()).await, vec!["a", "b"]);
        assert_eq!(db.write_rounds_started(), 2);
    }

    #[tokio::test]
    async fn a_failed_member_gets_its_own_error_and_the_others_of_its_round_are_written_alone() {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        let (first, release, inserted) = held_write(&db);
        inserted.await.unwrap();
        let failing = {
            let db = db.clone();
            tokio::spawn(async move {
                db.write::<_, StoreError, _>(async |txn| {
                    insert(&**txn, "b").await?;
                    Err::<(), _>(StoreError::invariant("rejected"))
                })
                .await
            })
        };
        let_others_run().await;
        release.send(()).unwrap();
        let failing = failing.await.unwrap().unwrap_err();
        assert!(failing.to_string().contains("rejected"), "{failing}");
        // The first write's round was rolled back; it ran again alone, in
        // a round of its own on the same connection.
        first.await.unwrap().unwrap();
        assert_eq!(names(db.reader()).await, vec!["a"]);
        assert_eq!(db.write_rounds_started(), 2);
        write_name(&db, "c").await.unwrap();
        assert_eq!(names(db.reader()).await, vec!["a", "c"]);
    }

    #[tokio::test]
    async fn a_member_dropped_half_way_is_not_written_and_the_others_of_its_round_are_written_alone()
     {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        let (first, _release, inserted) = held_write(&db);
        inserted.await.unwrap();
        let second = {
            let db = db.clone();
            tokio::spawn(async move {
                db.write::<_, StoreError, _>(async |txn| insert(&**txn, "b").await)
                    .await
            })
        };
        let_others_run().await;
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        second.await.unwrap().unwrap();
        assert_eq!(names(db.reader()).await, vec!["b"]);
        write_name(&db, "c").await.unwrap();
        assert_eq!(names(db.reader()).await, vec!["b", "c"]);
    }

    #[tokio::test]
    async fn the_members_of_a_round_whose_driver_is_dropped_get_an_error_and_later_writes_go_through()
     {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        // The round starts on a runtime of its own thread (its driver runs
        // there), held open by a write that never finishes.
        let (inserted, has_inserted) = oneshot::channel::<()>();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = {
            let db = db.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async move {
                    let mut inserted = Some(inserted);
                    tokio::spawn(async move {
                        db.write::<_, StoreError, _>(async move |txn| {
                            insert(&**txn, "a").await?;
                            if let Some(inserted) = inserted.take() {
                                let _ = inserted.send(());
                            }
                            std::future::pending::<()>().await;
                            Ok(())
                        })
                        .await
                    });
                    let _ = stopped.await;
                });
                // Dropping the runtime drops the round's driver and its member.
                drop(runtime);
            })
        };
        has_inserted.await.unwrap();
        let second = {
            let db = db.clone();
            tokio::spawn(async move {
                db.write::<_, StoreError, _>(async |txn| insert(&**txn, "b").await)
                    .await
            })
        };
        let_others_run().await;
        assert_eq!(db.write_round_seated(), 2);
        stop.send(()).unwrap();
        tokio::task::spawn_blocking(move || thread.join().unwrap())
            .await
            .unwrap();
        let second = tokio::time::timeout(std::time::Duration::from_secs(5), second)
            .await
            .expect("a member of an abandoned round waited forever")
            .unwrap()
            .unwrap_err();
        assert!(second.to_string().contains("abandoned"), "{second}");
        assert!(names(db.reader()).await.is_empty());
        tokio::time::timeout(std::time::Duration::from_secs(5), write_name(&db, "c"))
            .await
            .expect("the writer connection was not given back")
            .unwrap();
        assert_eq!(names(db.reader()).await, vec!["c"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn under_concurrent_writes_some_failing_or_cancelled_every_answer_matches_what_was_committed()
     {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        let mut tasks = Vec::new();
        for i in 0..120 {
            let db = db.clone();
            let name = format!("w{i:03}");
            let fails = i % 7 == 3;
            tasks.push((
                name.clone(),
                fails,
                tokio::spawn(async move {
                    db.write::<_, StoreError, _>(async move |txn| {
                        insert(&**txn, &name).await?;
                        tokio::task::yield_now().await;
                        if fails {
                            return Err(StoreError::invariant("rejected"));
                        }
                        Ok(())
                    })
                    .await
                }),
            ));
        }
        // Some writes are cancelled wherever they are.
        for (i, (_, _, task)) in tasks.iter().enumerate() {
            if i % 11 == 5 {
                tokio::task::yield_now().await;
                task.abort();
            }
        }
        let mut answered = Vec::new();
        for (name, fails, task) in tasks {
            match task.await {
                Ok(answer) => answered.push((name, fails, answer)),
                Err(err) => assert!(err.is_cancelled()),
            }
        }
        let committed = names(db.reader()).await;
        for (name, fails, answer) in answered {
            match answer {
                Ok(()) => assert!(
                    committed.contains(&name),
                    "{name} answered Ok, not committed"
                ),
                Err(err) => {
                    assert!(fails, "{name} failed only because of another write: {err}");
                    assert!(!committed.contains(&name), "{name} answered Err, committed");
                }
            }
        }
        assert!(db.write_rounds_started() < 120, "no write shared a round");
    }
}

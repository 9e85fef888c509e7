//! The guard on a SQLite file: `serve` and `migrate` hold an exclusive
//! lock on `<file>.lock` for as long as they run, so a second node on the
//! same file stops at once instead of writing beside the first (decision
//! 0082). The kernel drops the lock when the process ends, however it ends.

use std::{
    fs::{File, OpenOptions, TryLockError},
    io::{Read, Write},
    path::{Path, PathBuf},
};

use super::sqlite_path;

/// A held lock; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct FileLock {
    _file: File,
}

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum FileLockError {
    /// Another process holds it: a node (or `migrate`) runs on the file.
    #[error(
        "the SQLite file {database} is in use by another orbit-events process{pid} (it holds \
         {lock}); stop it first, or give this node another file with database.url \
         (ORBIT_EVENTS__DATABASE__URL)",
        pid = .pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
        database = .database.display(),
        lock = .lock.display()
    )]
    Held {
        database: PathBuf,
        lock: PathBuf,
        pid: Option<u32>,
    },
    /// The lock file cannot be created or locked.
    #[error("cannot lock {}: {source}", .lock.display())]
    Io {
        lock: PathBuf,
        source: std::io::Error,
    },
}

/// Takes the lock of the SQLite file named by `url` and writes this
/// process's id into the lock file. `Ok(None)` for a URL that names no
/// file (PostgreSQL, `:memory:`).
pub fn lock_sqlite_file(url: &str) -> Result<Option<FileLock>, FileLockError> {
    let Some(database) = sqlite_path(url).map(PathBuf::from) else {
        return Ok(None);
    };
    let lock = lock_path(&database);
    let io = |source| FileLockError::Io {
        lock: lock.clone(),
        source,
    };
    if let Some(parent) = lock.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            return Err(FileLockError::Held {
                pid: holder_pid(&mut file),
                database,
                lock,
            });
        }
        Err(TryLockError::Error(source)) => return Err(io(source)),
    }
    // Just opened, so at offset 0: truncating leaves only this pid.
    file.set_len(0).map_err(io)?;
    writeln!(file, "{}", std::process::id()).map_err(io)?;
    Ok(Some(FileLock { _file: file }))
}

/// The pid the holder wrote, if it wrote one yet.
fn holder_pid(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// The lock file of `database`: the same path with `.lock` appended.
fn lock_path(database: &Path) -> PathBuf {
    let mut lock = database.as_os_str().to_owned();
    lock.push(".lock");
    PathBuf::from(lock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_of_one_file_is_refused_naming_the_file_and_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("a.db").display());
        let first = lock_sqlite_file(&url).unwrap();
        assert!(first.is_some());
        let err = lock_sqlite_file(&url).unwrap_err().to_string();
        assert!(err.contains("a.db"), "{err}");
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        assert!(
            lock_sqlite_file(&url).unwrap().is_some(),
            "free once dropped"
        );
        assert!(lock_sqlite_file("postgres://h/db").unwrap().is_none());
    }
}

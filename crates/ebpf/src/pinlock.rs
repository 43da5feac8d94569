//! One live daemon per pin directory.
//!
//! A daemon holds an exclusive `flock` on its pin directory for its whole life. The kernel drops
//! the lock when the process dies, however it dies (`kill -9` included), so a restarted daemon
//! still adopts a dead instance's pins without any cleanup, while a second daemon started by
//! mistake on the pins of a live one is refused: two daemons writing the same maps would undo
//! each other's tables.
//!
//! The lock lives on the directory inode (bpffs supports `flock`): a graceful shutdown removes
//! the directory while still holding it, and the next instance creates and locks a fresh one.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum PinLockError {
    #[error(
        "pin dir {dir} is in use by a live mediaplane instance ({holder}): refusing to start over its pinned maps \
         and links (stop that instance, or give this one its own --pin-dir; --adopt-live-pins shares them anyway, \
         which is dangerous: two daemons would write the same maps)",
        dir = dir.display(),
        holder = holder.map_or("holder pid unknown".to_string(), |p| format!("pid {p}"))
    )]
    Held { dir: PathBuf, holder: Option<u32> },
    #[error("locking pin dir {}: {source}", dir.display())]
    Io { dir: PathBuf, source: std::io::Error },
}

/// The exclusive lock on a pin directory; released on drop (or by the kernel at process exit).
#[derive(Debug)]
pub struct PinDirLock {
    dir: PathBuf,
    _file: File,
}

fn open_dir(dir: &Path) -> std::io::Result<File> {
    // O_CLOEXEC (std's default): a child process must never inherit, and so keep, the lock.
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY).open(dir)
}

impl PinDirLock {
    /// Lock `dir` (created if missing) without waiting.
    pub fn acquire(dir: &Path) -> Result<PinDirLock, PinLockError> {
        let io = |source| PinLockError::Io { dir: dir.to_path_buf(), source };
        // A holder's graceful shutdown may remove the directory between our open and flock: we
        // would then hold a lock on a deleted inode. Check the path still names what we locked.
        for _ in 0..8 {
            std::fs::create_dir_all(dir).map_err(io)?;
            let file = match open_dir(dir) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(e)),
            };
            // SAFETY: flock on an fd we own.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(PinLockError::Held { dir: dir.to_path_buf(), holder: holder_of(&file) });
                }
                return Err(io(e));
            }
            let ours = file.metadata().map_err(io)?;
            match std::fs::metadata(dir) {
                Ok(now) if now.dev() == ours.dev() && now.ino() == ours.ino() => {
                    return Ok(PinDirLock { dir: dir.to_path_buf(), _file: file });
                }
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(e)),
            }
        }
        Err(io(std::io::Error::other("the directory kept being replaced while locking it")))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The PID holding a `flock` on the file behind `file`, from /proc/locks (as seen from this
/// process's PID namespace; `None` if it cannot be told).
fn holder_of(file: &File) -> Option<u32> {
    let md = file.metadata().ok()?;
    let dev = md.dev();
    let id = format!("{:02x}:{:02x}:{}", libc::major(dev), libc::minor(dev), md.ino());
    // /proc/locks longer than a page is read in several passes over a list other processes
    // keep changing: an entry can be skipped. A few reads make that unlikely.
    (0..5).find_map(|_| holder_in(&std::fs::read_to_string("/proc/locks").ok()?, &id))
}

/// Parse /proc/locks lines such as `3: FLOCK  ADVISORY  WRITE 4242 00:2a:1234 0 EOF` (waiters,
/// marked `->`, are skipped).
fn holder_in(locks: &str, id: &str) -> Option<u32> {
    locks.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            [_, "FLOCK", _, "WRITE", pid, dev_ino, ..] if *dev_ino == id => pid.parse().ok(),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let p = std::env::temp_dir().join(format!("mp-pinlock-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_second_lock_is_refused_with_the_holder_pid_until_the_first_is_dropped() {
        let t = TempDir::new("second");
        let dir = t.0.join("pins");
        let first = PinDirLock::acquire(&dir).expect("first lock");
        assert!(dir.is_dir(), "acquire creates the directory");
        match PinDirLock::acquire(&dir) {
            Err(PinLockError::Held { dir: d, holder }) => {
                assert_eq!(d, dir);
                assert_eq!(holder, Some(std::process::id()));
            }
            other => panic!("second lock: {other:?}"),
        }
        let msg = PinDirLock::acquire(&dir).unwrap_err().to_string();
        assert!(msg.contains(&dir.display().to_string()) && msg.contains(&format!("pid {}", std::process::id())), "{msg}");
        assert!(msg.contains("--adopt-live-pins"), "{msg}");
        drop(first);
        let again = PinDirLock::acquire(&dir).expect("lock after the holder let go");
        assert_eq!(again.dir(), dir);
    }

    #[test]
    fn a_directory_removed_by_its_holder_is_locked_afresh() {
        // A graceful shutdown removes the directory while holding the lock.
        let t = TempDir::new("removed");
        let dir = t.0.join("pins");
        let first = PinDirLock::acquire(&dir).unwrap();
        std::fs::remove_dir(&dir).unwrap();
        let second = PinDirLock::acquire(&dir).expect("a new directory is not the old one's");
        assert!(matches!(PinDirLock::acquire(&dir), Err(PinLockError::Held { .. })), "the new one is locked");
        drop((first, second));
    }

    /// The kernel releases the lock of a process killed with SIGKILL: what lets a restarted daemon
    /// adopt a crashed one's pins.
    #[test]
    fn a_killed_holder_releases_the_lock() {
        let t = TempDir::new("killed");
        let dir = t.0.join("pins");
        std::fs::create_dir_all(&dir).unwrap();
        let cdir = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
        let mut pipe = [0i32; 2];
        // SAFETY: plain syscalls; the child only makes async-signal-safe calls, then _exit/pause.
        let pid = unsafe {
            assert_eq!(libc::pipe(pipe.as_mut_ptr()), 0);
            let pid = libc::fork();
            assert!(pid >= 0, "fork");
            if pid == 0 {
                let fd = libc::open(cdir.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY);
                if fd < 0 || libc::flock(fd, libc::LOCK_EX) != 0 || libc::write(pipe[1], b"L".as_ptr().cast(), 1) != 1 {
                    libc::_exit(1);
                }
                loop {
                    libc::pause();
                }
            }
            libc::close(pipe[1]);
            let mut b = [0u8; 1];
            assert_eq!(libc::read(pipe[0], b.as_mut_ptr().cast(), 1), 1, "the child did not lock");
            libc::close(pipe[0]);
            pid
        };
        let held = PinDirLock::acquire(&dir);
        // SAFETY: our own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        match held {
            Err(PinLockError::Held { holder, .. }) => assert_eq!(holder, Some(pid as u32), "holder pid from /proc/locks"),
            other => panic!("a live holder in another process: {other:?}"),
        }
        PinDirLock::acquire(&dir).expect("the kernel released the killed holder's lock");
    }

    #[test]
    fn proc_locks_parsing() {
        let locks = "1: FLOCK  ADVISORY  WRITE 4242 00:2a:1234 0 EOF\n\
                     1: -> FLOCK  ADVISORY  WRITE 77 00:2a:1234 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 99 00:2a:1234 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 5 00:2a:12345 0 EOF\n";
        assert_eq!(holder_in(locks, "00:2a:1234"), Some(4242));
        assert_eq!(holder_in(locks, "00:2a:12345"), Some(5));
        assert_eq!(holder_in(locks, "00:2b:1234"), None);
    }
}

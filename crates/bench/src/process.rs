//! One supervisor for the child processes that benchmarks and tests start and stop (`mediaplane
//! serve`, rtpengine, Kamailio, SIPp): spawn, ask whether it is alive, wait with a deadline,
//! SIGTERM then SIGKILL by PID, and never leave one behind on drop.

use std::io;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// A child process this program started. Signals go to its PID, or to its process group when it
/// was started with [`Supervised::spawn_group`] (so a daemon's own children are reached too).
/// On drop a live child is stopped: SIGKILL, or SIGTERM first when
/// [`Supervised::terminate_on_drop`] set a grace period.
pub struct Supervised {
    name: String,
    child: Child,
    group: bool,
    drop_grace: Option<Duration>,
}

impl Supervised {
    /// Spawn `cmd` (standard input from /dev/null unless the caller set it).
    pub fn spawn(name: &str, cmd: &mut Command) -> io::Result<Supervised> {
        Self::start(name, cmd, false)
    }

    /// Spawn `cmd` as the leader of a process group of its own; signals reach the whole group.
    pub fn spawn_group(name: &str, cmd: &mut Command) -> io::Result<Supervised> {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        Self::start(name, cmd, true)
    }

    fn start(name: &str, cmd: &mut Command, group: bool) -> io::Result<Supervised> {
        let child = cmd.spawn().map_err(|e| io::Error::new(e.kind(), format!("starting {name}: {e}")))?;
        Ok(Supervised { name: name.to_string(), child, group, drop_grace: None })
    }

    /// Stop with SIGTERM and this grace period (then SIGKILL) when dropped alive.
    pub fn terminate_on_drop(mut self, grace: Duration) -> Supervised {
        self.drop_grace = Some(grace);
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The child's PID (`ip netns exec` and `nsenter` exec their command: the daemon's own).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The underlying child, e.g. to read a piped stdout or stderr.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Its exit status if it has exited (reaped), None while it runs.
    pub fn exited(&mut self) -> io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Wait up to `timeout` for it to exit by itself.
    pub fn wait_timeout(&mut self, timeout: Duration) -> io::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(Some(st));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: libc::c_int) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: signalling our own child (or the group it leads) by id; it is not reaped yet.
        unsafe { libc::kill(if self.group { -pid } else { pid }, sig) };
    }

    /// SIGTERM, then wait up to `grace`. Ok(status) when it exited by then (whatever the
    /// status); Err when it had to be killed with SIGKILL.
    pub fn terminate(&mut self, grace: Duration) -> io::Result<ExitStatus> {
        if let Some(st) = self.child.try_wait()? {
            return Ok(st);
        }
        self.signal(libc::SIGTERM);
        match self.wait_timeout(grace)? {
            Some(st) => Ok(st),
            None => {
                self.kill();
                Err(io::Error::new(io::ErrorKind::TimedOut, format!("{} did not stop within {grace:?} of SIGTERM (killed)", self.name)))
            }
        }
    }

    /// SIGKILL (the group, if it has one) and reap.
    pub fn kill(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.signal(libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        if !self.alive() {
            return;
        }
        match self.drop_grace {
            Some(grace) => {
                if let Err(e) = self.terminate(grace) {
                    eprintln!("{e}");
                }
            }
            None => self.kill(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Stdio;

    #[test]
    fn terminate_stops_a_child_and_reports_its_status() {
        let mut p = Supervised::spawn("sleep", Command::new("sleep").arg("30")).unwrap();
        assert!(p.alive());
        let st = p.terminate(Duration::from_secs(5)).unwrap();
        assert!(!st.success(), "killed by SIGTERM: {st}");
        assert!(!p.alive());
    }

    #[test]
    fn a_child_ignoring_sigterm_is_killed_after_the_grace_period() {
        // It says when the trap is set: on a loaded machine 100 ms was once not enough, and the
        // SIGTERM ended the shell before it ignored it.
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "trap '' TERM; echo trapped; sleep 30"]).stdout(Stdio::piped());
        let mut p = Supervised::spawn("trap", &mut cmd).unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(p.child_mut().stdout.as_mut().unwrap()), &mut line).unwrap();
        assert_eq!(line, "trapped\n");
        let t = Instant::now();
        assert!(p.terminate(Duration::from_millis(300)).is_err());
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(!p.alive());
    }

    #[test]
    fn drop_kills_the_group() {
        // The shell's own child (sleep) is in the group and must go with it.
        let mut p = Supervised::spawn_group("group", Command::new("sh").args(["-c", "sleep 30 & echo $!; wait"]).stdout(Stdio::piped())).unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(p.child_mut().stdout.take().unwrap()), &mut line).unwrap();
        let grandchild: i32 = line.trim().parse().unwrap();
        drop(p);
        let deadline = Instant::now() + Duration::from_secs(5);
        // SAFETY: signal 0 only probes whether the pid exists.
        while unsafe { libc::kill(grandchild, 0) } == 0 {
            assert!(Instant::now() < deadline, "the group's other process survived");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

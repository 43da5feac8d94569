//! A redis-server of a test's own (Debian's `redis-server`, 7.x): on a Unix socket in a
//! directory of its own (no TCP port, nothing saved to disk), ended by PID when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Child,
    dir: PathBuf,
    /// `redis+unix:///…/redis.sock`.
    pub url: String,
}

impl RedisServer {
    /// A server whose socket is in a directory named after `name` and this process (the same
    /// name again, after this one is dropped, gives the same URL: a restarted Redis). None when
    /// redis-server is not installed, which under CI=true is a failure.
    pub fn start(name: &str) -> Option<RedisServer> {
        if Command::new("redis-server").arg("--version").output().is_err() {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "redis-server is not installed (make deps installs it)");
            eprintln!("skipped: redis-server is not installed");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("mp-redis-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory for redis-server");
        let sock = dir.join("redis.sock");
        let child = Command::new("redis-server")
            .args(["--port", "0", "--save", "", "--appendonly", "no", "--unixsocket"])
            .arg(&sock)
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("starting redis-server");
        let mut server = RedisServer { child, url: format!("redis+unix://{}", sock.display()), dir };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !sock.exists() {
            if Instant::now() > deadline || server.child.try_wait().ok().flatten().is_some() {
                panic!("redis-server did not open {}", sock.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(server)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

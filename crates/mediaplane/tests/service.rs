//! `mediaplane serve` as a service runs it: stderr into a file (or the journal), the soft
//! file-descriptor limit below the hard one. Its log carries no terminal colour codes, it raises
//! its soft limit to the hard limit, and it says what its data plane can hold.

mod common;

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn soft_nofile(pid: u32) -> Option<u64> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

#[test]
fn serve_logs_without_colour_off_a_terminal_and_raises_its_fd_limit() {
    let tmp = common::TempDir::new("service");
    let log = tmp.0.join("serve.log");
    let port = common::free_port();
    let mut hard = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit into a valid struct.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut hard) }, 0);
    assert!(hard.rlim_max > 512, "this test needs a hard limit above 512 (have {})", hard.rlim_max);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mediaplane"));
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--store", tmp.0.join("s.db").to_str().unwrap(), "--workers", "1"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    // SAFETY: only setrlimit between fork and exec (async-signal-safe).
    unsafe {
        cmd.pre_exec(|| {
            let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
            r.rlim_cur = 256;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("SFU addresses") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let soft = soft_nofile(child.id());
    let _ = child.kill();
    let _ = child.wait();
    assert!(text.contains("SFU addresses") && text.contains("fd_limit"), "says what the plane can hold: {text}");
    assert!(!text.contains('\u{1b}'), "no ANSI escape codes in a log file: {text:?}");
    assert_eq!(soft, Some(hard.rlim_max), "the soft fd limit (was 256) raised to the hard one");
}

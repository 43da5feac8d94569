//! `mediaplane serve` as a service runs it: stderr into a file (or the journal), the soft
//! file-descriptor limit below the hard one. Its log carries no terminal colour codes, it raises
//! its soft limit to the hard limit, and it says what its data plane can hold.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
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

fn status(url: &str, token: Option<&str>) -> Option<u16> {
    let mut r = ureq::get(url).timeout(Duration::from_millis(500));
    if let Some(t) = token {
        r = r.set("authorization", &format!("Bearer {t}"));
    }
    match r.call() {
        Ok(resp) => Some(resp.status()),
        Err(ureq::Error::Status(c, _)) => Some(c),
        Err(_) => None,
    }
}

#[test]
fn configuration_from_the_environment_and_the_token_from_a_file() {
    let tmp = common::TempDir::new("envcfg");
    let token_file = tmp.0.join("token");
    std::fs::write(&token_file, "env-s3cret\n").unwrap();
    let port = common::free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mediaplane"));
    // No flags at all: everything from the environment.
    cmd.arg("serve")
        .env("MEDIAPLANE_API_LISTEN", format!("127.0.0.1:{port}"))
        .env("MEDIAPLANE_API_TOKEN_FILE", &token_file)
        .env("MEDIAPLANE_STORE_PATH", tmp.0.join("s.db"))
        .env("MEDIAPLANE_DATAPLANE_WORKERS", "1")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null());
    let mut p = mediaplane_bench::process::Supervised::spawn("serve", &mut cmd).unwrap();
    let url = format!("http://127.0.0.1:{port}/health");
    let deadline = Instant::now() + Duration::from_secs(20);
    while status(&url, Some("env-s3cret")) != Some(200) {
        assert!(Instant::now() < deadline && p.alive(), "serve did not come up on the port MEDIAPLANE_API_LISTEN names");
        std::thread::sleep(Duration::from_millis(50));
    }
    // (`/health` answers anyone, for liveness probes: the token guards the rest.)
    let guarded = format!("http://127.0.0.1:{port}/v1/rooms");
    assert_eq!(status(&guarded, Some("env-s3cret")), Some(200));
    assert_eq!(status(&guarded, None), Some(401), "the token from the file is required");
    assert_eq!(status(&guarded, Some("env-s3cre")), Some(401), "and only that token");
    assert!(p.terminate(Duration::from_secs(10)).unwrap().success());
    assert!(tmp.0.join("s.db").exists(), "store where MEDIAPLANE_STORE_PATH says");

    // A misspelt key and an empty token file: refused at start, saying why.
    for (var, value, says) in [("MEDIAPLANE_API_LISTN", "127.0.0.1:1", "MEDIAPLANE_API_LISTEN"), ("MEDIAPLANE_API_TOKEN_FILE", "/dev/null", "empty")] {
        let out = Command::new(env!("CARGO_BIN_EXE_mediaplane"))
            .args(["serve", "--listen", &format!("127.0.0.1:{}", common::free_port()), "--store", tmp.0.join("t.db").to_str().unwrap()])
            .env(var, value)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{var}={value}: {err}");
    }
}

/// `systemd-analyze verify` of the repository's unit, its ExecStart pointed at the binary just
/// built (the installed unit, man pages included, is verified by scripts/deb-test.sh). Any
/// message, even a warning such as an unknown key, fails.
#[test]
fn the_systemd_unit_verifies() {
    let analyze = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"].into_iter().find(|p| Path::new(p).exists());
    let Some(analyze) = analyze else {
        assert!(!mediaplane_bench::in_ci(), "systemd-analyze missing under CI (scripts/install-deps.sh installs systemd)");
        eprintln!("SKIP the_systemd_unit_verifies: no systemd-analyze");
        return;
    };
    let unit = std::fs::read_to_string(common::unit_path()).unwrap();
    assert!(unit.contains("\nExecStart=/usr/bin/mediaplane serve --config /etc/mediaplane/mediaplane.toml\n"), "{unit}");
    assert!(unit.contains("\nType=notify\n"));
    let tmp = common::TempDir::new("unit");
    let copy = tmp.0.join("mediaplane.service");
    std::fs::write(&copy, unit.replace("ExecStart=/usr/bin/mediaplane", &format!("ExecStart={}", env!("CARGO_BIN_EXE_mediaplane")))).unwrap();
    let out = Command::new(analyze).args(["verify", "--man=no"]).arg(&copy).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && said.trim().is_empty(), "systemd-analyze verify: {said}");
    // And it does catch a mistake.
    std::fs::write(&copy, unit.replace("Type=notify", "Type=notifyy")).unwrap();
    let out = Command::new(analyze).args(["verify", "--man=no"]).arg(&copy).output().unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).trim().is_empty(), "a bad Type= goes unnoticed");
    assert_eq!(common::unit_capabilities().len(), 4);
}

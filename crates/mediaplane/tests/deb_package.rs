//! The Debian package, end to end on this machine: build it with cargo-deb (the debug binary
//! of this build, packaged as `make deb` packages the release one), install it with dpkg, check
//! that every file is where it belongs, that the installed unit verifies (man pages included),
//! and start the installed unit's ExecStart as systemd would (systemd is not PID 1 here): as the
//! unit's user with the unit's capabilities, in its working directory, with a NOTIFY_SOCKET this
//! test listens on. It must say READY=1, answer /health, and say STOPPING=1 on SIGTERM. The
//! package is purged at the end (and the system user removed if the package created it), on
//! success and on failure.

mod common;

use mediaplane_bench::process::Supervised;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn installed(pkg: &str) -> bool {
    Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]).output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn have_user(name: &str) -> bool {
    Command::new("getent").args(["passwd", name]).stdout(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Purges the package and what its installation created, on drop.
struct Installed {
    user_was_there: bool,
    pin_dir_made: bool,
}
impl Drop for Installed {
    fn drop(&mut self) {
        let _ = Command::new("dpkg").args(["--purge", "mediaplane"]).env("DEBIAN_FRONTEND", "noninteractive").output();
        if !self.user_was_there {
            let _ = Command::new("userdel").arg("mediaplane").output();
            let _ = Command::new("groupdel").arg("mediaplane").output();
        }
        if self.pin_dir_made {
            let _ = std::fs::remove_dir("/sys/fs/bpf/mediaplane");
        }
    }
}

#[test]
fn the_deb_installs_and_its_unit_starts_the_daemon() {
    if !mediaplane_bench::require_root("deb_package") {
        return;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    if !Command::new(&cargo).args(["deb", "--version"]).output().is_ok_and(|o| o.status.success()) {
        assert!(!mediaplane_bench::in_ci(), "cargo-deb missing under CI (make deb-tools installs it)");
        eprintln!("SKIP deb_package: no cargo-deb (make deb-tools)");
        return;
    }
    assert!(
        !installed("mediaplane"),
        "a mediaplane package is installed on this machine already: this test installs and purges its own (dpkg --purge mediaplane first)"
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap();
    let bin = env!("CARGO_BIN_EXE_mediaplane");
    let tmp = common::TempDir::new("deb");

    // Man pages and completions from the binary, where Cargo.toml's deb assets expect them.
    let gen = root.join("deploy/gen");
    let _ = std::fs::remove_dir_all(&gen);
    std::fs::create_dir_all(gen.join("completions")).unwrap();
    sh(Command::new(bin).args(["man", "--out-dir"]).arg(gen.join("man")));
    for entry in std::fs::read_dir(gen.join("man")).unwrap() {
        sh(Command::new("gzip").arg("-9nf").arg(entry.unwrap().path()));
    }
    for (shell, file) in [("bash", "mediaplane.bash"), ("zsh", "_mediaplane"), ("fish", "mediaplane.fish")] {
        std::fs::write(gen.join("completions").join(file), sh(Command::new(bin).args(["completions", shell]))).unwrap();
    }
    // cargo-deb takes target/release/mediaplane from CARGO_TARGET_DIR: this build's binary.
    let target = tmp.0.join("target");
    std::fs::create_dir_all(target.join("release")).unwrap();
    std::fs::copy(bin, target.join("release/mediaplane")).unwrap();
    let t = Instant::now();
    let out = sh(Command::new(&cargo)
        .args(["deb", "-p", "mediaplane", "--no-build", "--fast", "-o"])
        .arg(tmp.0.join("out"))
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(&root));
    let deb = PathBuf::from(out.lines().last().unwrap().trim());
    assert!(deb.extension().is_some_and(|e| e == "deb") && deb.is_file(), "{out}");
    eprintln!("built {} in {:?}", deb.display(), t.elapsed());

    let mut guard = Installed { user_was_there: have_user("mediaplane"), pin_dir_made: false };
    sh(Command::new("dpkg").arg("-i").arg(&deb).env("DEBIAN_FRONTEND", "noninteractive"));
    // Installing again is harmless (the user exists, the conffile is kept).
    sh(Command::new("dpkg").arg("-i").arg(&deb).env("DEBIAN_FRONTEND", "noninteractive"));

    let unit_path = Path::new("/usr/lib/systemd/system/mediaplane.service");
    for f in [
        "/usr/bin/mediaplane",
        "/etc/mediaplane/mediaplane.toml",
        unit_path.to_str().unwrap(),
        "/usr/share/man/man1/mediaplane.1.gz",
        "/usr/share/man/man1/mediaplane-serve.1.gz",
        "/usr/share/bash-completion/completions/mediaplane",
        "/usr/share/zsh/vendor-completions/_mediaplane",
        "/usr/share/fish/vendor_completions.d/mediaplane.fish",
    ] {
        assert!(Path::new(f).is_file(), "{f} installed");
    }
    assert!(sh(Command::new("dpkg-query").args(["--control-show", "mediaplane", "conffiles"])).contains("/etc/mediaplane/mediaplane.toml"));
    let passwd = sh(Command::new("getent").args(["passwd", "mediaplane"]));
    assert!(passwd.trim_end().ends_with("/usr/sbin/nologin"), "a system user without a shell: {passwd}");
    let version = sh(Command::new("/usr/bin/mediaplane").arg("--version"));
    assert_eq!(version.trim(), format!("mediaplane {}", env!("CARGO_PKG_VERSION")));

    // The installed unit verifies as it is, man pages included.
    let out = Command::new("systemd-analyze").arg("verify").arg(unit_path).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && said.trim().is_empty(), "systemd-analyze verify {}: {said}", unit_path.display());

    // Start it as the unit says.
    let unit = std::fs::read_to_string(unit_path).unwrap();
    let one = |key: &str| common::unit_values(&unit, key).join(" ");
    let (user, group) = (one("User"), one("Group"));
    let caps: Vec<String> = common::unit_values(&unit, "AmbientCapabilities").iter().map(|c| c.trim_start_matches("CAP_").to_lowercase()).collect();
    assert_eq!(common::unit_values(&unit, "CapabilityBoundingSet"), common::unit_values(&unit, "AmbientCapabilities"));
    // StateDirectory= and WorkingDirectory=, as systemd makes them.
    let state = Path::new("/var/lib").join(one("StateDirectory"));
    assert_eq!(Path::new(&one("WorkingDirectory")), state);
    std::fs::create_dir_all(&state).unwrap();
    sh(Command::new("chown").arg(format!("{user}:{group}")).arg(&state));
    // systemd mounts a bpffs on /sys/fs/bpf at boot; systemd is not PID 1 here, so do as it does
    // (on a fresh machine nothing else has).
    mediaplane_ebpf::mount_bpffs_if_missing().unwrap();
    // ExecStartPre=+ (full privileges): the pin directory, unless one exists (not ours to touch).
    if !Path::new("/sys/fs/bpf/mediaplane").exists() {
        let pre = one("ExecStartPre");
        let argv: Vec<&str> = pre.strip_prefix('+').expect("ExecStartPre=+").split_whitespace().collect();
        sh(Command::new(argv[0]).args(&argv[1..]));
        guard.pin_dir_made = true;
        let meta = std::fs::metadata("/sys/fs/bpf/mediaplane").unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta).to_string(), sh(Command::new("id").args(["-u", &user])).trim());
    }
    let notify_path = tmp.0.join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    sh(Command::new("chown").arg(&user).arg(&notify_path));
    std::fs::set_permissions(&tmp.0, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    notify.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let exec: Vec<String> = one("ExecStart").split_whitespace().map(String::from).collect();
    assert_eq!(exec[..2], ["/usr/bin/mediaplane".to_string(), "serve".to_string()]);
    let port = common::free_port();
    let set = caps.iter().map(|c| format!(",+{c}")).collect::<String>();
    let log = tmp.0.join("serve.log");
    let mut cmd = Command::new("setpriv");
    cmd.args([format!("--reuid={user}"), format!("--regid={group}"), "--init-groups".into()])
        .args([format!("--inh-caps=-all{set}"), format!("--ambient-caps=-all{set}"), format!("--bounding-set=-all{set}")])
        .arg("--")
        .args(&exec)
        .current_dir(&state)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("NOTIFY_SOCKET", &notify_path)
        // The configured port may be in use on a shared machine: the environment wins over the file.
        .env("MEDIAPLANE_API_LISTEN", format!("127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut serve = Supervised::spawn("mediaplane serve (installed)", &mut cmd).unwrap().terminate_on_drop(Duration::from_secs(10));
    let mut buf = [0u8; 512];
    let mut got = |want: &str, serve: &mut Supervised| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(n) = notify.recv(&mut buf) {
                if String::from_utf8_lossy(&buf[..n]).lines().any(|l| l == want) {
                    return true;
                }
            } else if serve.exited().unwrap().is_some() && want == "READY=1" {
                return false;
            }
        }
        false
    };
    assert!(got("READY=1", &mut serve), "no READY=1: {}", std::fs::read_to_string(&log).unwrap_or_default());
    let health: serde_json::Value = ureq::get(&format!("http://127.0.0.1:{port}/health")).timeout(Duration::from_secs(5)).call().unwrap().into_json().unwrap();
    assert_eq!(health["dataplane"], "userspace", "{health}");
    assert!(state.join("mediaplane.db").exists(), "the store in the state directory (the default configuration's store.path)");
    let status = std::fs::read_to_string(format!("/proc/{}/status", serve.pid())).unwrap();
    assert!(!status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")), "not root: {status}");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(serve.pid() as i32, libc::SIGTERM) };
    assert!(got("STOPPING=1", &mut serve), "no STOPPING=1 on SIGTERM");
    assert!(serve.wait_timeout(Duration::from_secs(10)).unwrap().is_some_and(|s| s.success()), "{}", std::fs::read_to_string(&log).unwrap_or_default());
    drop(guard);
    assert!(!installed("mediaplane") && !state.exists(), "purged");
}

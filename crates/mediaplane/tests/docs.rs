//! The man pages and shell completions come from the same clap definitions as `--help`: each
//! names every user-facing subcommand and the serve options. The README's API error table is
//! the `ErrorCode` enum's.

mod common;

use std::process::Command;

fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_mediaplane")).args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn man_pages_name_every_subcommand() {
    let page = run(&["man"]);
    assert!(page.starts_with(".ie") || page.contains(".TH mediaplane 1"), "{page}");
    for sub in ["serve", "ctl", "demo", "bench"] {
        assert!(page.contains(sub), "mediaplane.1 names {sub}");
    }
    assert!(!page.contains("completions"), "the packaging helpers stay hidden");
    let dir = common::TempDir::new("man");
    run(&["man", "--out-dir", dir.0.to_str().unwrap()]);
    let mut names: Vec<String> = std::fs::read_dir(&dir.0).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["mediaplane-bench.1", "mediaplane-ctl.1", "mediaplane-demo.1", "mediaplane-serve.1", "mediaplane.1"]);
    let serve = std::fs::read_to_string(dir.0.join("mediaplane-serve.1")).unwrap();
    assert!(serve.contains(".TH mediaplane-serve 1") && serve.contains("MEDIAPLANE_CONFIG") && serve.contains("\\-\\-dataplane"), "{serve}");
}

#[test]
fn completions_for_each_shell_name_the_subcommands() {
    for shell in ["bash", "zsh", "fish"] {
        let script = run(&["completions", shell]);
        for word in ["serve", "ctl", "demo", "bench", "dataplane", "pin-dir"] {
            assert!(script.contains(word), "{shell} completion names {word}");
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_mediaplane")).args(["completions", "tcsh"]).output().unwrap();
    assert!(!out.status.success(), "an unknown shell is an error");
}

/// The README's table of error codes is the one the enum makes: every code, its status and its
/// meaning, no code the enum lacks. (On a difference, the table to paste is printed.)
#[test]
fn the_readme_error_table_is_the_error_codes() {
    let readme = include_str!("../../../README.md");
    let table = mediaplane_control::error_code::ErrorCode::markdown_table();
    let header = table.lines().next().unwrap();
    assert_eq!(readme.matches(header).count(), 1, "one error table in the README, starting {header:?}");
    let start = readme.find(header).unwrap();
    let len = readme[start..].find("\n\n").unwrap_or(readme.len() - start) + 1;
    let documented = &readme[start..start + len];
    assert!(documented == table, "the README's error table differs from ErrorCode's; it should read:\n{table}\nit reads:\n{documented}");
}

//! Builds the BPF programs in bpf/ with clang (via libbpf-cargo's SkeletonBuilder) against a
//! vmlinux.h generated from the running kernel's BTF into OUT_DIR.

use libbpf_cargo::SkeletonBuilder;
use std::path::{Path, PathBuf};
use std::process::Command;

const BTF: &str = "/sys/kernel/btf/vmlinux";
const PROGRAMS: &[&str] = &["sfu_tc", "prefilter_xdp", "slow_path_sk_lookup", "xsk_redirect"];

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let bpf_dir = manifest.join("bpf");
    println!("cargo:rerun-if-changed={}", bpf_dir.display());
    println!("cargo:rerun-if-changed={BTF}");

    generate_vmlinux_h(&out.join("vmlinux.h"));
    generate_counter_names(&bpf_dir.join("counters.def"), &out.join("counters.rs"));

    for prog in PROGRAMS {
        let src = bpf_dir.join(format!("{prog}.bpf.c"));
        let obj = out.join(format!("{prog}.bpf.o"));
        let skel = out.join(format!("{prog}.skel.rs"));
        SkeletonBuilder::new()
            .source(&src)
            .obj(&obj)
            .clang_args([
                "-O2".to_string(),
                "-g".to_string(),
                "-Wall".to_string(),
                "-Werror".to_string(),
                format!("-I{}", out.display()),
                format!("-I{}", bpf_dir.display()),
            ])
            .build_and_generate(&skel)
            .unwrap_or_else(|e| panic!("mediaplane-ebpf: building {}: {e:#}", src.display()));
    }
}

/// `bpftool btf dump file /sys/kernel/btf/vmlinux format c > OUT_DIR/vmlinux.h`.
fn generate_vmlinux_h(dst: &Path) {
    if !Path::new(BTF).exists() {
        panic!(
            "mediaplane-ebpf: {BTF} is missing: this crate needs a kernel built with \
             CONFIG_DEBUG_INFO_BTF=y to generate vmlinux.h"
        );
    }
    let output = Command::new("bpftool")
        .args(["btf", "dump", "file", BTF, "format", "c"])
        .output()
        .unwrap_or_else(|e| panic!("mediaplane-ebpf: cannot run bpftool ({e}); install it (Debian: apt-get install bpftool)"));
    if !output.status.success() {
        panic!("mediaplane-ebpf: bpftool btf dump failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    std::fs::write(dst, &output.stdout).unwrap_or_else(|e| panic!("writing {}: {e}", dst.display()));
}

/// OUT_DIR/counters.rs: `GLOBAL_COUNTERS`, the names of bpf/counters.def's `MP_COUNTER(NAME)`
/// lines in order, lower case (the C side makes enum mp_counter of the same lines).
fn generate_counter_names(def: &Path, dst: &Path) {
    let text = std::fs::read_to_string(def).unwrap_or_else(|e| panic!("reading {}: {e}", def.display()));
    let names: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("MP_COUNTER("))
        .map(|rest| {
            let name = &rest[..rest.find(')').unwrap_or_else(|| panic!("{}: no ')' after MP_COUNTER({rest}", def.display()))];
            assert!(
                !name.is_empty() && name.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'),
                "{}: bad counter name {name:?}",
                def.display()
            );
            name.to_ascii_lowercase()
        })
        .collect();
    let list: Vec<String> = names.iter().map(|n| format!("    {n:?},\n")).collect();
    let rust = format!(
        "/// Global counter indices (enum mp_counter, from bpf/counters.def) with their names in\n\
         /// `DataplaneStats.extra`. The first eight feed [`mediaplane_dataplane::Counters`].\n\
         pub const GLOBAL_COUNTERS: [&str; {}] = [\n{}];\n",
        names.len(),
        list.concat()
    );
    std::fs::write(dst, rust).unwrap_or_else(|e| panic!("writing {}: {e}", dst.display()));
}

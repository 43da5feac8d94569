//! Output of `mediaplane bench relay`: console table, JSON, CSV and an HTML report with SVG
//! plots (loss, CPU per packet, CPU %, set-up latency and delay vs concurrent calls per relay;
//! install rate and memory vs sessions installed).

use crate::relay_results::{Capacity, RelayRun};
use crate::report::{esc, html_table, line_chart, RunMeta};
use std::fmt::Write as _;
use std::path::Path;

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|x| x.to_string()).unwrap_or_default()
}

pub const CSV_HEADER: &str = "relay,media,calls,calls_up,setup_failures,setup_rate_target,setup_rate_achieved,offer_p50_ms,offer_p99_ms,answer_p50_ms,answer_p99_ms,\
legs,legs_latched,latch_s,idle_cpu_ms_per_s,seconds,planned,sent,send_errors,received,lost,loss_pct,legs_with_loss,duplicates,unexpected,srtp_failed,srtp_replayed,\
delay_p50_us,delay_mean_us,delay_p99_us,delay_max_us,added_delay_p50_us,added_delay_p99_us,dv_p99_median_us,dv_p99_max_us,jitter_mean_us,mos_mean,mos_min,\
generator_srtp_protect_p50_ns,relay_cpu_ms,bpf_run_ms,cpu_pct,cpu_per_packet_ns,machine_cpu_per_packet_ns,kernel_forwarded,slow_path_rx,relay_rss_mib,bpf_memlock_mib,generator_cpu_ms,receiver_cpu_ms,\
delete_failures,delete_p50_ms,left_after_delete";

fn csv_row(r: &RelayRun) -> String {
    let ms = |ns: f64| format!("{:.3}", ns / 1e6);
    let us = |ns: f64| format!("{:.1}", ns / 1e3);
    [
        r.relay.clone(),
        r.media.clone(),
        r.calls.to_string(),
        r.calls_up.to_string(),
        r.setup_failures.to_string(),
        format!("{:.1}", r.setup_rate_target),
        format!("{:.1}", r.setup_rate_achieved),
        ms(r.offer_ns.p50),
        ms(r.offer_ns.p99),
        ms(r.answer_ns.p50),
        ms(r.answer_ns.p99),
        r.legs.to_string(),
        opt(r.legs_latched),
        format!("{:.2}", r.latch_seconds),
        r.idle_cpu_ms_per_s.map(|c| format!("{c:.3}")).unwrap_or_default(),
        format!("{:.1}", r.seconds),
        r.planned.to_string(),
        r.sent.to_string(),
        r.send_errors.to_string(),
        r.received.to_string(),
        r.lost.to_string(),
        format!("{:.4}", r.loss_pct),
        r.legs_with_loss.to_string(),
        r.duplicates.to_string(),
        r.unexpected.to_string(),
        r.srtp_failed.to_string(),
        r.srtp_replayed.to_string(),
        us(r.delay_ns.p50),
        us(r.delay_ns.mean),
        us(r.delay_ns.p99),
        us(r.delay_ns.max),
        r.added_delay_p50_ns.map(us).unwrap_or_default(),
        r.added_delay_p99_ns.map(us).unwrap_or_default(),
        us(r.delay_variation_p99_median_ns),
        us(r.delay_variation_p99_max_ns),
        us(r.jitter_mean_ns),
        format!("{:.3}", r.mos_mean),
        format!("{:.3}", r.mos_min),
        r.generator_srtp_protect_p50_ns.map(|p| format!("{p:.0}")).unwrap_or_default(),
        format!("{:.1}", r.relay_cpu_ns as f64 / 1e6),
        format!("{:.1}", r.bpf_run_ns as f64 / 1e6),
        format!("{:.2}", r.cpu_pct),
        r.cpu_per_packet_ns.map(|c| format!("{c:.0}")).unwrap_or_default(),
        r.machine_cpu_per_packet_ns.map(|c| format!("{c:.0}")).unwrap_or_default(),
        opt(r.kernel_forwarded),
        opt(r.slow_path_rx),
        format!("{:.1}", r.relay_rss_kib as f64 / 1024.0),
        format!("{:.2}", r.relay_bpf_memlock_bytes as f64 / 1048576.0),
        format!("{:.1}", r.generator_cpu_ns as f64 / 1e6),
        format!("{:.1}", r.receiver_cpu_ns as f64 / 1e6),
        r.delete_failures.to_string(),
        ms(r.delete_ns.p50),
        opt(r.left_after_delete),
    ]
    .join(",")
}

pub fn print_table(runs: &[RelayRun], cap: Option<&Capacity>) {
    println!(
        "\n{:<32} {:>6} {:>6} {:>7} {:>8} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>6} {:>7} {:>9} {:>11} {:>8} {:>8} {:>9}",
        "relay",
        "calls",
        "up",
        "fail",
        "setup/s",
        "offer99",
        "sent",
        "loss %",
        "p50 µs",
        "p99 µs",
        "added50",
        "dv99 µs",
        "MOS",
        "CPU %",
        "ns/pkt",
        "machine/pkt",
        "gen CPU",
        "RSS MiB",
        "idle ms/s"
    );
    for r in runs {
        println!(
            "{:<32} {:>6} {:>6} {:>7} {:>8.1} {:>8.2} {:>9} {:>8.3} {:>8.1} {:>8.1} {:>8} {:>8.1} {:>6.2} {:>7.1} {:>9} {:>11} {:>7.0}% {:>8.1} {:>9}",
            r.label(),
            r.calls,
            r.calls_up,
            r.setup_failures,
            r.setup_rate_achieved,
            r.offer_ns.p99 / 1e6,
            r.sent,
            r.loss_pct,
            r.delay_ns.p50 / 1e3,
            r.delay_ns.p99 / 1e3,
            r.added_delay_p50_ns.map(|d| format!("{:.1}", d / 1e3)).unwrap_or("-".into()),
            r.delay_variation_p99_median_ns / 1e3,
            r.mos_mean,
            r.cpu_pct,
            r.cpu_per_packet_ns.map(|c| format!("{c:.0}")).unwrap_or("-".into()),
            r.machine_cpu_per_packet_ns.map(|c| format!("{c:.0}")).unwrap_or("-".into()),
            100.0 * r.generator_cpu_ns as f64 / (r.seconds * 1e9),
            r.relay_rss_kib as f64 / 1024.0,
            r.idle_cpu_ms_per_s.map(|c| format!("{c:.2}")).unwrap_or("-".into())
        );
    }
    if let Some(c) = cap {
        println!("\ncapacity (mediaplane, eBPF plane):");
        for r in &c.ramps {
            let last = r.samples.last();
            println!(
                "  {:<4} {:>9} of {:>9} sessions in {:>7.1} s = {:>8.1}/s, daemon CPU {:>6.1} µs/session; RSS {:>7.1} MiB, BPF maps {:>6.1} MiB; stopped by {}",
                r.api,
                r.installed,
                r.target,
                r.seconds,
                r.rate_mean,
                r.daemon_cpu_ns_per_session / 1e3,
                last.map_or(0.0, |s| s.rss_kib as f64 / 1024.0),
                last.map_or(0.0, |s| s.bpf_memlock_bytes as f64 / 1048576.0),
                r.stopped_by
            );
        }
        for m in &c.mutation_cost {
            println!(
                "  one mutation at {:>8} relays: model clone {:>7.4} ms, table update {:>7.4} ms, store save {:>7.3} ms (a whole-table compile: {:>9.3} ms)",
                m.relays,
                m.model_clone_ns / 1e6,
                m.table_update_ns / 1e6,
                m.store_save_ns / 1e6,
                m.table_compile_ns / 1e6
            );
        }
    }
}

type Series = Vec<(String, Vec<(f64, f64)>)>;

fn per_relay(runs: &[RelayRun], metric: &dyn Fn(&RelayRun) -> Option<f64>) -> Series {
    let mut names: Vec<String> = runs.iter().map(RelayRun::label).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .map(|n| {
            let pts = runs.iter().filter(|r| r.label() == n).filter_map(|r| Some((r.calls as f64, metric(r)?))).collect();
            (n, pts)
        })
        .collect()
}

fn write_plots(dir: &Path, runs: &[RelayRun], cap: Option<&Capacity>) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut add = |file: &str, caption: &str, title: &str, xdesc: &str, ydesc: &str, s: Series| -> anyhow::Result<()> {
        if s.iter().any(|x| !x.1.is_empty()) {
            line_chart(&dir.join(file), title, xdesc, ydesc, &s)?;
            out.push((file.to_string(), caption.to_string()));
        }
        Ok(())
    };
    let calls = "concurrent calls";
    add("relay_loss.svg", "Loss vs calls", "packet loss after latching", calls, "% of packets", per_relay(runs, &|r| Some(r.loss_pct)))?;
    add(
        "relay_cpu_per_packet.svg",
        "CPU per relayed packet vs calls",
        "relay CPU (+ BPF run time) per relayed packet",
        calls,
        "ns",
        per_relay(runs, &|r| r.cpu_per_packet_ns),
    )?;
    add(
        "relay_machine_cpu_per_packet.svg",
        "Machine CPU per relayed packet vs calls",
        "busy time of all CPUs per relayed packet: generator, relay and the kernel's packet work (kernel-forward = no relay)",
        calls,
        "ns",
        per_relay(runs, &|r| r.machine_cpu_per_packet_ns),
    )?;
    add("relay_cpu_pct.svg", "Relay CPU vs calls", "relay CPU (+ BPF run time), % of one core", calls, "%", per_relay(runs, &|r| Some(r.cpu_pct)))?;
    add(
        "relay_delay_p99.svg",
        "One-way delay p99 vs calls",
        "one-way delay p99 per packet (through the relay)",
        calls,
        "µs",
        per_relay(runs, &|r| Some(r.delay_ns.p99 / 1e3)),
    )?;
    add("relay_setup_p99.svg", "NG offer latency p99 vs calls", "NG offer round trip p99", calls, "ms", per_relay(runs, &|r| Some(r.offer_ns.p99 / 1e6)))?;
    add("relay_mos.svg", "MOS vs calls", "G.107 MOS (G.711), worst leg", calls, "MOS", per_relay(runs, &|r| Some(r.mos_min)))?;
    if let Some(c) = cap {
        let s: Series =
            c.ramps.iter().map(|r| (format!("{} ({})", r.api, r.dataplane), r.samples.iter().map(|s| (s.sessions as f64, s.rate)).collect())).collect();
        add("capacity_rate.svg", "Install rate vs sessions installed", "relay sessions installed per second", "relay sessions installed", "sessions/s", s)?;
        let s: Series =
            c.ramps.iter().map(|r| (format!("{} RSS", r.api), r.samples.iter().map(|s| (s.sessions as f64, s.rss_kib as f64 / 1024.0)).collect())).collect();
        add("capacity_rss.svg", "Daemon memory vs sessions", "daemon VmRSS", "relay sessions installed", "MiB", s)?;
    }
    Ok(out)
}

pub fn write_all(dir: &Path, meta: &RunMeta, setup_rate: f64, runs: &[RelayRun], cap: Option<&Capacity>, failures: &[String]) -> anyhow::Result<()> {
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&serde_json::json!({"meta": meta, "setup_rate": setup_rate, "runs": runs, "capacity": cap, "failures": failures}))?,
    )?;
    let mut csv = String::from(CSV_HEADER);
    csv.push('\n');
    for r in runs {
        csv.push_str(&csv_row(r));
        csv.push('\n');
    }
    std::fs::write(dir.join("results.csv"), csv)?;
    let plots = write_plots(dir, runs, cap)?;

    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>mediaplane bench relay</title>\
         <style>body{{font-family:sans-serif;max-width:1300px;margin:2em auto}}table{{border-collapse:collapse;font-size:12px}}\
         td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}th{{background:#eee}}img{{margin:6px}}</style></head><body>\
         <h1>mediaplane bench relay</h1><p><code>{}</code></p>\
         <p>Machine: {} cores, {:.1} GiB, {}; kernel {}; commit {}.</p>\
         <p>SIP media relay (seed 002, P4 switch-based relay): N concurrent G.711 calls set up over the NG protocol at {setup_rate} calls/s, \
         each call two legs of 50 packets/s, 172-byte RTP; {} s of media once all calls are up. Relays run one at a time in the same \
         relay namespace, on the same traffic: mediaplane user-space plane, mediaplane eBPF plane, rtpengine (user space; its kernel module is not available here). \
         The first packet of each leg latches the leg and is not part of the measurement. \
         Loss is counted from the harness sequence; packets the generator could not send on time are reported as planned − sent (generator shortfall), not as loss. \
         CPU: the relay process (all threads, schedstat) plus, for eBPF, the BPF program's run time; kernel work done in the sender's softirq outside the BPF program \
         (veth, routing) is attributed to no relay. MOS: G.107 E-model, G.711 (Ie = 0, Bpl = 4.3), measured mean delay and loss. \
         The generator (one sender thread, one receiver thread) runs on the same 2-core machine as the relay. \
         Runs marked (sdes-rtp): the caller speaks SDES-SRTP (AES_CM_128_HMAC_SHA1_80), the callee plain RTP, and the relay bridges them \
         (<code>transport-protocol=RTP/AVP</code> on the offer): every packet is unprotected or protected once by the relay. \
         The caller protects before sending, so its direction's delay includes that (the median is in <code>generator_srtp_protect_p50_ns</code>).</p>",
        esc(&meta.command),
        meta.cores,
        meta.memory_gib,
        esc(&meta.cpu),
        esc(&meta.kernel),
        esc(&meta.git_commit),
        meta.seconds
    );
    if !failures.is_empty() {
        h.push_str("<h2>Failures</h2><ul>");
        for f in failures {
            let _ = write!(h, "<li><pre>{}</pre></li>", esc(f));
        }
        h.push_str("</ul>");
    }
    let with_setup_errors: Vec<&RelayRun> = runs.iter().filter(|r| r.setup_failures > 0).collect();
    if !with_setup_errors.is_empty() {
        h.push_str("<h2>Set-up failures</h2><ul>");
        for r in with_setup_errors {
            let _ = write!(
                h,
                "<li>{} N={}: {} of {} calls failed; first: <code>{}</code></li>",
                esc(&r.label()),
                r.calls,
                r.setup_failures,
                r.calls,
                esc(&r.setup_errors.join(" | "))
            );
        }
        h.push_str("</ul>");
    }
    h.push_str("<h2>Plots</h2>");
    for (file, title) in &plots {
        let _ = write!(h, "<figure style=\"display:inline-block\"><img src=\"{file}\" alt=\"{t}\"><figcaption>{t}</figcaption></figure>", t = esc(title));
    }
    h.push_str("<h2>Runs</h2>");
    h.push_str(&html_table(CSV_HEADER, runs.iter().map(csv_row)));
    if let Some(c) = cap {
        h.push_str(
            "<h2>Capacity of the API layer (mediaplane, eBPF plane, one worker)</h2>\
             <p>NG: one client, offer + answer back to back (each call installs 2 relay sessions, RTP and RTCP). \
             HTTP: several keep-alive clients (<code>--capacity-clients</code>), <code>POST /v1/relays</code> with explicit local addresses spread over many IPs; \
             http-batchN: the same clients sending N relays per <code>POST /v1/batch/relays</code> (one transaction and one data plane update per request). \
             The clients share the machine's cores with the daemon; daemon CPU per session is what a set-up costs the server. \
             Memory: daemon VmRSS and the memlock of the BPF maps it holds.</p>\
             <table><tr><th>API</th><th>target</th><th>installed</th><th>seconds</th><th>sessions/s</th><th>daemon CPU µs/session</th><th>last request p50 ms</th><th>RSS MiB</th><th>BPF maps MiB</th><th>stopped by</th></tr>",
        );
        for r in &c.ramps {
            let last = r.samples.iter().rev().find(|s| s.request_ns.count > 0);
            let end = r.samples.last();
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.2}</td><td>{:.1}</td><td>{:.2}</td><td style=\"text-align:left\">{}</td></tr>",
                r.api,
                r.target,
                r.installed,
                r.seconds,
                r.rate_mean,
                r.daemon_cpu_ns_per_session / 1e3,
                last.map_or(0.0, |s| s.request_ns.p50 / 1e6),
                end.map_or(0.0, |s| s.rss_kib as f64 / 1024.0),
                end.map_or(0.0, |s| s.bpf_memlock_bytes as f64 / 1048576.0),
                esc(&r.stopped_by)
            );
        }
        h.push_str("</table><h3>Where one mutation's time goes (in-process, same code as the daemon)</h3>\
                    <p>Every change (NG offer/answer, latch, HTTP POST) copies the model (a persistent map: O(1)), recompiles only the rooms and relays it touched, installs the changed keys in the data plane and writes the changed rows to SQLite. \
                    The last column is what a whole-table compile costs at that size: what every change cost before updates were incremental.</p>\
                    <table><tr><th>relays in the model</th><th>model clone ms</th><th>table update ms</th><th>store save ms</th><th>whole-table compile ms</th></tr>");
        for m in &c.mutation_cost {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{:.4}</td><td>{:.4}</td><td>{:.3}</td><td>{:.3}</td></tr>",
                m.relays,
                m.model_clone_ns / 1e6,
                m.table_update_ns / 1e6,
                m.store_save_ns / 1e6,
                m.table_compile_ns / 1e6
            );
        }
        h.push_str("</table>");
    }
    h.push_str("</body></html>");
    std::fs::write(dir.join("report.html"), h)?;
    Ok(())
}

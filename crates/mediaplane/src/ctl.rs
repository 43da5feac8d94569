//! `mediaplane ctl`: the API from the command line. Prints the JSON response; on an API error
//! prints its message and exits non-zero.

use anyhow::bail;
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use std::net::SocketAddr;

#[derive(Args)]
pub struct CtlArgs {
    /// Base URL of the daemon's API.
    #[arg(long, env = "MEDIAPLANE_API", default_value = "http://127.0.0.1:7580")]
    api: String,
    /// Bearer token, when the daemon requires one (api.token).
    #[arg(long, env = "MEDIAPLANE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[command(subcommand)]
    command: CtlCommand,
}

#[derive(Subcommand)]
enum CtlCommand {
    /// Daemon status.
    Health,
    /// Rooms: list | create | show | delete.
    #[command(subcommand)]
    Room(RoomCmd),
    /// Participants of a room.
    #[command(subcommand)]
    Participant(ParticipantCmd),
    /// Publish a stream (e.g. a quality "low"/"high") from a participant.
    Publish {
        room: String,
        participant: String,
        name: String,
        /// Own SFU address for this stream (default: the participant's).
        #[arg(long)]
        local: Option<SocketAddr>,
        /// Narrow the stream to one RTP SSRC.
        #[arg(long)]
        ssrc: Option<u32>,
        /// Forward any UDP payload without RTP checks.
        #[arg(long)]
        raw: bool,
    },
    Unpublish {
        room: String,
        participant: String,
        name: String,
    },
    /// Subscribe a participant to another participant's stream.
    Subscribe {
        room: String,
        participant: String,
        publisher: String,
        stream: String,
    },
    Unsubscribe {
        room: String,
        participant: String,
        publisher: String,
        stream: String,
    },
    /// A room's consumers (one per subscription) with their counters and the receivers'
    /// reports; one of them with --id.
    Consumers {
        room: String,
        #[arg(long)]
        id: Option<u32>,
    },
    /// SIP-style relay pairs.
    #[command(subcommand)]
    Relay(RelayCmd),
    /// Data plane counters, per stream.
    Stats,
    /// The compiled forwarding table.
    Table,
}

#[derive(Subcommand)]
enum RoomCmd {
    List,
    Create { id: String },
    Show { id: String },
    Delete { id: String },
}

#[derive(Subcommand)]
enum ParticipantCmd {
    /// Add a participant receiving media at --remote.
    Add {
        room: String,
        id: String,
        #[arg(long)]
        remote: SocketAddr,
        /// SFU address for this participant (default: allocated).
        #[arg(long)]
        local: Option<SocketAddr>,
    },
    Show {
        room: String,
        id: String,
    },
    Remove {
        room: String,
        id: String,
    },
}

#[derive(Subcommand)]
enum RelayCmd {
    List,
    Create {
        id: String,
        #[arg(long)]
        a_local: Option<SocketAddr>,
        #[arg(long)]
        a_remote: Option<SocketAddr>,
        #[arg(long)]
        b_local: Option<SocketAddr>,
        #[arg(long)]
        b_remote: Option<SocketAddr>,
        /// Only the signalled remotes may send; no latching.
        #[arg(long)]
        strict: bool,
    },
    Show {
        id: String,
    },
    Delete {
        id: String,
    },
}

pub fn run(args: CtlArgs) -> anyhow::Result<()> {
    let api = args.api.trim_end_matches('/');
    let (method, path, body): (&str, String, Option<Value>) = match args.command {
        CtlCommand::Health => ("GET", "/health".into(), None),
        CtlCommand::Room(c) => match c {
            RoomCmd::List => ("GET", "/v1/rooms".into(), None),
            RoomCmd::Create { id } => ("POST", "/v1/rooms".into(), Some(json!({"id": id}))),
            RoomCmd::Show { id } => ("GET", format!("/v1/rooms/{id}"), None),
            RoomCmd::Delete { id } => ("DELETE", format!("/v1/rooms/{id}"), None),
        },
        CtlCommand::Participant(c) => match c {
            ParticipantCmd::Add { room, id, remote, local } => {
                ("POST", format!("/v1/rooms/{room}/participants"), Some(json!({"id": id, "remote": remote, "local": local})))
            }
            ParticipantCmd::Show { room, id } => ("GET", format!("/v1/rooms/{room}/participants/{id}"), None),
            ParticipantCmd::Remove { room, id } => ("DELETE", format!("/v1/rooms/{room}/participants/{id}"), None),
        },
        CtlCommand::Publish { room, participant, name, local, ssrc, raw } => {
            ("POST", format!("/v1/rooms/{room}/participants/{participant}/streams"), Some(json!({"name": name, "local": local, "ssrc": ssrc, "rtp": !raw})))
        }
        CtlCommand::Unpublish { room, participant, name } => ("DELETE", format!("/v1/rooms/{room}/participants/{participant}/streams/{name}"), None),
        CtlCommand::Subscribe { room, participant, publisher, stream } => {
            ("POST", format!("/v1/rooms/{room}/participants/{participant}/subscriptions"), Some(json!({"publisher": publisher, "stream": stream})))
        }
        CtlCommand::Unsubscribe { room, participant, publisher, stream } => {
            ("DELETE", format!("/v1/rooms/{room}/participants/{participant}/subscriptions/{publisher}/{stream}"), None)
        }
        CtlCommand::Consumers { room, id: None } => ("GET", format!("/v1/rooms/{room}/consumers"), None),
        CtlCommand::Consumers { room, id: Some(id) } => ("GET", format!("/v1/rooms/{room}/consumers/{id}"), None),
        CtlCommand::Relay(c) => match c {
            RelayCmd::List => ("GET", "/v1/relays".into(), None),
            RelayCmd::Create { id, a_local, a_remote, b_local, b_remote, strict } => (
                "POST",
                "/v1/relays".into(),
                Some(json!({"id": id, "a": {"local": a_local, "remote": a_remote, "strict": strict},
                            "b": {"local": b_local, "remote": b_remote, "strict": strict}})),
            ),
            RelayCmd::Show { id } => ("GET", format!("/v1/relays/{id}"), None),
            RelayCmd::Delete { id } => ("DELETE", format!("/v1/relays/{id}"), None),
        },
        CtlCommand::Stats => ("GET", "/v1/stats".into(), None),
        CtlCommand::Table => ("GET", "/v1/table".into(), None),
    };
    let v = request(api, args.token.as_deref(), method, &path, body)?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// One API call; an HTTP error status becomes an error carrying the API's message.
pub fn request(api: &str, token: Option<&str>, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
    let agent = ureq::AgentBuilder::new().timeout(std::time::Duration::from_secs(10)).build();
    let mut req = agent.request(method, &format!("{api}{path}"));
    if let Some(t) = token {
        req = req.set("authorization", &format!("Bearer {t}"));
    }
    let resp = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    match resp {
        Ok(r) => Ok(r.into_json()?),
        Err(ureq::Error::Status(code, r)) => {
            let v: Value = r.into_json().unwrap_or(Value::Null);
            let msg = v.get("error").and_then(Value::as_str).unwrap_or("(no message)").to_string();
            bail!("{method} {path}: HTTP {code}: {msg}")
        }
        Err(e) => bail!("cannot reach the mediaplane API at {api}: {e}"),
    }
}

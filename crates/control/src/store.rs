//! Where sessions are kept across restarts: a [`Store`] over one of two backends. The default,
//! embedded one is SQLite ([`SqliteStore`]); a Redis one ([`RedisStore`], `redis://` or
//! `redis+unix://` in `store.url` or `--store`) keeps them outside the machine, the first step
//! toward another node taking them over. Both keep one JSON body per room and per relay, so a
//! change rewrites only what changed, and both carry a schema version: a store written by a
//! newer mediaplane is refused, not misread.

use crate::config::StoreConfig;
use mediaplane_core::model::{Relay, Room};
use mediaplane_core::Model;
use rusqlite::{params, Connection, OptionalExtension};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// The layout both backends write (rooms, relays, next uid). Raised when it changes in a way an
/// older mediaplane would misread.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("store: redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("store: corrupt row {0}: {1}")]
    Corrupt(String, String),
    #[error("store: schema version {0} is newer than this mediaplane's ({SCHEMA_VERSION}): refusing to read it")]
    Schema(u32),
}

/// One change to persist, produced by the session manager for each mutation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Room(String),
    Relay(String),
}

impl Change {
    /// The part of the table this change recompiles.
    pub fn owner(&self) -> mediaplane_core::table::Owner<'_> {
        match self {
            Change::Room(id) => mediaplane_core::table::Owner::Room(id),
            Change::Relay(id) => mediaplane_core::table::Owner::Relay(id),
        }
    }
}

/// What a backend keeps: the bodies of rooms and relays by id, and the next uid.
#[derive(Debug, Default)]
pub struct Stored {
    pub rooms: Vec<(String, String)>,
    pub relays: Vec<(String, String)>,
    pub next_uid: Option<u32>,
}

/// A place the sessions are kept. `save` writes one mutation's changes atomically: all or none.
pub trait Backend: Send {
    fn read(&mut self) -> Result<Stored, StoreError>;
    /// Write the bodies given (None: delete) and the next uid, in one transaction.
    fn write(&mut self, rooms: &[(&str, Option<String>)], relays: &[(&str, Option<String>)], next_uid: u32) -> Result<(), StoreError>;
    fn clear(&mut self) -> Result<(), StoreError>;
    /// A value kept beside the sessions (the DTLS certificate); `clear` forgets it too.
    fn read_meta(&mut self, key: &str) -> Result<Option<String>, StoreError>;
    fn write_meta(&mut self, key: &str, value: &str) -> Result<(), StoreError>;
    /// For logs: what it is and where.
    fn describe(&self) -> String;
}

pub struct Store {
    backend: Box<dyn Backend>,
}

impl Store {
    /// The embedded SQLite store at `path`.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        Ok(Store { backend: Box::new(SqliteStore::open(path)?) })
    }

    pub fn in_memory() -> Result<Store, StoreError> {
        Ok(Store { backend: Box::new(SqliteStore::in_memory()?) })
    }

    /// The store the configuration names: `url` (Redis) when set, else the SQLite file `path`.
    pub fn from_config(cfg: &StoreConfig) -> Result<Store, StoreError> {
        match &cfg.url {
            Some(url) => Ok(Store { backend: Box::new(RedisStore::connect(url, &cfg.key_prefix)?) }),
            None => Store::open(&cfg.path),
        }
    }

    pub fn with_backend(backend: Box<dyn Backend>) -> Store {
        Store { backend }
    }

    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    /// The stored model. Rooms stored before subscriptions had consumer ids are given theirs
    /// and stored again, so the ids stay the same from then on.
    pub fn load(&mut self) -> Result<Model, StoreError> {
        let stored = self.backend.read()?;
        let mut rooms = BTreeMap::new();
        let mut unnumbered = Vec::new();
        for (id, body) in stored.rooms {
            let room: Room = serde_json::from_str(&body).map_err(|e| StoreError::Corrupt(format!("room {id}"), e.to_string()))?;
            if room.participants.values().any(|p| p.subscriptions.values().any(|c| c.uid == 0)) {
                unnumbered.push(Change::Room(id.clone()));
            }
            rooms.insert(id, room);
        }
        let mut relays = BTreeMap::new();
        for (id, body) in stored.relays {
            let relay: Relay = serde_json::from_str(&body).map_err(|e| StoreError::Corrupt(format!("relay {id}"), e.to_string()))?;
            relays.insert(id, relay);
        }
        let model = Model::from_parts(rooms, relays, stored.next_uid.unwrap_or(1)).map_err(|e| StoreError::Corrupt("model".into(), e.to_string()))?;
        if !unnumbered.is_empty() {
            self.save(&model, &unnumbered)?;
        }
        Ok(model)
    }

    /// Persist `changes` of `model` in one transaction.
    pub fn save(&mut self, model: &Model, changes: &[Change]) -> Result<(), StoreError> {
        let (mut rooms, mut relays) = (Vec::new(), Vec::new());
        for c in changes {
            match c {
                Change::Room(id) => rooms.push((id.as_str(), model.rooms.get(id).map(|r| serde_json::to_string(r).expect("model serialises")))),
                Change::Relay(id) => relays.push((id.as_str(), model.relays.get(id).map(|r| serde_json::to_string(r).expect("model serialises")))),
            }
        }
        self.backend.write(&rooms, &relays, model.next_uid())
    }

    /// Forget every session (`serve --reset`).
    pub fn clear(&mut self) -> Result<(), StoreError> {
        self.backend.clear()
    }

    /// The relay's DTLS certificate and private key (PEM), as [`Store::set_dtls_identity`] kept it.
    pub fn dtls_identity(&mut self) -> Result<Option<String>, StoreError> {
        self.backend.read_meta(DTLS_IDENTITY)
    }

    pub fn set_dtls_identity(&mut self, pem: &str) -> Result<(), StoreError> {
        self.backend.write_meta(DTLS_IDENTITY, pem)
    }
}

/// The meta key of the DTLS certificate: kept so that a restarted relay (or one that takes
/// over the store) presents the fingerprint its peers' SDP knows.
const DTLS_IDENTITY: &str = "dtls_identity";

/// The embedded store: one SQLite file, one row per room and per relay.
pub struct SqliteStore {
    conn: Connection,
    path: String,
}

impl SqliteStore {
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        Self::init(Connection::open(path)?, path.display().to_string())
    }

    pub fn in_memory() -> Result<SqliteStore, StoreError> {
        Self::init(Connection::open_in_memory()?, ":memory:".into())
    }

    fn init(conn: Connection, path: String) -> Result<SqliteStore, StoreError> {
        // WAL keeps writers from blocking readers; NORMAL sync is durable across process crashes.
        // One daemon owns its store: holding the lock for the connection's life saves two
        // fcntl locks and the shared-memory index per transaction, and a second daemon on
        // the same file fails at start ("database is locked") instead of interleaving writes.
        conn.pragma_update(None, "locking_mode", "EXCLUSIVE")?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS rooms (id TEXT PRIMARY KEY, body TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS relays (id TEXT PRIMARY KEY, body TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);",
        )?;
        let schema: Option<String> = conn.query_row("SELECT value FROM meta WHERE key = 'schema'", [], |r| r.get(0)).optional()?;
        check_schema(schema.as_deref())?;
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema', ?1)", params![SCHEMA_VERSION.to_string()])?;
        Ok(SqliteStore { conn, path })
    }
}

/// A stored schema version this mediaplane can read (none: a store from before versions, 1).
fn check_schema(stored: Option<&str>) -> Result<(), StoreError> {
    match stored.map(|v| v.parse::<u32>()) {
        None => Ok(()),
        Some(Ok(v)) if v <= SCHEMA_VERSION => Ok(()),
        Some(Ok(v)) => Err(StoreError::Schema(v)),
        Some(Err(_)) => Err(StoreError::Corrupt("schema".into(), format!("{stored:?} is not a version"))),
    }
}

impl Backend for SqliteStore {
    fn read(&mut self) -> Result<Stored, StoreError> {
        let rows = |table: &str| -> Result<Vec<(String, String)>, StoreError> {
            let mut stmt = self.conn.prepare(&format!("SELECT id, body FROM {table}"))?;
            let v = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?.collect::<Result<Vec<_>, _>>()?;
            Ok(v)
        };
        let (rooms, relays) = (rows("rooms")?, rows("relays")?);
        let next_uid =
            self.conn.query_row("SELECT value FROM meta WHERE key = 'next_uid'", [], |r| r.get::<_, String>(0)).optional()?.and_then(|v| v.parse().ok());
        Ok(Stored { rooms, relays, next_uid })
    }

    fn write(&mut self, rooms: &[(&str, Option<String>)], relays: &[(&str, Option<String>)], next_uid: u32) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        for (table, rows) in [("rooms", rooms), ("relays", relays)] {
            for (id, body) in rows {
                match body {
                    Some(body) => tx.prepare_cached(&format!("INSERT OR REPLACE INTO {table} (id, body) VALUES (?1, ?2)"))?.execute(params![id, body])?,
                    None => tx.prepare_cached(&format!("DELETE FROM {table} WHERE id = ?1"))?.execute(params![id])?,
                };
            }
        }
        tx.prepare_cached("INSERT OR REPLACE INTO meta (key, value) VALUES ('next_uid', ?1)")?.execute(params![next_uid.to_string()])?;
        tx.commit()?;
        Ok(())
    }

    fn clear(&mut self) -> Result<(), StoreError> {
        self.conn.execute_batch("DELETE FROM rooms; DELETE FROM relays; DELETE FROM meta WHERE key != 'schema';")?;
        Ok(())
    }

    fn read_meta(&mut self, key: &str) -> Result<Option<String>, StoreError> {
        Ok(self.conn.query_row("SELECT value FROM meta WHERE key = ?1", params![key], |r| r.get(0)).optional()?)
    }

    fn write_meta(&mut self, key: &str, value: &str) -> Result<(), StoreError> {
        self.conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)", params![key, value])?;
        Ok(())
    }

    fn describe(&self) -> String {
        format!("sqlite:{}", self.path)
    }
}

/// Sessions in Redis (7.x): under `<prefix>:` a hash of rooms and one of relays (id -> JSON
/// body), a hash `meta` (next uid) and the string `schema`. A mutation's changes go in one
/// MULTI/EXEC. A dropped connection is made again at the next use (the mutation that met the
/// failure fails, and is rolled back by the session manager); each round trip waits at most
/// [`RedisStore::TIMEOUT`], so a Redis that stops answering cannot hold the writer for long.
pub struct RedisStore {
    client: redis::Client,
    conn: Option<redis::Connection>,
    prefix: String,
    url: String,
}

impl RedisStore {
    pub const TIMEOUT: Duration = Duration::from_secs(2);

    pub fn connect(url: &str, prefix: &str) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url)?;
        let mut store = RedisStore { client, conn: None, prefix: prefix.to_string(), url: url.to_string() };
        let schema: Option<String> = redis::cmd("GET").arg(store.key("schema")).query(store.conn()?)?;
        check_schema(schema.as_deref())?;
        let key = store.key("schema");
        let _: () = redis::cmd("SET").arg(key).arg(SCHEMA_VERSION).query(store.conn()?)?;
        Ok(store)
    }

    fn key(&self, what: &str) -> String {
        format!("{}:{what}", self.prefix)
    }

    fn conn(&mut self) -> Result<&mut redis::Connection, StoreError> {
        if self.conn.is_none() {
            let c = self.client.get_connection_with_timeout(Self::TIMEOUT)?;
            c.set_read_timeout(Some(Self::TIMEOUT))?;
            c.set_write_timeout(Some(Self::TIMEOUT))?;
            self.conn = Some(c);
        }
        Ok(self.conn.as_mut().expect("just made"))
    }

    /// Run `f` on the connection; a failure drops it, to be made again next time.
    fn with<T>(&mut self, f: impl FnOnce(&mut redis::Connection, &RedisKeys) -> redis::RedisResult<T>) -> Result<T, StoreError> {
        let keys = RedisKeys { rooms: self.key("rooms"), relays: self.key("relays"), meta: self.key("meta"), schema: self.key("schema") };
        let r = f(self.conn()?, &keys);
        if r.is_err() {
            self.conn = None;
        }
        Ok(r?)
    }
}

struct RedisKeys {
    rooms: String,
    relays: String,
    meta: String,
    schema: String,
}

impl Backend for RedisStore {
    fn read(&mut self) -> Result<Stored, StoreError> {
        type Rows = Vec<(String, String)>;
        let (rooms, relays, next_uid, schema): (Rows, Rows, Option<String>, Option<String>) =
            self.with(|c, k| redis::pipe().hgetall(&k.rooms).hgetall(&k.relays).hget(&k.meta, "next_uid").get(&k.schema).query(c))?;
        check_schema(schema.as_deref())?;
        Ok(Stored { rooms, relays, next_uid: next_uid.and_then(|v| v.parse().ok()) })
    }

    fn write(&mut self, rooms: &[(&str, Option<String>)], relays: &[(&str, Option<String>)], next_uid: u32) -> Result<(), StoreError> {
        self.with(|c, k| {
            let mut p = redis::pipe();
            p.atomic();
            for (key, rows) in [(&k.rooms, rooms), (&k.relays, relays)] {
                for (id, body) in rows {
                    match body {
                        Some(body) => p.hset(key, id, body).ignore(),
                        None => p.hdel(key, id).ignore(),
                    };
                }
            }
            p.hset(&k.meta, "next_uid", next_uid).ignore().set(&k.schema, SCHEMA_VERSION).ignore();
            p.query::<()>(c)
        })
    }

    fn clear(&mut self) -> Result<(), StoreError> {
        self.with(|c, k| redis::pipe().atomic().del(&k.rooms).ignore().del(&k.relays).ignore().del(&k.meta).ignore().query::<()>(c))
    }

    fn read_meta(&mut self, key: &str) -> Result<Option<String>, StoreError> {
        self.with(|c, k| redis::cmd("HGET").arg(&k.meta).arg(key).query(c))
    }

    fn write_meta(&mut self, key: &str, value: &str) -> Result<(), StoreError> {
        self.with(|c, k| redis::cmd("HSET").arg(&k.meta).arg(key).arg(value).query::<()>(c))
    }

    fn describe(&self) -> String {
        format!("{} (keys {}:*)", self.url, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_bench::redis::RedisServer;
    use mediaplane_core::model::{LegSpec, StreamRef, StreamSpec};

    /// A model with a room (two participants, a subscription) and a relay.
    fn sample() -> Model {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "a", "10.0.0.1:4000".parse().unwrap(), "10.0.1.1:5000".parse().unwrap()).unwrap();
        m.add_participant("r", "b", "10.0.0.1:4002".parse().unwrap(), "10.0.1.2:5000".parse().unwrap()).unwrap();
        m.publish("r", "a", "main", StreamSpec::default()).unwrap();
        m.subscribe("r", "b", StreamRef { publisher: "a".into(), stream: "main".into() }).unwrap();
        let leg = |p: &str| LegSpec { local: p.parse().unwrap(), remote: None, strict: false, rtp: true, follow: Default::default() };
        m.create_relay("call", leg("10.0.0.1:30000"), leg("10.0.0.1:30002")).unwrap();
        m
    }

    /// What every backend must do: keep what was saved for the next open, delete, clear.
    fn round_trip(open: &dyn Fn() -> Store) {
        let mut m = sample();
        {
            let mut st = open();
            st.save(&m, &[Change::Room("r".into()), Change::Relay("call".into())]).unwrap();
        }
        {
            let mut st = open();
            assert_eq!(st.load().unwrap(), m, "{}", st.describe());
            m.delete_relay("call").unwrap();
            st.save(&m, &[Change::Relay("call".into())]).unwrap();
        }
        {
            let mut st = open();
            assert_eq!(st.dtls_identity().unwrap(), None);
            st.set_dtls_identity("-----BEGIN PRIVATE KEY-----\n...").unwrap();
            // A session's save leaves it as it is.
            st.save(&m, &[Change::Room("r".into())]).unwrap();
        }
        let mut st = open();
        let loaded = st.load().unwrap();
        assert!(loaded.relays.is_empty());
        assert_eq!(loaded.next_uid(), m.next_uid(), "uids are never reused");
        assert_eq!(st.dtls_identity().unwrap().as_deref(), Some("-----BEGIN PRIVATE KEY-----\n..."), "{}", st.describe());
        st.clear().unwrap();
        assert!(st.load().unwrap().rooms.is_empty());
        assert_eq!(st.dtls_identity().unwrap(), None, "--reset makes a new certificate");
    }

    #[test]
    fn redis_keeps_sessions_as_sqlite_does_and_comes_back_after_redis_does() {
        let Some(redis) = RedisServer::start("store") else { return };
        let prefix = format!("mp-test-{}", std::process::id());
        round_trip(&|| Store::with_backend(Box::new(RedisStore::connect(&redis.url, &prefix).unwrap())));

        // Two deployments on one Redis do not see each other's sessions.
        let mut ours = Store::with_backend(Box::new(RedisStore::connect(&redis.url, &prefix).unwrap()));
        ours.save(&sample(), &[Change::Room("r".into())]).unwrap();
        let mut theirs = Store::with_backend(Box::new(RedisStore::connect(&redis.url, "another").unwrap()));
        assert!(theirs.load().unwrap().rooms.is_empty());

        // Redis restarts (empty: nothing saved): the mutation that meets the dropped
        // connection fails, the next one connects again.
        let url = redis.url.clone();
        drop(redis);
        assert!(matches!(ours.save(&sample(), &[Change::Relay("call".into())]), Err(StoreError::Redis(_))));
        let _redis = RedisServer::start("store").unwrap();
        assert_eq!(_redis.url, url);
        ours.save(&sample(), &[Change::Relay("call".into())]).unwrap();
        assert_eq!(ours.load().unwrap().relays.len(), 1);
    }

    #[test]
    fn a_store_written_by_a_newer_schema_is_refused_by_both_backends() {
        let dir = std::env::temp_dir().join(format!("mp-store-schema-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.db");
        drop(Store::open(&path).unwrap());
        Connection::open(&path).unwrap().execute("UPDATE meta SET value = '2' WHERE key = 'schema'", []).unwrap();
        assert!(matches!(Store::open(&path), Err(StoreError::Schema(2))));
        std::fs::remove_dir_all(&dir).unwrap();

        let Some(redis) = RedisServer::start("schema") else { return };
        let mut c = redis::Client::open(redis.url.as_str()).unwrap().get_connection().unwrap();
        let _: () = redis::cmd("SET").arg("newer:schema").arg(2).query(&mut c).unwrap();
        assert!(matches!(RedisStore::connect(&redis.url, "newer"), Err(StoreError::Schema(2))));
    }

    #[test]
    fn saves_and_reloads_rooms_and_relays() {
        let dir = std::env::temp_dir().join(format!("mp-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.db");
        round_trip(&|| Store::open(&path).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn subscriptions_stored_without_consumer_ids_keep_the_ids_they_get_on_load() {
        let dir = std::env::temp_dir().join(format!("mp-store-uids-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.db");
        let m = sample();
        Store::open(&path).unwrap().save(&m, &[Change::Room("r".into())]).unwrap();
        // As an older version stored it: no consumer id.
        let mut room = serde_json::to_value(&m.rooms["r"]).unwrap();
        room["participants"]["b"]["subscriptions"][0].as_object_mut().unwrap().remove("consumer");
        Connection::open(&path).unwrap().execute("UPDATE rooms SET body = ?1 WHERE id = 'r'", params![room.to_string()]).unwrap();
        let mut st = Store::open(&path).unwrap();
        let first = st.load().unwrap();
        let id = |m: &Model| m.rooms["r"].participants["b"].subscriptions.values().next().unwrap().uid;
        assert_ne!(id(&first), 0);
        // Later uids go higher; the next load (a restart) gives the consumer the same id.
        let mut more = first.clone();
        more.publish("r", "b", "cam", StreamSpec::default()).unwrap();
        st.save(&more, &[Change::Room("r".into())]).unwrap();
        drop(st);
        assert_eq!(id(&Store::open(&path).unwrap().load().unwrap()), id(&first));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

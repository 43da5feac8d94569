//! The embedded store: SQLite, one row per room and per relay, so a change rewrites only what
//! changed. Sessions survive a restart of `serve`.

use mediaplane_core::model::{Relay, Room};
use mediaplane_core::Model;
use rusqlite::{params, Connection, OptionalExtension};
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("store: corrupt row {0}: {1}")]
    Corrupt(String, String),
}

pub struct Store {
    conn: Connection,
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

impl Store {
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        Self::init(Connection::open(path)?)
    }

    pub fn in_memory() -> Result<Store, StoreError> {
        Self::init(Connection::open_in_memory()?)
    }

    fn init(conn: Connection) -> Result<Store, StoreError> {
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
        Ok(Store { conn })
    }

    /// The stored model. Rooms stored before subscriptions had consumer ids are given theirs
    /// and stored again, so the ids stay the same from then on.
    pub fn load(&mut self) -> Result<Model, StoreError> {
        let mut rooms = BTreeMap::new();
        let mut unnumbered = Vec::new();
        let mut stmt = self.conn.prepare("SELECT id, body FROM rooms")?;
        for row in stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))? {
            let (id, body) = row?;
            let room: Room = serde_json::from_str(&body).map_err(|e| StoreError::Corrupt(format!("room {id}"), e.to_string()))?;
            if room.participants.values().any(|p| p.subscriptions.values().any(|c| c.uid == 0)) {
                unnumbered.push(Change::Room(id.clone()));
            }
            rooms.insert(id, room);
        }
        drop(stmt);
        let mut relays = BTreeMap::new();
        let mut stmt = self.conn.prepare("SELECT id, body FROM relays")?;
        for row in stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))? {
            let (id, body) = row?;
            let relay: Relay = serde_json::from_str(&body).map_err(|e| StoreError::Corrupt(format!("relay {id}"), e.to_string()))?;
            relays.insert(id, relay);
        }
        let next_uid: u32 = self
            .conn
            .query_row("SELECT value FROM meta WHERE key = 'next_uid'", [], |r| r.get::<_, String>(0))
            .optional()?
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        drop(stmt);
        let model = Model::from_parts(rooms, relays, next_uid).map_err(|e| StoreError::Corrupt("model".into(), e.to_string()))?;
        if !unnumbered.is_empty() {
            self.save(&model, &unnumbered)?;
        }
        Ok(model)
    }

    /// Persist `changes` of `model` in one transaction.
    pub fn save(&mut self, model: &Model, changes: &[Change]) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        for c in changes {
            match c {
                Change::Room(id) => match model.rooms.get(id) {
                    Some(room) => {
                        let body = serde_json::to_string(room).expect("model serialises");
                        tx.prepare_cached("INSERT OR REPLACE INTO rooms (id, body) VALUES (?1, ?2)")?.execute(params![id, body])?;
                    }
                    None => {
                        tx.prepare_cached("DELETE FROM rooms WHERE id = ?1")?.execute(params![id])?;
                    }
                },
                Change::Relay(id) => match model.relays.get(id) {
                    Some(relay) => {
                        let body = serde_json::to_string(relay).expect("model serialises");
                        tx.prepare_cached("INSERT OR REPLACE INTO relays (id, body) VALUES (?1, ?2)")?.execute(params![id, body])?;
                    }
                    None => {
                        tx.prepare_cached("DELETE FROM relays WHERE id = ?1")?.execute(params![id])?;
                    }
                },
            }
        }
        tx.prepare_cached("INSERT OR REPLACE INTO meta (key, value) VALUES ('next_uid', ?1)")?.execute(params![model.next_uid().to_string()])?;
        tx.commit()?;
        Ok(())
    }

    /// Forget every session (`serve --reset`).
    pub fn clear(&mut self) -> Result<(), StoreError> {
        self.conn.execute_batch("DELETE FROM rooms; DELETE FROM relays; DELETE FROM meta;")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_core::model::{LegSpec, StreamRef, StreamSpec};

    #[test]
    fn saves_and_reloads_rooms_and_relays() {
        let dir = std::env::temp_dir().join(format!("mp-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.db");
        let mut m = Model::new();
        {
            let mut st = Store::open(&path).unwrap();
            m.create_room("r").unwrap();
            m.add_participant("r", "a", "10.0.0.1:4000".parse().unwrap(), "10.0.1.1:5000".parse().unwrap()).unwrap();
            m.add_participant("r", "b", "10.0.0.1:4002".parse().unwrap(), "10.0.1.2:5000".parse().unwrap()).unwrap();
            m.publish("r", "a", "main", StreamSpec::default()).unwrap();
            m.subscribe("r", "b", StreamRef { publisher: "a".into(), stream: "main".into() }).unwrap();
            let leg = |p: &str| LegSpec { local: p.parse().unwrap(), remote: None, strict: false, rtp: true, follow: Default::default() };
            m.create_relay("call", leg("10.0.0.1:30000"), leg("10.0.0.1:30002")).unwrap();
            st.save(&m, &[Change::Room("r".into()), Change::Relay("call".into())]).unwrap();
        }
        let mut st = Store::open(&path).unwrap();
        assert_eq!(st.load().unwrap(), m);
        m.delete_relay("call").unwrap();
        st.save(&m, &[Change::Relay("call".into())]).unwrap();
        assert!(st.load().unwrap().relays.is_empty());
        st.clear().unwrap();
        assert!(st.load().unwrap().rooms.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn subscriptions_stored_without_consumer_ids_keep_the_ids_they_get_on_load() {
        let dir = std::env::temp_dir().join(format!("mp-store-uids-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.db");
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "a", "10.0.0.1:4000".parse().unwrap(), "10.0.1.1:5000".parse().unwrap()).unwrap();
        m.add_participant("r", "b", "10.0.0.1:4002".parse().unwrap(), "10.0.1.2:5000".parse().unwrap()).unwrap();
        m.publish("r", "a", "main", StreamSpec::default()).unwrap();
        m.subscribe("r", "b", StreamRef { publisher: "a".into(), stream: "main".into() }).unwrap();
        let mut st = Store::open(&path).unwrap();
        st.save(&m, &[Change::Room("r".into())]).unwrap();
        // As an older version stored it: no consumer id.
        let mut room = serde_json::to_value(&m.rooms["r"]).unwrap();
        room["participants"]["b"]["subscriptions"][0].as_object_mut().unwrap().remove("consumer");
        st.conn.execute("UPDATE rooms SET body = ?1 WHERE id = 'r'", params![room.to_string()]).unwrap();
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

//! Names of workloads and checkpoints.
//!
//! A checkpoint is named `<workload>/<id>`; `<workload>/latest` names the newest complete one.
//! Checkpoint ids sort by creation time as plain strings, so "latest" is the greatest id, and two
//! writers that start in the same millisecond still get distinct ids (a random suffix).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Why a name or reference was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RefError {
    #[error("workload name {0:?} is invalid: use 1-128 characters from [a-z0-9._-], starting with a letter or digit")]
    InvalidWorkload(String),
    #[error("checkpoint id {0:?} is invalid: expected <yyyymmddThhmmss.mmmZ>-<8 hex>")]
    InvalidId(String),
    #[error(
        "checkpoint reference {0:?} is invalid: expected <workload>/<id> or <workload>/latest"
    )]
    InvalidRef(String),
}

/// A workload's name: the unit whose checkpoints form one history (a container, a process, later
/// a pod's lineage). Safe to use as one path segment of an object key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WorkloadName(String);

impl WorkloadName {
    pub fn new(name: impl Into<String>) -> Result<Self, RefError> {
        let name = name.into();
        let ok = !name.is_empty()
            && name.len() <= 128
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
            && name.as_bytes()[0].is_ascii_alphanumeric();
        if ok {
            Ok(Self(name))
        } else {
            Err(RefError::InvalidWorkload(name))
        }
    }

    /// Derives a valid workload name from arbitrary text (a container id, a command name):
    /// lower-cased, other characters replaced by `-`, trimmed to 128 characters.
    pub fn sanitize(raw: &str) -> Self {
        let mut s: String = raw
            .chars()
            .map(|c| {
                let c = c.to_ascii_lowercase();
                if c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c) {
                    c
                } else {
                    '-'
                }
            })
            .take(128)
            .collect();
        while s.starts_with(['.', '_', '-']) {
            s.remove(0);
        }
        if s.is_empty() {
            s.push_str("workload");
        }
        Self(s)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for WorkloadName {
    type Error = RefError;
    fn try_from(s: String) -> Result<Self, RefError> {
        Self::new(s)
    }
}
impl From<WorkloadName> for String {
    fn from(w: WorkloadName) -> String {
        w.0
    }
}
impl fmt::Display for WorkloadName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A checkpoint id: `yyyymmddThhmmss.mmmZ-<8 hex>`, UTC. Ordering by string is ordering by time.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CheckpointId(String);

impl CheckpointId {
    /// Builds an id from a Unix time in milliseconds and 32 random bits (the caller supplies both:
    /// this crate does no I/O).
    pub fn from_parts(unix_millis: u64, random: u32) -> Self {
        let (y, mo, d, h, mi, s) = crate::time::civil_from_unix((unix_millis / 1000) as i64);
        Self(format!(
            "{y:04}{mo:02}{d:02}T{h:02}{mi:02}{s:02}.{:03}Z-{random:08x}",
            unix_millis % 1000
        ))
    }

    pub fn parse(s: &str) -> Result<Self, RefError> {
        let b = s.as_bytes();
        let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
        let ok = b.len() == 29
            && digits(0..8)
            && b[8] == b'T'
            && digits(9..15)
            && b[15] == b'.'
            && digits(16..19)
            && b[19] == b'Z'
            && b[20] == b'-'
            && b[21..]
                .iter()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase());
        if ok {
            Ok(Self(s.to_owned()))
        } else {
            Err(RefError::InvalidId(s.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// RFC 3339 form of the creation time encoded in the id.
    pub fn created_rfc3339(&self) -> String {
        let s = &self.0;
        format!(
            "{}-{}-{}T{}:{}:{}.{}Z",
            &s[0..4],
            &s[4..6],
            &s[6..8],
            &s[9..11],
            &s[11..13],
            &s[13..15],
            &s[16..19]
        )
    }
}

impl TryFrom<String> for CheckpointId {
    type Error = RefError;
    fn try_from(s: String) -> Result<Self, RefError> {
        Self::parse(&s)
    }
}
impl From<CheckpointId> for String {
    fn from(c: CheckpointId) -> String {
        c.0
    }
}
impl fmt::Display for CheckpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which checkpoint of a workload a reference points at.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Selector {
    Latest,
    Id(CheckpointId),
}

/// `<workload>/<id>` or `<workload>/latest`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CheckpointRef {
    pub workload: WorkloadName,
    pub selector: Selector,
}

impl CheckpointRef {
    pub fn exact(workload: WorkloadName, id: CheckpointId) -> Self {
        Self {
            workload,
            selector: Selector::Id(id),
        }
    }
}

impl FromStr for CheckpointRef {
    type Err = RefError;
    fn from_str(s: &str) -> Result<Self, RefError> {
        let (w, rest) = s
            .split_once('/')
            .ok_or_else(|| RefError::InvalidRef(s.to_owned()))?;
        let workload = WorkloadName::new(w).map_err(|_| RefError::InvalidRef(s.to_owned()))?;
        let selector = match rest {
            "latest" => Selector::Latest,
            id => Selector::Id(
                CheckpointId::parse(id).map_err(|_| RefError::InvalidRef(s.to_owned()))?,
            ),
        };
        Ok(Self { workload, selector })
    }
}

impl fmt::Display for CheckpointRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.selector {
            Selector::Latest => write!(f, "{}/latest", self.workload),
            Selector::Id(id) => write!(f, "{}/{}", self.workload, id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_sort_by_time_and_round_trip() {
        let a = CheckpointId::from_parts(1_795_000_000_123, 0xdead_beef);
        let b = CheckpointId::from_parts(1_795_000_001_000, 0x0000_0001);
        assert!(a < b);
        assert_eq!(CheckpointId::parse(a.as_str()).unwrap(), a);
        assert_eq!(a.as_str(), "20261118T110640.123Z-deadbeef");
        assert_eq!(a.created_rfc3339(), "2026-11-18T11:06:40.123Z");
    }

    #[test]
    fn epoch_and_leap_day() {
        assert_eq!(
            CheckpointId::from_parts(0, 0).as_str(),
            "19700101T000000.000Z-00000000"
        );
        // 2024-02-29T12:00:00Z
        assert_eq!(
            CheckpointId::from_parts(1_709_208_000_000, 1).as_str(),
            "20240229T120000.000Z-00000001"
        );
    }

    #[test]
    fn references_parse() {
        let r: CheckpointRef = "web-1/latest".parse().unwrap();
        assert_eq!(r.selector, Selector::Latest);
        let r: CheckpointRef = "web-1/20261118T110640.123Z-deadbeef".parse().unwrap();
        assert_eq!(r.to_string(), "web-1/20261118T110640.123Z-deadbeef");
        for bad in [
            "",
            "web",
            "web/",
            "/latest",
            "Web/latest",
            "web/123",
            "a/b/c",
            "../x/latest",
        ] {
            assert!(bad.parse::<CheckpointRef>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn workload_names_are_path_safe() {
        assert!(WorkloadName::new("..").is_err());
        assert!(WorkloadName::new("a/b").is_err());
        assert_eq!(
            WorkloadName::sanitize("My_Container:1").as_str(),
            "my_container-1"
        );
        assert_eq!(WorkloadName::sanitize("--").as_str(), "workload");
    }
}

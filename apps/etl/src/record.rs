//! The pipeline's data: log lines as producers write them, the records that carry them, the
//! structured records parsers make of them, and the messages of the two point-to-point hops.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use chunnel_std::serialize::{Bincode, Format};
use serde::{Deserialize, Serialize};

/// Which record: the producer that made it and its sequence number there (0, 1, 2, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RecordId {
    /// The producer's id.
    pub producer: u32,
    /// The record's sequence number at that producer.
    pub seq: u64,
}

/// A log line as a producer sends it (and an ingest server publishes it to the broker).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RawRecord {
    /// Which record.
    pub id: RecordId,
    /// When the line became available to the producer: Unix time in nanoseconds (the time the
    /// producer's schedule gave it, so a producer that falls behind adds to the latency).
    pub stamp_ns: u64,
    /// The log line.
    pub line: String,
}

impl RawRecord {
    /// The record as the broker carries it (bincode).
    pub fn encode(&self) -> Bytes {
        let mut out = Vec::with_capacity(self.line.len() + 24);
        // Encoding a struct of integers and a string into a Vec cannot fail.
        Bincode::encode(self, &mut out).expect("bincode encodes a RawRecord");
        Bytes::from(out)
    }

    /// Decodes a record from the broker; `None` for bytes that are not one.
    pub fn decode(bytes: &[u8]) -> Option<RawRecord> {
        Bincode::decode(bytes).ok()
    }
}

/// Severity of a log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Level {
    /// `DEBUG`
    Debug,
    /// `INFO`
    Info,
    /// `WARN`
    Warn,
    /// `ERROR`
    Error,
}

/// A log line parsed into its fields (what parsers forward to consumers).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parsed {
    /// Which record.
    pub id: RecordId,
    /// The producer's stamp ([`RawRecord::stamp_ns`]).
    pub stamp_ns: u64,
    /// Severity.
    pub level: Level,
    /// The `svc=` field.
    pub service: String,
    /// The `status=` field.
    pub status: u16,
    /// The `latency_ms=` field.
    pub latency_ms: u32,
    /// The `path=` field.
    pub path: String,
}

/// Why a line did not parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Malformed {
    /// Fewer than the six fields.
    TooShort,
    /// The level is none of DEBUG, INFO, WARN, ERROR.
    Level,
    /// A `key=value` field is missing, repeated, unknown or its value does not parse.
    Field,
}

/// Parses `<timestamp> <LEVEL> svc=<s> status=<u16> latency_ms=<u32> path=<p>` (fields after
/// the level in any order, each exactly once).
pub fn parse(raw: &RawRecord) -> Result<Parsed, Malformed> {
    let mut it = raw.line.split_ascii_whitespace();
    let (Some(_ts), Some(level)) = (it.next(), it.next()) else {
        return Err(Malformed::TooShort);
    };
    let level = match level {
        "DEBUG" => Level::Debug,
        "INFO" => Level::Info,
        "WARN" => Level::Warn,
        "ERROR" => Level::Error,
        _ => return Err(Malformed::Level),
    };
    let (mut service, mut status, mut latency, mut path) = (None, None, None, None);
    let mut fields = 0;
    for f in it {
        fields += 1;
        let (k, v) = f.split_once('=').ok_or(Malformed::Field)?;
        let fresh = match k {
            "svc" => service.replace(v.to_owned()).is_none(),
            "status" => status
                .replace(v.parse::<u16>().map_err(|_| Malformed::Field)?)
                .is_none(),
            "latency_ms" => latency
                .replace(v.parse::<u32>().map_err(|_| Malformed::Field)?)
                .is_none(),
            "path" => path.replace(v.to_owned()).is_none(),
            _ => false,
        };
        if !fresh {
            return Err(Malformed::Field);
        }
    }
    if fields < 4 {
        return Err(Malformed::TooShort);
    }
    match (service, status, latency, path) {
        (Some(service), Some(status), Some(latency_ms), Some(path)) => Ok(Parsed {
            id: raw.id,
            stamp_ns: raw.stamp_ns,
            level,
            service,
            status,
            latency_ms,
            path,
        }),
        _ => Err(Malformed::Field),
    }
}

/// Unix time now, in nanoseconds.
pub fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The log line of record `id`: deterministic, so runs are repeatable. With `malformed`, a
/// line the parser must reject (every kind in turn).
pub fn log_line(id: RecordId, stamp_ns: u64, malformed: bool) -> String {
    // A cheap mix of the id (splitmix64's finaliser) picks the fields.
    let mut x = (u64::from(id.producer) << 40) ^ id.seq ^ 0x9e37_79b9_7f4a_7c15;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    const SERVICES: [&str; 4] = ["checkout", "search", "auth", "cart"];
    const LEVELS: [&str; 4] = ["DEBUG", "INFO", "WARN", "ERROR"];
    const PATHS: [&str; 4] = ["/api/v1/items", "/login", "/cart/add", "/search?q=shoes"];
    let ts = stamp_ns / 1_000_000;
    if malformed {
        return match id.seq % 3 {
            0 => format!("{ts} INFO svc={}", SERVICES[(x & 3) as usize]),
            1 => format!("{ts} LOUD svc=a status=200 latency_ms=1 path=/"),
            _ => format!("{ts} WARN svc=auth status=ok latency_ms=7 path=/login"),
        };
    }
    format!(
        "{ts} {} svc={} status={} latency_ms={} path={}",
        LEVELS[((x >> 2) & 3) as usize],
        SERVICES[(x & 3) as usize],
        [200, 200, 200, 201, 404, 500][((x >> 4) % 6) as usize],
        (x >> 8) % 250,
        PATHS[((x >> 16) & 3) as usize],
    )
}

/// What travels on the two point-to-point hops (producer → ingest, parser → consumer), in
/// bincode through `chunnel_std::serialize`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Msg {
    /// A batch for the server, to be acknowledged once the server is done with it.
    Data {
        /// The sender's batch number (scopes the acknowledgement).
        batch: u64,
        /// The records.
        body: Body,
    },
    /// The server is done with batch `batch` (published it, or recorded it).
    Ack {
        /// The batch.
        batch: u64,
    },
}

/// A batch's records.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Body {
    /// Producer → ingest: raw log lines.
    Raw(Vec<RawRecord>),
    /// Parser → consumer: parsed records, and the ids of records the parser rejected as
    /// malformed (so the consumer can account for every sequence number).
    Parsed {
        /// Parsed records.
        records: Vec<Parsed>,
        /// Records that did not parse.
        malformed: Vec<RecordId>,
    },
}

impl Body {
    /// How many records the batch accounts for.
    pub fn len(&self) -> usize {
        match self {
            Body::Raw(r) => r.len(),
            Body::Parsed { records, malformed } => records.len() + malformed.len(),
        }
    }

    /// Whether it accounts for none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(seq: u64, malformed: bool) -> RawRecord {
        let id = RecordId { producer: 3, seq };
        RawRecord {
            id,
            stamp_ns: 1_700_000_000_000_000_000,
            line: log_line(id, 1_700_000_000_000_000_000, malformed),
        }
    }

    #[test]
    fn generated_lines_parse_and_malformed_ones_do_not() {
        for seq in 0..300 {
            let p = parse(&raw(seq, false)).unwrap_or_else(|e| panic!("{seq}: {e:?}"));
            assert_eq!(p.id.seq, seq);
            assert!(p.latency_ms < 250);
            assert!(parse(&raw(seq, true)).is_err(), "{seq} parsed");
        }
    }

    #[test]
    fn parse_rejects_what_it_should() {
        let mut r = raw(0, false);
        for (line, want) in [
            ("", Malformed::TooShort),
            ("1 INFO", Malformed::TooShort),
            (
                "1 info svc=a status=1 latency_ms=2 path=/",
                Malformed::Level,
            ),
            (
                "1 INFO svc=a status=1 latency_ms=2 path=/ x",
                Malformed::Field,
            ),
            ("1 INFO svc=a svc=b latency_ms=2 path=/", Malformed::Field),
            (
                "1 INFO svc=a status=70000 latency_ms=2 path=/",
                Malformed::Field,
            ),
            ("1 INFO svc=a status=1 latency=2 path=/", Malformed::Field),
        ] {
            r.line = line.into();
            assert_eq!(parse(&r), Err(want), "{line:?}");
        }
        r.line = "1 ERROR path=/x latency_ms=9 status=500 svc=db".into();
        let p = parse(&r).unwrap();
        assert_eq!((p.level, p.status, p.latency_ms), (Level::Error, 500, 9));
        assert_eq!((p.service.as_str(), p.path.as_str()), ("db", "/x"));
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let r = raw(42, false);
        assert_eq!(RawRecord::decode(&r.encode()), Some(r.clone()));
        let bytes = r.encode();
        for cut in 0..bytes.len() {
            assert_eq!(RawRecord::decode(&bytes[..cut]), None, "prefix of {cut}");
        }
        assert_eq!(RawRecord::decode(&[0xff; 64]), None);
    }
}

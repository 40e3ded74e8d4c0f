//! The control protocol: JSON lines over a Unix stream socket (spec: docs/wire.md §17).
//!
//! Every request is one line of JSON, at most [`MAX_REQUEST`] bytes with its newline,
//! carrying the protocol version `v` and an operation `op`; the endpoint answers each with
//! one [`Response`] line (`watch` with a stream of them, the last one with `more: false`).
//! [`parse_request`] is the whole decoder: it never panics, whatever the bytes.

use serde::{Deserialize, Serialize};

/// The protocol version this crate speaks (the `v` of every request and response).
pub const VERSION: u32 = 1;

/// The longest request line the endpoint reads, newline included; a longer one is answered
/// with [`Code::TooLong`] and the connection closed.
pub const MAX_REQUEST: usize = 64 * 1024;

/// The longest response line a [`crate::Client`] reads.
pub const MAX_RESPONSE: usize = 16 << 20;

/// The shortest `watch` interval the endpoint honours, milliseconds (shorter ones are raised).
pub const MIN_WATCH_INTERVAL_MS: u64 = 50;

/// The longest `watch` interval, milliseconds (longer ones are lowered).
pub const MAX_WATCH_INTERVAL_MS: u64 = 60_000;

/// What a request asks for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Op {
    /// The endpoint's version and process; a client sends it first.
    Hello,
    /// Every registered connection and listener.
    Ls,
    /// One entry.
    Show {
        /// The entry's id.
        id: u64,
    },
    /// Switches one entry, or every switchable one, to a branch.
    Switch {
        /// Which entries.
        target: Target,
        /// The branch: a name the entry lists, or its index.
        branch: String,
        /// By two-phase commit with the peer (else unilateral).
        #[serde(default)]
        commit: bool,
    },
    /// Reads every policy (`name` absent), one policy, or sets one (`value` present).
    Policy {
        /// The policy's name.
        #[serde(default)]
        name: Option<String>,
        /// The new value.
        #[serde(default)]
        value: Option<String>,
    },
    /// Streams snapshots of one entry (`id`) or all, every `interval_ms`, `count` times
    /// (forever if absent: until the client goes away).
    Watch {
        /// The entry's id; all entries if absent.
        #[serde(default)]
        id: Option<u64>,
        /// Milliseconds between snapshots (clamped to 50..=60000).
        #[serde(default = "default_interval")]
        interval_ms: u64,
        /// Snapshots to send.
        #[serde(default)]
        count: Option<u64>,
    },
    /// The autopilot: its rules and its decision log (of one entry, if `id` is given; only
    /// the decisions after sequence number `since`, if given).
    Autopilot {
        /// Only decisions about this entry.
        #[serde(default)]
        id: Option<u64>,
        /// Only decisions with a larger sequence number.
        #[serde(default)]
        since: Option<u64>,
    },
}

fn default_interval() -> u64 {
    1000
}

/// The entries a switch applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// Every entry with a switch handle.
    All,
    /// One entry.
    Id(u64),
}

/// One response line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// The endpoint's protocol version.
    pub v: u32,
    /// The answer, or why there is none.
    #[serde(flatten)]
    pub body: Body,
    /// A `watch` stream goes on after this line.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub more: bool,
}

/// A response's answer or error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Body {
    /// The request succeeded.
    Ok(Reply),
    /// It did not.
    Error(Failure),
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The kind of failure.
    pub code: Code,
    /// What happened, for a person.
    pub message: String,
}

/// Failure kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Code {
    /// The endpoint serves its maximum of control clients.
    Busy,
    /// The request is not valid JSON or not a known operation.
    Malformed,
    /// No entry has that id.
    NoSuchEntry,
    /// The entry has no such branch.
    NoSuchBranch,
    /// No policy has that name.
    NoSuchPolicy,
    /// The entry cannot be switched (no switch handle).
    NotSwitchable,
    /// The peer's uid may not use this endpoint.
    PermissionDenied,
    /// The switch was refused or failed; the entry runs where it did.
    SwitchFailed,
    /// The request line is longer than [`MAX_REQUEST`].
    TooLong,
    /// The policy's validator refused the value.
    InvalidValue,
    /// The request's `v` is not [`VERSION`].
    Version,
}

/// A successful answer, by operation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Reply {
    /// To [`Op::Hello`].
    Hello {
        /// The endpoint's protocol version.
        version: u32,
        /// Its process id.
        pid: u32,
        /// The process's name (its application's choice).
        name: String,
    },
    /// To [`Op::Ls`].
    Ls {
        /// The entries, by id.
        entries: Vec<EntryView>,
        /// Entries left off because the answer would have been too long.
        #[serde(default)]
        left_off: usize,
    },
    /// To [`Op::Show`].
    Show {
        /// The entry.
        entry: Box<EntryView>,
    },
    /// To [`Op::Switch`].
    Switch {
        /// One result per entry switched (or tried).
        results: Vec<SwitchResult>,
    },
    /// To [`Op::Policy`].
    Policy {
        /// The policies read, or the one set.
        policies: Vec<PolicyView>,
    },
    /// One snapshot of a [`Op::Watch`] stream.
    Watch {
        /// 0, 1, 2...
        seq: u64,
        /// Milliseconds since the endpoint started.
        at_ms: u64,
        /// The entries watched.
        entries: Vec<EntryView>,
    },
    /// To [`Op::Autopilot`].
    Autopilot {
        /// Whether the process runs an autopilot at all (false: the rest is empty).
        running: bool,
        /// Whether it acts (its `autopilot` policy is `on`).
        enabled: bool,
        /// Its rules.
        #[serde(default)]
        rules: Vec<RuleView>,
        /// Decisions still in its bounded log, oldest first.
        #[serde(default)]
        decisions: Vec<Decision>,
        /// Decisions the log no longer holds (it keeps the latest ones).
        #[serde(default)]
        dropped: u64,
    },
}

/// Whether an entry is a connection or a listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A live connection.
    Connection,
    /// A listener (a server's accepting side, a shard set).
    Listener,
}

/// One registered entry as the endpoint reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EntryView {
    /// Its id, unique in the process.
    pub id: u64,
    /// Connection or listener.
    pub kind: Kind,
    /// The application's name for it.
    pub name: String,
    /// The peer (or the bound address of a listener).
    #[serde(default)]
    pub peer: Option<String>,
    /// The picked stack, top layer first.
    #[serde(default)]
    pub stack: Vec<String>,
    /// What negotiation decided.
    #[serde(default)]
    pub negotiation: Option<Negotiation>,
    /// Switches completed (the reconfiguration epoch); 0 without a switch handle.
    pub epoch: u64,
    /// The branch it runs on, if it is switchable.
    #[serde(default)]
    pub branch: Option<String>,
    /// The branches it can switch to (empty: not switchable).
    #[serde(default)]
    pub branches: Vec<String>,
    /// Whether it can only switch by two-phase commit with its peer.
    #[serde(default)]
    pub commit_only: bool,
    /// Counters per layer.
    #[serde(default)]
    pub counters: Vec<LayerCounters>,
    /// Milliseconds since it was registered.
    pub age_ms: u64,
    /// What the autopilot makes of it, if a rule of the autopilot steers it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autopilot: Option<Steered>,
}

/// An entry as the autopilot sees it (in `show`, `ls` and `watch` answers).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Steered {
    /// The rule that steers it.
    pub rule: String,
    /// The counter's rate over the rule's window, per second (null until the window is
    /// covered).
    pub rate: Option<f64>,
    /// The rule's window, milliseconds.
    pub window_ms: u64,
    /// The latest decision about the entry.
    pub last: Option<Decision>,
}

/// One rule of the autopilot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleView {
    /// Its name; its policy is `autopilot.NAME`.
    pub name: String,
    /// Its text (the policy's value).
    pub spec: String,
    /// Whether it acts.
    pub enabled: bool,
    /// The entries it steers now.
    #[serde(default)]
    pub entries: Vec<u64>,
}

/// What the autopilot decided, or why it did not act.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// The rate crossed a threshold: a switch starts.
    Switch,
    /// The switch succeeded.
    Switched,
    /// The switch failed (`reason` says why); it is tried again after the rule's `retry`.
    Failed,
    /// A switch is due but the entry switched less than `dwell` ago.
    WithinDwell,
    /// The rate says the branch the entry already runs on.
    AlreadyThere,
    /// A switch is due but the last attempt failed less than `retry` ago.
    RetryWait,
    /// The entry switched without the autopilot (an operator): the dwell time restarts.
    External,
    /// The entry has no branch of that name, or no such counter.
    Mismatch,
    /// The autopilot, or this rule, was turned off or on, or the rule changed.
    Policy,
}

/// One record of the autopilot's decision log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// 1, 2, 3... in the order decided.
    pub seq: u64,
    /// Milliseconds since the autopilot started.
    pub at_ms: u64,
    /// The rule.
    pub rule: String,
    /// The entry (null: about the rule or the autopilot as a whole).
    pub entry: Option<u64>,
    /// What was decided.
    pub verdict: Verdict,
    /// The branch the entry ran on.
    #[serde(default)]
    pub from: String,
    /// The branch the rate asks for.
    #[serde(default)]
    pub to: String,
    /// The rate over the window, per second.
    pub rate: Option<f64>,
    /// The rule's thresholds and window at the time.
    pub up: f64,
    /// The lower threshold.
    pub down: f64,
    /// The window, milliseconds.
    pub window_ms: u64,
    /// The dwell time, milliseconds.
    pub dwell_ms: u64,
    /// Why, for a person.
    pub reason: String,
}

/// The outcome of negotiation for one connection.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Negotiation {
    /// `client` or `server`: which end this process is.
    pub role: String,
    /// The branch picks applied to the client's stack.
    pub client_pick: Vec<u8>,
    /// The branch picks applied to the server's stack.
    pub server_pick: Vec<u8>,
    /// The client's picked stack, Chunnel ids top first (empty if this end cannot know).
    pub client_stack: Vec<String>,
    /// The server's picked stack, Chunnel ids top first.
    pub server_stack: Vec<String>,
    /// What happened to a 0-RTT attempt.
    pub zero_rtt: String,
    /// Hellos the client sent (0 on the server).
    pub hellos_sent: u32,
}

/// Named counters of one layer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerCounters {
    /// The layer's name (`reliable`, `shards`, `traffic`...).
    pub layer: String,
    /// Its counters.
    pub counters: Vec<Counter>,
}

impl LayerCounters {
    /// A layer with the given counters.
    pub fn new<'a>(layer: &str, counters: impl IntoIterator<Item = (&'a str, u64)>) -> Self {
        LayerCounters {
            layer: layer.to_owned(),
            counters: counters
                .into_iter()
                .map(|(name, value)| Counter {
                    name: name.to_owned(),
                    value,
                })
                .collect(),
        }
    }
}

/// One named counter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    /// Its name.
    pub name: String,
    /// Its value.
    pub value: u64,
}

/// What a switch of one entry did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchResult {
    /// The entry.
    pub id: u64,
    /// Whether the switch succeeded (or the entry already ran on the branch).
    pub ok: bool,
    /// The branch before.
    pub from: String,
    /// The branch after.
    pub to: String,
    /// Whether the stack changed.
    pub changed: bool,
    /// The epoch after.
    pub epoch: u64,
    /// Details (the handle's report, or why it failed).
    pub message: String,
}

/// One policy value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyView {
    /// Its name.
    pub name: String,
    /// Its value.
    pub value: String,
    /// What it controls.
    pub description: String,
    /// The value before, when the request set it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
}

/// Why a request line could not be read; each maps to a [`Code`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// [`Code::Malformed`] or [`Code::Version`].
    pub code: Code,
    /// What was wrong.
    pub message: String,
}

impl ParseError {
    fn malformed(message: impl Into<String>) -> Self {
        ParseError {
            code: Code::Malformed,
            message: message.into(),
        }
    }
}

/// Decodes one request line (without its newline). The version is checked before the
/// operation, so a request of another version gets [`Code::Version`] even if its operation
/// is unknown here.
pub fn parse_request(line: &[u8]) -> Result<Op, ParseError> {
    if line.len() > MAX_REQUEST {
        return Err(ParseError {
            code: Code::TooLong,
            message: format!("request of {} bytes, at most {MAX_REQUEST}", line.len()),
        });
    }
    let value: serde_json::Value = serde_json::from_slice(line)
        .map_err(|e| ParseError::malformed(format!("not JSON: {e}")))?;
    let serde_json::Value::Object(mut map) = value else {
        return Err(ParseError::malformed("a request is a JSON object"));
    };
    match map.remove("v") {
        None => return Err(ParseError::malformed("no version field \"v\"")),
        Some(v) if v.as_u64() == Some(u64::from(VERSION)) => {}
        Some(v) => {
            return Err(ParseError {
                code: Code::Version,
                message: format!(
                    "request of control protocol version {v}, this endpoint speaks version {VERSION}"
                ),
            });
        }
    }
    let op: Op = serde_json::from_value(serde_json::Value::Object(map.clone()))
        .map_err(|e| ParseError::malformed(format!("not a request: {e}")))?;
    // serde ignores unknown fields of unit variants (`ls`, `hello`): every field sent must be
    // one the operation has.
    if let Ok(serde_json::Value::Object(known)) = serde_json::to_value(&op)
        && let Some(k) = map.keys().find(|k| !known.contains_key(*k))
    {
        return Err(ParseError::malformed(format!("unknown field {k:?}")));
    }
    Ok(op)
}

/// Encodes a request line (with its newline).
pub fn encode_request(op: &Op) -> Vec<u8> {
    let mut v = serde_json::to_value(op).unwrap_or_default();
    if let serde_json::Value::Object(m) = &mut v {
        m.insert("v".into(), VERSION.into());
    }
    let mut line = serde_json::to_vec(&v).unwrap_or_default();
    line.push(b'\n');
    line
}

/// Encodes a response line (with its newline).
pub fn encode_response(r: &Response) -> Vec<u8> {
    // Serializing these types cannot fail (string keys, no non-finite floats).
    let mut line = serde_json::to_vec(r).unwrap_or_default();
    line.push(b'\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let ops = [
            Op::Hello,
            Op::Ls,
            Op::Show { id: 7 },
            Op::Switch {
                target: Target::All,
                branch: "server-side".into(),
                commit: true,
            },
            Op::Switch {
                target: Target::Id(3),
                branch: "1".into(),
                commit: false,
            },
            Op::Policy {
                name: Some("rate".into()),
                value: None,
            },
            Op::Watch {
                id: None,
                interval_ms: 200,
                count: Some(3),
            },
            Op::Autopilot {
                id: Some(3),
                since: Some(10),
            },
            Op::Autopilot {
                id: None,
                since: None,
            },
        ];
        for op in ops {
            let line = encode_request(&op);
            assert_eq!(line.last(), Some(&b'\n'));
            assert_eq!(parse_request(&line[..line.len() - 1]), Ok(op));
        }
    }

    #[test]
    fn wire_text() {
        assert_eq!(
            encode_request(&Op::Show { id: 2 }),
            b"{\"id\":2,\"op\":\"show\",\"v\":1}\n"
        );
        let r = Response {
            v: 1,
            body: Body::Error(Failure {
                code: Code::NoSuchEntry,
                message: "no entry 9".into(),
            }),
            more: false,
        };
        assert_eq!(
            encode_response(&r),
            b"{\"v\":1,\"error\":{\"code\":\"no-such-entry\",\"message\":\"no entry 9\"}}\n"
        );
    }

    #[test]
    fn bad_requests() {
        let code = |s: &str| parse_request(s.as_bytes()).unwrap_err().code;
        assert_eq!(code("{\"v\":2,\"op\":\"frobnicate\"}"), Code::Version);
        assert_eq!(code("{\"v\":\"1\",\"op\":\"ls\"}"), Code::Version);
        assert_eq!(code("{\"op\":\"ls\"}"), Code::Malformed);
        assert_eq!(code("{\"v\":1,\"op\":\"frobnicate\"}"), Code::Malformed);
        assert_eq!(code("{\"v\":1,\"op\":\"show\"}"), Code::Malformed);
        assert_eq!(code("{\"v\":1,\"op\":\"ls\",\"x\":1}"), Code::Malformed);
        assert_eq!(
            code("{\"v\":1,\"op\":\"autopilot\",\"x\":1}"),
            Code::Malformed
        );
        assert_eq!(
            code("{\"v\":1,\"op\":\"autopilot\",\"id\":\"3\"}"),
            Code::Malformed
        );
        assert_eq!(
            code("{\"v\":1,\"op\":\"autopilot\",\"since\":-1}"),
            Code::Malformed
        );
        assert_eq!(code("[1,2]"), Code::Malformed);
        assert_eq!(code("{\"v\":1,\"op\":\"ls\""), Code::Malformed);
        assert_eq!(code(&"[".repeat(10_000)), Code::Malformed);
        assert_eq!(code(&" ".repeat(MAX_REQUEST + 1)), Code::TooLong);
    }
}

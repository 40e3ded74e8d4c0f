//! A rule of the autopilot, as data: which entries, which counter, the thresholds and the
//! branches. Its text form (`key=value` words, a value with spaces in double quotes) is the
//! value of its policy, so an operator reads and changes it with `chunnelctl policy`.

use std::fmt;

/// Where to look and when to switch: "when the rate of `counter` of the entries named
/// `entry`, over `window_ms`, is above `up`, move them to branch `above`; when below `down`,
/// to branch `below`; never two switches of one entry within `dwell_ms`; after a failed
/// switch, try again after `retry_ms`".
///
/// ```
/// use chunnel_ctl::autopilot::Rule;
/// let r: Rule = r#"entry="kv client" counter=kv-client/requests window=2s up=600 down=300
///     dwell=5s above=client-push below=server-side"#.parse().unwrap();
/// assert_eq!(r.up, 600.0);
/// assert_eq!(r.window_ms, 2000);
/// assert_eq!(r.to_string().parse::<Rule>().unwrap(), r);
/// assert!("off".parse::<Rule>().unwrap().to_string() == "off");
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    /// Whether the rule acts (the text `off` is a disabled rule; so is `enabled=false`).
    pub enabled: bool,
    /// The name of the entries it steers (every entry of that name, each on its own).
    pub entry: String,
    /// The counter's layer.
    pub layer: String,
    /// The counter's name (a monotonic count: its rate is what the rule compares).
    pub counter: String,
    /// The window the rate is computed over, milliseconds.
    pub window_ms: u64,
    /// Above this rate (per second), switch to `above`.
    pub up: f64,
    /// Below this rate, switch to `below`. Less than `up`: between the two nothing moves.
    pub down: f64,
    /// The least time between two switches of one entry (by the autopilot or anyone),
    /// milliseconds.
    pub dwell_ms: u64,
    /// After a failed switch, the wait before the next attempt, milliseconds.
    pub retry_ms: u64,
    /// The branch for a rate above `up`.
    pub above: String,
    /// The branch for a rate below `down`.
    pub below: String,
    /// Switch by two-phase commit with the peer (else unilaterally).
    pub commit: bool,
}

impl Rule {
    /// A disabled rule (the text `off`).
    pub fn off() -> Self {
        Rule {
            enabled: false,
            entry: String::new(),
            layer: String::new(),
            counter: String::new(),
            window_ms: 1000,
            up: 0.0,
            down: 0.0,
            dwell_ms: 0,
            retry_ms: 1000,
            above: String::new(),
            below: String::new(),
            commit: false,
        }
    }
}

/// Splits `s` into words at spaces, a double-quoted run being part of one word.
fn words(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut quoted, mut any) = (false, false);
    for c in s.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if quoted {
        return Err("an unclosed double quote".into());
    }
    if any {
        out.push(cur);
    }
    Ok(out)
}

/// Milliseconds: `500`, `500ms` or `2s` (at most a day).
fn millis(key: &str, v: &str) -> Result<u64, String> {
    let (num, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else {
        (v, 1.0)
    };
    match num.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 && x * scale <= 86_400_000.0 => Ok((x * scale) as u64),
        _ => Err(format!(
            "{key}={v:?} is not a duration (milliseconds, or with ms or s, at most a day)"
        )),
    }
}

fn rate(key: &str, v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!(
            "{key}={v:?} is not a rate (a number per second, >= 0)"
        )),
    }
}

impl std::str::FromStr for Rule {
    type Err = String;

    fn from_str(s: &str) -> Result<Rule, String> {
        let words = words(s)?;
        if words.len() == 1 && words[0] == "off" {
            return Ok(Rule::off());
        }
        let mut r = Rule::off();
        r.enabled = true;
        let (mut counter, mut up, mut down) = (false, false, false);
        for w in &words {
            let Some((k, v)) = w.split_once('=') else {
                return Err(format!("{w:?} is not key=value"));
            };
            match k {
                "enabled" => {
                    r.enabled = v
                        .parse()
                        .map_err(|_| format!("enabled={v:?} is not true or false"))?
                }
                "entry" => r.entry = v.to_owned(),
                "counter" => {
                    let Some((l, c)) = v.split_once('/') else {
                        return Err(format!("counter={v:?} is not LAYER/COUNTER"));
                    };
                    (r.layer, r.counter, counter) = (l.to_owned(), c.to_owned(), true);
                }
                "window" => r.window_ms = millis(k, v)?,
                "up" => (r.up, up) = (rate(k, v)?, true),
                "down" => (r.down, down) = (rate(k, v)?, true),
                "dwell" => r.dwell_ms = millis(k, v)?,
                "retry" => r.retry_ms = millis(k, v)?,
                "above" => r.above = v.to_owned(),
                "below" => r.below = v.to_owned(),
                "mode" => {
                    r.commit = match v {
                        "commit" => true,
                        "unilateral" => false,
                        _ => return Err(format!("mode={v:?} is not unilateral or commit")),
                    }
                }
                _ => {
                    return Err(format!(
                        "unknown key {k:?} (keys: entry counter window up down dwell retry above below mode enabled)"
                    ));
                }
            }
        }
        let missing: Vec<&str> = [
            ("entry", !r.entry.is_empty()),
            ("counter", counter),
            ("up", up),
            ("down", down),
            ("above", !r.above.is_empty()),
            ("below", !r.below.is_empty()),
        ]
        .iter()
        .filter(|(_, set)| !set)
        .map(|(k, _)| *k)
        .collect();
        if !missing.is_empty() {
            return Err(format!(
                "missing {} (or the rule `off`)",
                missing.join(", ")
            ));
        }
        if r.down >= r.up {
            return Err(format!(
                "down ({}) must be below up ({}): between the two nothing moves, which is what keeps a rate near one threshold from flapping",
                r.down, r.up
            ));
        }
        if r.above == r.below {
            return Err("above and below name the same branch".into());
        }
        if r.window_ms < 10 {
            return Err(format!(
                "window={} ms is too short (at least 10 ms)",
                r.window_ms
            ));
        }
        Ok(r)
    }
}

fn quote(s: &str) -> String {
    if s.is_empty() || s.chars().any(char::is_whitespace) {
        format!("\"{s}\"")
    } else {
        s.to_owned()
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.enabled && self.entry.is_empty() {
            return f.write_str("off");
        }
        write!(
            f,
            "entry={} counter={}/{} window={}ms up={} down={} dwell={}ms retry={}ms above={} below={} mode={}",
            quote(&self.entry),
            quote(&self.layer),
            quote(&self.counter),
            self.window_ms,
            self.up,
            self.down,
            self.dwell_ms,
            self.retry_ms,
            quote(&self.above),
            quote(&self.below),
            if self.commit { "commit" } else { "unilateral" },
        )?;
        if !self.enabled {
            f.write_str(" enabled=false")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KV: &str = r#"entry="kv client (switchable)" counter=kv-client/requests window=1s up=300 down=150 dwell=2s above=client-push below=server-side"#;

    #[test]
    fn parses_and_prints_back() {
        let r: Rule = KV.parse().unwrap();
        assert!(r.enabled);
        assert_eq!(r.entry, "kv client (switchable)");
        assert_eq!(
            (r.layer.as_str(), r.counter.as_str()),
            ("kv-client", "requests")
        );
        assert_eq!((r.window_ms, r.dwell_ms, r.retry_ms), (1000, 2000, 1000));
        assert_eq!((r.up, r.down), (300.0, 150.0));
        assert!(!r.commit);
        assert_eq!(r.to_string().parse::<Rule>().unwrap(), r);
        let mut off = r.clone();
        off.enabled = false;
        assert!(off.to_string().ends_with("enabled=false"));
        assert_eq!(off.to_string().parse::<Rule>().unwrap(), off);
        assert_eq!("  off ".parse::<Rule>().unwrap(), Rule::off());
    }

    #[test]
    fn refuses_what_would_misbehave() {
        let bad = |s: String, why: &str| {
            let e = s.parse::<Rule>().unwrap_err();
            assert!(e.contains(why), "{s}: {e}");
        };
        bad(KV.replace("down=150", "down=300"), "must be below up");
        bad(KV.replace("down=150", "down=400"), "must be below up");
        bad(
            KV.replace("below=server-side", "below=client-push"),
            "same branch",
        );
        bad(KV.replace("window=1s", "window=1"), "too short");
        bad(KV.replace("window=1s", "window=soon"), "not a duration");
        bad(KV.replace("up=300", "up=-1"), "not a rate");
        bad(KV.replace("up=300", "up=NaN"), "not a rate");
        bad(KV.replace(" above=client-push", ""), "missing above");
        bad(format!("{KV} colour=blue"), "unknown key");
        bad(format!("{KV} mode=maybe"), "not unilateral or commit");
        bad(KV.replace("(switchable)\"", "(switchable)"), "unclosed");
        bad("entry".into(), "not key=value");
    }
}

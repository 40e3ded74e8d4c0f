//! The soak run's time series, `docs/figures/soak.csv`: one row per sample,
//! `t_s,served,errors,lost,switches,restarts,malformed,rss_kb,fds`, the counters cumulative.

use std::path::Path;

use anyhow::{Context, Result, ensure};

/// The columns, in order.
pub(crate) const HEADER: [&str; 9] = [
    "t_s",
    "served",
    "errors",
    "lost",
    "switches",
    "restarts",
    "malformed",
    "rss_kb",
    "fds",
];

/// One sample.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Row {
    pub(crate) t_s: f64,
    pub(crate) served: f64,
    pub(crate) errors: f64,
    pub(crate) lost: f64,
    pub(crate) switches: f64,
    pub(crate) restarts: f64,
    pub(crate) malformed: f64,
    pub(crate) rss_kb: f64,
    pub(crate) fds: f64,
}

/// The whole series, in time order.
#[derive(Debug)]
pub(crate) struct Soak {
    pub(crate) rows: Vec<Row>,
}

/// Reads `path` if it exists.
pub(crate) fn load(path: &Path) -> Result<Option<Soak>> {
    if !path.exists() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text)
        .map(Some)
        .with_context(|| format!("parsing {}", path.display()))
}

pub(crate) fn parse(text: &str) -> Result<Soak> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines
        .next()
        .context("empty file")?
        .split(',')
        .map(str::trim)
        .collect();
    ensure!(
        header == HEADER,
        "header {:?}, expected {:?}",
        header.join(","),
        HEADER.join(",")
    );
    let mut rows = Vec::new();
    for (i, line) in lines.enumerate() {
        let v: Vec<f64> = line
            .split(',')
            .map(|x| x.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("row {}: {line:?}", i + 2))?;
        ensure!(
            v.len() == HEADER.len(),
            "row {}: {} fields, expected {}",
            i + 2,
            v.len(),
            HEADER.len()
        );
        rows.push(Row {
            t_s: v[0],
            served: v[1],
            errors: v[2],
            lost: v[3],
            switches: v[4],
            restarts: v[5],
            malformed: v[6],
            rss_kb: v[7],
            fds: v[8],
        });
    }
    rows.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));
    Ok(Soak { rows })
}

impl Soak {
    /// Requests served per second between consecutive samples, at the later sample's time.
    pub(crate) fn served_per_s(&self) -> Vec<(f64, f64)> {
        self.rows
            .windows(2)
            .filter(|w| w[1].t_s > w[0].t_s)
            .map(|w| {
                (
                    w[1].t_s,
                    (w[1].served - w[0].served) / (w[1].t_s - w[0].t_s),
                )
            })
            .collect()
    }

    pub(crate) fn first(&self) -> Row {
        self.rows.first().copied().unwrap_or_default()
    }

    pub(crate) fn last(&self) -> Row {
        self.rows.last().copied().unwrap_or_default()
    }

    pub(crate) fn duration_s(&self) -> f64 {
        self.last().t_s - self.first().t_s
    }

    /// Largest value of a column over the run.
    pub(crate) fn max(&self, f: impl Fn(&Row) -> f64) -> f64 {
        self.rows.iter().map(f).fold(f64::NAN, f64::max)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_and_rates() {
        let s = super::parse(
            "t_s,served,errors,lost,switches,restarts,malformed,rss_kb,fds\n\
             0,0,0,0,0,0,0,1000,10\n\
             10,5000,1,0,2,0,0,1100,11\n\
             20,15000,1,0,4,0,0,1100,11\n",
        )
        .unwrap();
        assert_eq!(s.rows.len(), 3);
        assert_eq!(s.served_per_s(), vec![(10.0, 500.0), (20.0, 1000.0)]);
        assert_eq!(s.duration_s(), 20.0);
        assert_eq!(s.max(|r| r.rss_kb), 1100.0);
        assert!(super::parse("a,b\n1,2\n").is_err());
    }
}

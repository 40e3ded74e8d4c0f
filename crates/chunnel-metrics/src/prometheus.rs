//! Feature `prometheus`: a Prometheus recorder and its scrape endpoint on an opt-in address.
//!
//! The recorder is `metrics-exporter-prometheus`'s, without its HTTP features (no hyper); the
//! endpoint is a minimal HTTP/1.x responder on tokio: one request per connection, answered
//! with the exposition text (`GET /metrics` or `GET /`), connections served one at a time,
//! each bounded by a timeout and a request-size limit, so a slow or hostile client costs at
//! most [`REQUEST_TIMEOUT`] and [`MAX_REQUEST`] bytes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};
use metrics_util::MetricKindMask;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::Error;

/// How long one scrape connection may take (reading the request and writing the answer).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest request head read; a longer one is answered 431 and closed.
pub const MAX_REQUEST: usize = 8 * 1024;
/// Series not updated for this long leave the exposition (a closed connection's counters),
/// so a long-running server's memory stays bounded by its recent connections. A live connection
/// silent for that long loses its series too: what it counts afterwards reaches its snapshot
/// ([`crate::snapshot()`]) but not the exposition (its handles were registered once). Use
/// `Metered::per_connection(false)` for series shared by a stack's connections.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// The environment variable [`Exporter::install_from_env`] reads: the scrape address
/// (`host:port`); unset, no endpoint.
pub const ENV_ADDR: &str = "CHUNNEL_METRICS_ADDR";
/// How often the recorder's upkeep (idle removal, histogram draining) runs.
const UPKEEP: Duration = Duration::from_secs(5);

/// A recorder not installed globally, and the handle that renders it: give the recorder to
/// [`Metered::with_recorder`](crate::Metered::with_recorder), serve the handle with
/// [`Exporter::serve`].
pub fn recorder() -> (Arc<PrometheusRecorder>, PrometheusHandle) {
    let r = builder().build_recorder();
    let h = r.handle();
    (Arc::new(r), h)
}

/// Bucket bounds (seconds) of every `*_seconds` histogram: 10 us to 10 s, about 3 per decade.
pub const SECONDS_BUCKETS: &[f64] = &[
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

fn builder() -> PrometheusBuilder {
    PrometheusBuilder::new()
        .idle_timeout(MetricKindMask::ALL, Some(IDLE_TIMEOUT))
        // Durations as Prometheus histograms (aggregatable across connections and processes);
        // other distributions stay summaries.
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
        .expect("the bucket list is not empty")
}

/// A scrape endpoint serving one recorder's metrics over HTTP; stopped when dropped.
#[derive(Debug)]
pub struct Exporter {
    handle: PrometheusHandle,
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Exporter {
    /// Installs a Prometheus recorder as the process's global one and serves it on `addr`
    /// (e.g. `127.0.0.1:9464`; port 0 picks a free one, see [`Self::local_addr`]). Call it
    /// inside a tokio runtime, before the connections to meter are built.
    pub async fn install(addr: SocketAddr) -> Result<Exporter, Error> {
        let r = builder().build_recorder();
        let handle = r.handle();
        metrics::set_global_recorder(r).map_err(|_| Error::RecorderInstalled)?;
        Self::serve(handle, addr).await
    }

    /// The opt-in by environment: if [`ENV_ADDR`] (`CHUNNEL_METRICS_ADDR`) is set, installs
    /// the global recorder and serves it there ([`Self::install`]); if it is unset or empty,
    /// nothing is started and `Ok(None)` returned. An unparsable value is an error, not a
    /// silent default.
    pub async fn install_from_env() -> Result<Option<Exporter>, Error> {
        match std::env::var(ENV_ADDR) {
            Ok(v) if !v.trim().is_empty() => {
                let addr = v.trim().parse().map_err(|_| Error::BadAddress {
                    var: ENV_ADDR,
                    value: v.clone(),
                })?;
                Self::install(addr).await.map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Serves an existing recorder's `handle` (from [`recorder`]) on `addr`.
    pub async fn serve(handle: PrometheusHandle, addr: SocketAddr) -> Result<Exporter, Error> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Bind { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| Error::Bind { addr, source })?;
        let h = handle.clone();
        let task = tokio::spawn(async move { serve_loop(listener, h).await });
        Ok(Exporter { handle, addr, task })
    }

    /// The address scrapes go to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The recorder's handle: [`PrometheusHandle::render`] gives the exposition text.
    pub fn handle(&self) -> &PrometheusHandle {
        &self.handle
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_loop(listener: TcpListener, handle: PrometheusHandle) {
    let mut upkeep = tokio::time::interval(UPKEEP);
    loop {
        tokio::select! {
            _ = upkeep.tick() => handle.run_upkeep(),
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    // Out of descriptors and the like: back off a little, go on.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let _ = tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &handle)).await;
            }
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Metrics { head: bool },
    NotFound,
    BadMethod,
    Incomplete,
    TooLarge,
}

/// Parses a request head (never panics on any bytes).
fn parse(buf: &[u8]) -> Request {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() >= MAX_REQUEST {
            Request::TooLarge
        } else {
            Request::Incomplete
        };
    };
    let line = buf[..end].split(|&b| b == b'\r').next().unwrap_or(&[]);
    let mut parts = line.split(|&b| b == b' ');
    let method = parts.next().unwrap_or(&[]);
    let target = parts.next().unwrap_or(&[]);
    let path = target.split(|&b| b == b'?').next().unwrap_or(&[]);
    let head = match method {
        b"GET" => false,
        b"HEAD" => true,
        _ => return Request::BadMethod,
    };
    match path {
        b"/metrics" | b"/" => Request::Metrics { head },
        _ => Request::NotFound,
    }
}

async fn answer(mut s: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut len = 0;
    let req = loop {
        let n = s.read(&mut buf[len..]).await?;
        if n == 0 {
            return Ok(());
        }
        len += n;
        match parse(&buf[..len]) {
            Request::Incomplete => continue,
            r => break r,
        }
    };
    let (status, body, head) = match req {
        Request::Metrics { head } => {
            handle.run_upkeep();
            ("200 OK", handle.render(), head)
        }
        Request::NotFound => ("404 Not Found", "not found: try /metrics\n".into(), false),
        Request::BadMethod => ("405 Method Not Allowed", String::new(), false),
        Request::TooLarge | Request::Incomplete => {
            ("431 Request Header Fields Too Large", String::new(), false)
        }
    };
    let hdr = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(hdr.as_bytes()).await?;
    if !head {
        s.write_all(body.as_bytes()).await?;
    }
    s.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_requests() {
        assert_eq!(
            parse(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Request::Metrics { head: false }
        );
        assert_eq!(
            parse(b"HEAD /?a=b HTTP/1.0\r\n\r\n"),
            Request::Metrics { head: true }
        );
        assert_eq!(parse(b"GET /other HTTP/1.1\r\n\r\n"), Request::NotFound);
        assert_eq!(parse(b"POST /metrics HTTP/1.1\r\n\r\n"), Request::BadMethod);
        assert_eq!(parse(b"GET /metrics HTTP/1.1\r\n"), Request::Incomplete);
        assert_eq!(parse(&[b'a'; MAX_REQUEST]), Request::TooLarge);
        // Arbitrary bytes never panic.
        let _ = parse(b"\r\n\r\n");
        for i in 0..=255u8 {
            let _ = parse(&[i, b'\r', b'\n', b'\r', b'\n', i]);
            let _ = parse(&[i, b' ', i, b' ', b'\r', b'\n', b'\r', b'\n']);
        }
    }
}

//! [`Client`]: the client side of the control protocol (what `chunnelctl` uses).

use std::io;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use crate::Error;
use crate::proto::{Body, Code, MAX_RESPONSE, Op, Reply, Response, VERSION, encode_request};

/// A connection to a control endpoint. Each call sends one request and reads its answer.
#[derive(Debug)]
pub struct Client {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
    buf: Vec<u8>,
    /// What the endpoint said of itself.
    hello: (u32, String),
    /// Longest wait for one answer.
    wait: Duration,
}

impl Client {
    /// Connects to the endpoint at `path` and checks its version (a `hello`).
    pub async fn connect(path: &Path) -> Result<Client, Error> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => Error::NoSocket {
                    path: path.to_owned(),
                },
                io::ErrorKind::PermissionDenied => Error::PermissionDenied {
                    path: path.to_owned(),
                },
                io::ErrorKind::ConnectionRefused => Error::NotListening {
                    path: path.to_owned(),
                },
                _ => Error::Io {
                    what: "connecting to",
                    path: path.to_owned(),
                    source: e,
                },
            })?;
        let (rd, wr) = stream.into_split();
        let mut c = Client {
            rd: BufReader::new(rd),
            wr,
            buf: Vec::new(),
            hello: (0, String::new()),
            wait: Duration::from_secs(60),
        };
        // A refused client finds the refusal waiting, even if its hello no longer gets through.
        let _ = c.send(&Op::Hello).await;
        match c.next().await.map(|(r, _)| r) {
            Ok(Reply::Hello { pid, name, .. }) => c.hello = (pid, name),
            Ok(_) => return Err(Error::Protocol("hello answered with something else".into())),
            Err(Error::Remote {
                code: code @ (Code::PermissionDenied | Code::Busy),
                message,
            }) => return Err(Error::Refused { code, message }),
            Err(e) => return Err(e),
        }
        Ok(c)
    }

    /// The endpoint's process id and name.
    pub fn process(&self) -> (u32, &str) {
        (self.hello.0, &self.hello.1)
    }

    /// Sends `op` and reads its (first) answer; a `watch` goes on with [`Client::next`].
    pub async fn request(&mut self, op: &Op) -> Result<Reply, Error> {
        self.send(op).await?;
        Ok(self.next().await?.0)
    }

    /// Sends `op` without reading the answer.
    pub async fn send(&mut self, op: &Op) -> Result<(), Error> {
        self.wr
            .write_all(&encode_request(op))
            .await
            .map_err(|_| Error::Closed)
    }

    /// Reads the next answer: the reply and whether a stream goes on after it.
    pub async fn next(&mut self) -> Result<(Reply, bool), Error> {
        let r = self.read().await?;
        match r.body {
            Body::Ok(reply) => Ok((reply, r.more)),
            Body::Error(f) if f.code == Code::Version => Err(Error::Version {
                ours: VERSION,
                theirs: r.v,
            }),
            Body::Error(f) => Err(Error::Remote {
                code: f.code,
                message: f.message,
            }),
        }
    }

    async fn read(&mut self) -> Result<Response, Error> {
        self.buf.clear();
        let mut limited = (&mut self.rd).take(MAX_RESPONSE as u64);
        let read = limited.read_until(b'\n', &mut self.buf);
        let n = match tokio::time::timeout(self.wait, read).await {
            Err(_) => return Err(Error::Protocol("no answer within 60 s".into())),
            Ok(Err(_)) => return Err(Error::Closed),
            Ok(Ok(n)) => n,
        };
        if n == 0 {
            return Err(Error::Closed);
        }
        if self.buf.last() != Some(&b'\n') {
            return Err(Error::Protocol(format!(
                "an answer longer than {MAX_RESPONSE} bytes, or cut short"
            )));
        }
        // Check the version before the shape: another version's answers may differ.
        let v: serde_json::Value = serde_json::from_slice(&self.buf)
            .map_err(|e| Error::Protocol(format!("not JSON: {e}")))?;
        match v.get("v").and_then(serde_json::Value::as_u64) {
            Some(v) if v == u64::from(VERSION) => {}
            Some(theirs) => {
                return Err(Error::Version {
                    ours: VERSION,
                    theirs: u32::try_from(theirs).unwrap_or(u32::MAX),
                });
            }
            None => return Err(Error::Protocol("an answer without a version".into())),
        }
        serde_json::from_value(v).map_err(|e| Error::Protocol(e.to_string()))
    }
}

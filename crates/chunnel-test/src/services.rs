//! Real servers for tests and benchmarks (redis-server, etcd): started on free loopback ports,
//! waited for with a bound, stopped by PID when the guard drops.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free loopback TCP port: bound then released, and never handed out twice by this process
/// (the kernel may offer a just-released port again). Another process can still take it before
/// the server binds it; [`Server::start`] then sees the server exit and fails clearly.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A scratch directory removed on drop.
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// A fresh directory under the system temp dir, named after `what` and this process.
    pub fn new(what: &str) -> Scratch {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("chunnel-rdv-{what}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A server process, killed (by PID) and reaped when dropped.
#[derive(Debug)]
pub struct Server {
    /// For messages.
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
    program: String,
    args: Vec<String>,
    ready: SocketAddr,
}

impl Server {
    /// Starts `program args` (stdout and stderr to `log`) and waits until `ready` accepts TCP
    /// connections, at most `timeout`. Panics with a clear message if the program is missing
    /// (the test command installs it: scripts/test-all.sh) or never becomes ready.
    pub fn start(
        name: &str,
        program: &str,
        args: &[String],
        ready: SocketAddr,
        log: PathBuf,
        timeout: Duration,
    ) -> Server {
        let mut s = Server {
            name: name.to_owned(),
            child: None,
            log,
            program: program.to_owned(),
            args: args.to_vec(),
            ready,
        };
        s.restart(timeout);
        s
    }

    /// Starts the process again with the same arguments (after [`Server::stop`]).
    pub fn restart(&mut self, timeout: Duration) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {} (`{}`): {e}. scripts/test-all.sh installs it \
                     (apt-get install redis-server etcd-server etcd-client)",
                    self.name, self.program
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + timeout;
        loop {
            if TcpStream::connect_timeout(&self.ready, Duration::from_millis(200)).is_ok() {
                // Something answers on the port; make sure it is our process (a server that lost
                // the port to another process exits at once) before calling it ready.
                std::thread::sleep(Duration::from_millis(100));
                if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                    panic!(
                        "{} exited ({status}) although {} answers: the port was taken by another \
                         process; log: {}",
                        self.name,
                        self.ready,
                        std::fs::read_to_string(&self.log).unwrap_or_default()
                    );
                }
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "{} exited before it was ready ({status}); log: {}",
                    self.name,
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            if Instant::now() > deadline {
                self.stop();
                panic!(
                    "{} did not accept connections on {} within {timeout:?}; log: {}",
                    self.name,
                    self.ready,
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the process (SIGKILL: a crash, not a clean stop) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The running process's id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A redis-server on a free port, durable as a rendezvous store must be (an append-only file
/// fsynced on every write, in the scratch directory): a restarted server still knows its groups.
pub fn redis(scratch: &Scratch) -> (Server, String) {
    let port = free_port();
    let args: Vec<String> = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--dir",
        scratch.0.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let server = Server::start(
        "redis-server",
        "redis-server",
        &args,
        SocketAddr::from(([127, 0, 0, 1], port)),
        scratch.0.join("redis.log"),
        Duration::from_secs(10),
    );
    (server, format!("redis://127.0.0.1:{port}/"))
}

/// One etcd member's ports.
#[derive(Debug)]
pub struct EtcdPorts {
    /// Client URLs.
    pub client: u16,
    /// Peer (raft) URLs.
    pub peer: u16,
}

/// Starts `n` etcd members forming one cluster on loopback (data under `scratch`), returns the
/// servers and their client endpoints.
pub fn etcd_cluster(scratch: &Scratch, n: usize) -> (Vec<Server>, Vec<String>) {
    let ports: Vec<EtcdPorts> = (0..n)
        .map(|_| EtcdPorts {
            client: free_port(),
            peer: free_port(),
        })
        .collect();
    let initial: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| format!("e{i}=http://127.0.0.1:{}", p.peer))
        .collect();
    let initial = initial.join(",");
    let mut children = Vec::new();
    for (i, p) in ports.iter().enumerate() {
        let data = scratch.0.join(format!("etcd{i}"));
        let args: Vec<String> = vec![
            "--name".into(),
            format!("e{i}"),
            "--data-dir".into(),
            data.to_str().unwrap().into(),
            "--listen-client-urls".into(),
            format!("http://127.0.0.1:{}", p.client),
            "--advertise-client-urls".into(),
            format!("http://127.0.0.1:{}", p.client),
            "--listen-peer-urls".into(),
            format!("http://127.0.0.1:{}", p.peer),
            "--initial-advertise-peer-urls".into(),
            format!("http://127.0.0.1:{}", p.peer),
            "--initial-cluster".into(),
            initial.clone(),
            "--initial-cluster-state".into(),
            "new".into(),
            "--initial-cluster-token".into(),
            format!("chunnel-test-{}", std::process::id()),
        ];
        // Members of a cluster wait for each other: start all, then wait for each.
        children.push((
            format!("etcd e{i}"),
            args,
            SocketAddr::from(([127, 0, 0, 1], p.client)),
            scratch.0.join(format!("etcd{i}.log")),
        ));
    }
    let mut servers = Vec::new();
    let mut pending = Vec::new();
    for (name, args, ready, log) in children {
        // Spawn without waiting so the members can find each other.
        pending.push(std::thread::spawn(move || {
            Server::start(&name, "etcd", &args, ready, log, Duration::from_secs(30))
        }));
    }
    for p in pending {
        servers.push(p.join().expect("etcd member failed to start"));
    }
    let endpoints = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{}", p.client))
        .collect();
    (servers, endpoints)
}

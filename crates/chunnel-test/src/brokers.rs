//! Message brokers for the pub/sub tests and benchmark (nats-server with JetStream,
//! redis-server, Kafka 4.1 in KRaft mode): started on free loopback ports, waited for with a
//! bound, stopped by PID when the [`Server`] guard drops.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::services::{Scratch, Server, free_port};

/// nats-server with JetStream (file store in the scratch directory) on a free port.
pub fn nats(scratch: &Scratch) -> (Server, String) {
    let port = free_port();
    let dir = scratch.0.join("jetstream");
    let args: Vec<String> = [
        "-js",
        "-sd",
        dir.to_str().unwrap(),
        "-a",
        "127.0.0.1",
        "-p",
        &port.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let server = Server::start(
        "nats-server",
        "nats-server",
        &args,
        SocketAddr::from(([127, 0, 0, 1], port)),
        scratch.0.join("nats.log"),
        Duration::from_secs(10),
    );
    (server, format!("127.0.0.1:{port}"))
}

/// redis-server with an append-only file (every acknowledged write survives a SIGKILL).
pub fn redis(scratch: &Scratch) -> (Server, String) {
    crate::services::redis(scratch)
}

/// The Kafka jars: `scripts/kafka/fetch.sh` downloads them once from Maven Central (cached).
pub fn kafka_libs() -> PathBuf {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/kafka/fetch.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed (needs mvn and java: scripts/test-all.sh installs them): {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A single-node Kafka 4.1 (KRaft) on free ports, its log in the scratch directory.
pub fn kafka(scratch: &Scratch) -> (Server, String) {
    let libs = kafka_libs();
    let (port, controller) = (free_port(), free_port());
    let data = scratch.0.join("kafka-data");
    let props = scratch.0.join("server.properties");
    std::fs::write(
        &props,
        format!(
            "process.roles=broker,controller\nnode.id=1\n\
             controller.quorum.voters=1@127.0.0.1:{controller}\n\
             listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{port}\n\
             controller.listener.names=CONTROLLER\n\
             listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT\n\
             inter.broker.listener.name=PLAINTEXT\nlog.dirs={}\nnum.partitions=1\n\
             offsets.topic.replication.factor=1\ntransaction.state.log.replication.factor=1\n\
             transaction.state.log.min.isr=1\nshare.coordinator.state.topic.replication.factor=1\n\
             share.coordinator.state.topic.min.isr=1\ngroup.initial.rebalance.delay.ms=0\n\
             auto.create.topics.enable=false\n",
            data.display()
        ),
    )
    .unwrap();
    let cp = format!("{}/*", libs.display());
    let format = std::process::Command::new("java")
        .args(["-cp", &cp, "kafka.tools.StorageTool", "format", "-t"])
        .arg("MkU3OEVBNTcwNTJENDM2Qg")
        .arg("-c")
        .arg(&props)
        .output()
        .expect("java (scripts/test-all.sh installs default-jre-headless)");
    assert!(
        format.status.success(),
        "kafka storage format failed: {}",
        String::from_utf8_lossy(&format.stderr)
    );
    let args: Vec<String> = vec![
        "-Xms128m".into(),
        "-Xmx512m".into(),
        "-cp".into(),
        cp,
        "kafka.Kafka".into(),
        props.to_str().unwrap().into(),
    ];
    let server = Server::start(
        "kafka",
        "java",
        &args,
        SocketAddr::from(([127, 0, 0, 1], port)),
        scratch.0.join("kafka.log"),
        Duration::from_secs(60),
    );
    (server, format!("127.0.0.1:{port}"))
}

/// The dynamic configs of `topic` on the Kafka broker at `addr` (`host:port`), as Kafka's own
/// `kafka-configs --describe` prints them (e.g. `cleanup.policy=compact`), from the jars
/// [`kafka`] runs. Panics with the tool's output if it fails.
pub fn kafka_topic_configs(addr: &str, topic: &str) -> String {
    let cp = format!("{}/*", kafka_libs().display());
    let out = std::process::Command::new("java")
        .args([
            "-cp",
            &cp,
            "kafka.admin.ConfigCommand",
            "--bootstrap-server",
            addr,
        ])
        .args([
            "--describe",
            "--entity-type",
            "topics",
            "--entity-name",
            topic,
        ])
        .output()
        .expect("java (scripts/test-all.sh installs default-jre-headless)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kafka-configs --describe {topic} failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

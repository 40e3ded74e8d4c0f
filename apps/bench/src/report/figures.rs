//! The figures of `docs/evaluation.md`: for each, the subcommand and arguments that measure it
//! (as the document gives them, and a short run for `--quick`), and what it needs.

use std::time::Duration;

/// What a figure needs beyond this binary.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Need {
    /// Running as root (network namespaces, AF_XDP).
    Root,
    /// This binary built with the `stores` feature (Redis and etcd clients).
    Stores,
    /// This binary built with the `pubsub` feature (Kafka, NATS and Redis clients).
    Pubsub,
    /// A program on `PATH`.
    Program(&'static str),
}

/// One figure: `docs/figures/<name>.json` and the section of the document that shows it.
#[derive(Debug)]
pub(crate) struct Figure {
    pub(crate) name: &'static str,
    /// `taskset -c <cpus>` around the command, as the document pins it.
    pub(crate) taskset: Option<&'static str>,
    /// Arguments of the figure of record.
    pub(crate) args: &'static [&'static str],
    /// Arguments of the short run (`--quick`).
    pub(crate) quick: &'static [&'static str],
    /// About how long the full run takes, seconds.
    pub(crate) expected_secs: u64,
    pub(crate) needs: &'static [Need],
}

impl Figure {
    pub(crate) fn args(&self, quick: bool) -> &'static [&'static str] {
        if quick { self.quick } else { self.args }
    }

    pub(crate) fn expected(&self, quick: bool) -> Duration {
        Duration::from_secs(if quick {
            (self.expected_secs / 6).max(5)
        } else {
            self.expected_secs
        })
    }

    /// The command as a reader types it from the workspace root.
    pub(crate) fn command(&self, quick: bool) -> String {
        let mut s = String::new();
        if let Some(cpus) = self.taskset {
            s.push_str(&format!("taskset -c {cpus} "));
        }
        s.push_str("./target/release/chunnel-bench");
        for a in self.args(quick) {
            s.push(' ');
            s.push_str(a);
        }
        s
    }

    /// The build command the figure needs.
    pub(crate) fn build(&self) -> &'static str {
        if self.needs.iter().any(|n| matches!(n, Need::Stores)) {
            "cargo build --release -p chunnel-bench --features stores"
        } else if self.needs.iter().any(|n| matches!(n, Need::Pubsub)) {
            "cargo build --release -p chunnel-bench --features pubsub"
        } else {
            "cargo build --release -p chunnel-bench"
        }
    }

    pub(crate) fn needs_text(&self) -> String {
        let v: Vec<String> = self
            .needs
            .iter()
            .map(|n| match n {
                Need::Root => "root".to_string(),
                Need::Stores => "--features stores".to_string(),
                Need::Pubsub => "--features pubsub".to_string(),
                Need::Program(p) => format!("`{p}`"),
            })
            .collect();
        if v.is_empty() {
            String::new()
        } else {
            format!("; needs {}", v.join(", "))
        }
    }

    /// Why this machine or this build cannot measure the figure, if it cannot.
    pub(crate) fn missing_need(&self) -> Option<String> {
        let missing: Vec<String> = self
            .needs
            .iter()
            .filter_map(|n| match n {
                // SAFETY: geteuid has no preconditions.
                Need::Root if unsafe { libc::geteuid() } != 0 => Some("needs root".into()),
                Need::Stores if !cfg!(feature = "stores") => Some(
                    "this binary was built without the `stores` feature (Redis and etcd clients)"
                        .into(),
                ),
                Need::Pubsub if !cfg!(feature = "pubsub") => Some(
                    "this binary was built without the `pubsub` feature (broker clients)".into(),
                ),
                Need::Program(p) if !on_path(p) => Some(format!("`{p}` is not installed")),
                _ => None,
            })
            .collect();
        (!missing.is_empty()).then(|| missing.join("; "))
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(program).is_file()))
}

/// Every figure, in the order of the document.
pub(crate) static FIGURES: &[Figure] = &[
    Figure {
        name: "overhead",
        taskset: Some("0"),
        args: &["overhead"],
        quick: &[
            "overhead", "--reps", "1", "--pings", "300", "--millis", "50",
        ],
        expected_secs: 35,
        needs: &[],
    },
    Figure {
        name: "negotiate",
        taskset: Some("0"),
        args: &["negotiate", "--reps", "5", "--conns", "2000"],
        quick: &["negotiate", "--reps", "1", "--conns", "200"],
        expected_secs: 5,
        needs: &[],
    },
    Figure {
        name: "flood",
        taskset: Some("0,1"),
        args: &["negotiate", "--flood", "100000", "--flood-clients", "1000"],
        quick: &["negotiate", "--flood", "2000", "--flood-clients", "50"],
        expected_secs: 12,
        needs: &[],
    },
    Figure {
        name: "flood_slow",
        taskset: Some("0,1"),
        args: &[
            "negotiate",
            "--flood",
            "100000",
            "--flood-clients",
            "1000",
            "--flood-slow",
            "2",
        ],
        quick: &[
            "negotiate",
            "--flood",
            "2000",
            "--flood-clients",
            "50",
            "--flood-slow",
            "1",
        ],
        expected_secs: 12,
        needs: &[],
    },
    Figure {
        name: "reconfig",
        taskset: Some("0"),
        args: &["reconfig"],
        quick: &[
            "reconfig",
            "--reps",
            "1",
            "--millis",
            "30",
            "--pause-reps",
            "1",
            "--messages",
            "4000",
            "--switch-every",
            "500",
            "--no-callgrind",
        ],
        expected_secs: 45,
        needs: &[],
    },
    Figure {
        name: "kv",
        taskset: None,
        args: &["kv"],
        quick: &[
            "kv",
            "--reps",
            "1",
            "--records",
            "500",
            "--loads",
            "2000,4000",
            "--warmup-ms",
            "50",
            "--run-ms",
            "200",
            "--ab-load",
            "2000",
            "--ab-ms",
            "200",
        ],
        expected_secs: 90,
        needs: &[],
    },
    Figure {
        name: "rendezvous",
        taskset: None,
        args: &["rendezvous", "--reps", "20"],
        quick: &[
            "rendezvous",
            "--sizes",
            "1,4",
            "--reps",
            "3",
            "--backends",
            "sqlite,redis,etcd",
        ],
        expected_secs: 60,
        needs: &[
            Need::Stores,
            Need::Program("redis-server"),
            Need::Program("etcd"),
        ],
    },
    Figure {
        name: "etl",
        taskset: None,
        args: &["etl", "--secs", "5"],
        quick: &["etl", "--secs", "2", "--rates", "500,2000"],
        expected_secs: 100,
        needs: &[
            Need::Pubsub,
            Need::Program("nats-server"),
            Need::Program("java"),
            Need::Program("mvn"),
        ],
    },
    Figure {
        name: "pubsub",
        taskset: None,
        args: &["pubsub", "--reps", "5", "--throughput-msgs", "200000"],
        quick: &["pubsub", "--msgs", "200", "--reps", "1"],
        expected_secs: 300,
        needs: &[
            Need::Pubsub,
            Need::Program("redis-server"),
            Need::Program("nats-server"),
            Need::Program("java"),
        ],
    },
    Figure {
        name: "shm",
        taskset: None,
        args: &["shm", "--msgs", "20000", "--size", "64"],
        quick: &["shm", "--msgs", "2000", "--size", "64"],
        expected_secs: 20,
        needs: &[],
    },
    Figure {
        name: "uring",
        taskset: None,
        args: &["uring", "--msgs", "20000", "--size", "64"],
        quick: &["uring", "--msgs", "2000", "--size", "64"],
        expected_secs: 60,
        needs: &[],
    },
    Figure {
        name: "datapaths",
        taskset: None,
        args: &["datapaths"],
        quick: &["datapaths", "--msgs", "2000", "--reps", "2"],
        expected_secs: 95,
        needs: &[],
    },
    Figure {
        name: "xdp",
        taskset: None,
        args: &["xdp", "--msgs", "20000", "--reps", "5"],
        quick: &["xdp", "--msgs", "2000", "--reps", "2"],
        expected_secs: 25,
        needs: &[Need::Root, Need::Program("ip")],
    },
    Figure {
        name: "secure",
        taskset: Some("0"),
        args: &["secure", "--reps", "7", "--conns", "500", "--msgs", "20000"],
        quick: &[
            "secure",
            "--reps",
            "1",
            "--conns",
            "20",
            "--msgs",
            "500",
            "--bulk-mib",
            "4",
        ],
        expected_secs: 35,
        needs: &[],
    },
    Figure {
        name: "sched",
        taskset: Some("0,1"),
        args: &["sched", "--secs", "2", "--reps", "5"],
        quick: &["sched", "--secs", "0.3", "--reps", "1"],
        expected_secs: 45,
        needs: &[],
    },
    Figure {
        name: "sched_heavy",
        taskset: Some("0,1"),
        args: &[
            "sched",
            "--secs",
            "2",
            "--reps",
            "5",
            "--bulk-burst",
            "192",
            "--bulk-every-us",
            "3000",
        ],
        quick: &[
            "sched",
            "--secs",
            "0.3",
            "--reps",
            "1",
            "--bulk-burst",
            "192",
            "--bulk-every-us",
            "3000",
        ],
        expected_secs: 45,
        needs: &[],
    },
];

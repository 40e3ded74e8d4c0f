//! The metric names this workspace records, with their descriptions (one place, so the
//! recording crates and the exporter's users agree).

/// Messages through a [`Metered`](crate::Metered) layer; labels `stack`, `layer`, `direction`
/// (`sent` | `received`), `conn` (unless turned off).
pub const MESSAGES: &str = "chunnel_messages_total";
/// Bytes through a [`Metered`](crate::Metered) layer; same labels as [`MESSAGES`].
pub const BYTES: &str = "chunnel_bytes_total";
/// Committed reconfigurations; labels `stack`, `to` (`left` | `right`), `result` (`ok` |
/// `failed`). Recorded by [`reconfigure`](crate::reconfigure).
pub const SWITCHES: &str = "chunnel_reconfig_switches_total";
/// Seconds a reconfiguration's commit took (every connection moved to the new branch, one
/// after the other): an upper bound of the pause any one connection saw. Label `stack`.
pub const SWITCH_PAUSE: &str = "chunnel_reconfig_switch_pause_seconds";
/// Connections changed by one reconfiguration; label `stack`.
pub const SWITCHED_CONNECTIONS: &str = "chunnel_reconfig_switched_connections";

/// Negotiations that ended (chunnel-negotiate, feature `metrics`); labels `side` (`client` |
/// `server`), `mode` (`1rtt` | `0rtt` on a client, `hello` on a server), `result` (`accepted` | `rejected` | `timeout` | `error`), `zero_rtt`
/// (`not_offered` | `accepted` | `rejected`; `none` when the negotiation failed).
pub const NEGOTIATIONS: &str = "chunnel_negotiations_total";
/// Seconds a negotiation took (client: connect call to connection; server: new base
/// connection to decision and stack built); labels `side`, `mode`, `result`.
pub const HANDSHAKE: &str = "chunnel_negotiation_handshake_seconds";
/// Multilateral (two-phase commit) switches proposed by this end, by outcome (chunnel-negotiate,
/// feature `metrics`); label `outcome` (`switched` | `unchanged` | `contended` | `aborted` |
/// `error`).
pub const MULTILATERAL_SWITCHES: &str = "chunnel_multilateral_switches_total";
/// Seconds from a multilateral proposal to its outcome at the proposer; label `outcome`.
pub const MULTILATERAL_SWITCH: &str = "chunnel_multilateral_switch_seconds";
/// Seconds this end's half of a committed multilateral switch took (building the new
/// implementation, then moving to it at the marker); label `role` (`initiator` | `follower`).
pub const MULTILATERAL_SWITCH_POINT: &str = "chunnel_multilateral_switch_point_seconds";
/// Data frames the reliable Chunnel transmitted again (chunnel-std, feature `metrics`); label
/// `kind` (`timeout` | `fast`).
pub const RETRANSMISSIONS: &str = "chunnel_reliable_retransmissions_total";
/// Datagrams a datagram listener dropped (chunnel-net, feature `metrics`); label `reason`
/// (`oversize` | `queue_full` | `backlog_full` | `peer_cap`).
pub const DATAGRAM_DROPS: &str = "chunnel_datagram_dropped_total";
/// Peers a datagram listener evicted to make room (chunnel-net, feature `metrics`).
pub const DATAGRAM_EVICTIONS: &str = "chunnel_datagram_evicted_total";

/// Describes every metric above to the current recorder (`# HELP` lines). Called where
/// handles are registered (once per connection, switch or listener, never per message); a
/// crate recording these names may call it too.
pub fn describe() {
    {
        metrics::describe_counter!(MESSAGES, "Messages through a metered layer.");
        metrics::describe_counter!(
            BYTES,
            metrics::Unit::Bytes,
            "Bytes through a metered layer."
        );
        metrics::describe_counter!(SWITCHES, "Reconfigurations of a stack.");
        metrics::describe_histogram!(
            SWITCH_PAUSE,
            metrics::Unit::Seconds,
            "Time a reconfiguration's commit took (bounds each connection's pause)."
        );
        metrics::describe_histogram!(
            SWITCHED_CONNECTIONS,
            "Connections moved by one reconfiguration."
        );
        metrics::describe_counter!(NEGOTIATIONS, "Negotiations that ended, by result.");
        metrics::describe_histogram!(
            HANDSHAKE,
            metrics::Unit::Seconds,
            "Time a negotiation took."
        );
        metrics::describe_counter!(
            MULTILATERAL_SWITCHES,
            "Multilateral switches proposed here, by outcome."
        );
        metrics::describe_histogram!(
            MULTILATERAL_SWITCH,
            metrics::Unit::Seconds,
            "Time from a multilateral proposal to its outcome."
        );
        metrics::describe_histogram!(
            MULTILATERAL_SWITCH_POINT,
            metrics::Unit::Seconds,
            "Time this end's half of a committed multilateral switch took."
        );
        metrics::describe_counter!(RETRANSMISSIONS, "Reliable data frames sent again.");
        metrics::describe_counter!(DATAGRAM_DROPS, "Datagrams a listener dropped.");
        metrics::describe_counter!(DATAGRAM_EVICTIONS, "Peers a listener evicted.");
    }
}

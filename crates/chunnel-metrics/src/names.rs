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

/// Describes the metrics to the current recorder (called where handles are registered: once
/// per connection or switch, never per message).
pub(crate) fn describe() {
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
    }
}

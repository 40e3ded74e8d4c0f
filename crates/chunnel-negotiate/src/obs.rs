//! Observation of negotiations and multilateral switches (features `metrics` and `tracing`).
//! With both features off every function here returns its argument or does nothing, so no
//! code is added to any path. It imports only the error and the wire types (the driver and
//! the coordinator pass in how to read their results), so it sits below both.

#[cfg(any(feature = "metrics", feature = "tracing"))]
use std::future::Future;

#[cfg(any(feature = "metrics", feature = "tracing"))]
use crate::Error;
use crate::wire::ZeroRtt;

#[cfg(feature = "metrics")]
use chunnel_metrics::{metrics, names};

/// Which end negotiated.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Side {
    Client,
    Server,
}

#[cfg(any(feature = "metrics", feature = "tracing"))]
impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Server => "server",
        }
    }
}

/// A negotiation's result as a label.
#[cfg(any(feature = "metrics", feature = "tracing"))]
fn result_label(e: &Error) -> &'static str {
    match e {
        Error::Incompatible { .. }
        | Error::Version { .. }
        | Error::Refused { .. }
        | Error::BadHello { .. }
        | Error::HelloTooLarge { .. }
        | Error::OffersTooLarge { .. } => "rejected",
        Error::Timeout { .. } | Error::NoHello(_) => "timeout",
        _ => "error",
    }
}

#[cfg(any(feature = "metrics", feature = "tracing"))]
fn zero_rtt_label(z: ZeroRtt) -> &'static str {
    match z {
        ZeroRtt::NotOffered => "not_offered",
        ZeroRtt::Accepted => "accepted",
        ZeroRtt::Rejected => "rejected",
    }
}

/// `fut` (one negotiation) observed: a span around it, its result and time recorded;
/// `zero_rtt` reads what happened to 0-RTT from a success.
#[cfg(any(feature = "metrics", feature = "tracing"))]
pub(crate) async fn negotiation<F, T>(
    side: Side,
    mode: &'static str,
    zero_rtt: fn(&T) -> ZeroRtt,
    fut: F,
) -> Result<T, Error>
where
    F: Future<Output = Result<T, Error>>,
{
    let start = std::time::Instant::now();
    #[cfg(feature = "tracing")]
    let fut = {
        let span = match side {
            Side::Client => tracing::info_span!("chunnel.connect", mode),
            Side::Server => tracing::info_span!("chunnel.handshake"),
        };
        tracing::Instrument::instrument(fut, span)
    };
    let r = fut.await;
    let took = start.elapsed();
    let (result, zero_rtt) = match &r {
        Ok(n) => ("accepted", zero_rtt_label(zero_rtt(n))),
        Err(e) => (result_label(e), "none"),
    };
    #[cfg(feature = "tracing")]
    match &r {
        Ok(_) => tracing::debug!(
            side = side.label(),
            zero_rtt,
            took_us = took.as_micros() as u64,
            "negotiated"
        ),
        Err(e) => tracing::debug!(side = side.label(), result, error = %e, "negotiation failed"),
    }
    #[cfg(feature = "metrics")]
    {
        names::describe();
        let side = side.label();
        metrics::counter!(names::NEGOTIATIONS, "side" => side, "mode" => mode, "result" => result, "zero_rtt" => zero_rtt)
            .increment(1);
        metrics::histogram!(names::HANDSHAKE, "side" => side, "mode" => mode, "result" => result)
            .record(took.as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (zero_rtt, took, mode);
    r
}

/// Without observation: `fut` itself.
#[cfg(not(any(feature = "metrics", feature = "tracing")))]
#[inline(always)]
pub(crate) fn negotiation<F, T>(
    _side: Side,
    _mode: &'static str,
    _zero_rtt: fn(&T) -> ZeroRtt,
    fut: F,
) -> F {
    fut
}

/// A multilateral switch proposed by this end, observed (span `chunnel.switch`, outcome
/// (named by `outcome`) and time recorded).
#[cfg(any(feature = "metrics", feature = "tracing"))]
pub(crate) async fn switch<F, T>(
    to: chunnel::Side,
    outcome: fn(&T) -> &'static str,
    fut: F,
) -> Result<T, Error>
where
    F: Future<Output = Result<T, Error>>,
{
    let start = std::time::Instant::now();
    #[cfg(feature = "tracing")]
    let fut = tracing::Instrument::instrument(fut, tracing::info_span!("chunnel.switch", to = ?to));
    #[cfg(not(feature = "tracing"))]
    let _ = to;
    let r = fut.await;
    let took = start.elapsed();
    let outcome = match &r {
        Ok(o) => outcome(o),
        Err(_) => "error",
    };
    #[cfg(feature = "tracing")]
    tracing::debug!(
        outcome,
        took_us = took.as_micros() as u64,
        "multilateral switch ended"
    );
    #[cfg(feature = "metrics")]
    {
        names::describe();
        metrics::counter!(names::MULTILATERAL_SWITCHES, "outcome" => outcome).increment(1);
        metrics::histogram!(names::MULTILATERAL_SWITCH, "outcome" => outcome)
            .record(took.as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (outcome, took);
    r
}

/// Without observation: `fut` itself.
#[cfg(not(any(feature = "metrics", feature = "tracing")))]
#[inline(always)]
pub(crate) fn switch<F, T>(_to: chunnel::Side, _outcome: fn(&T) -> &'static str, fut: F) -> F {
    fut
}

/// This end's half of a committed switch (span `chunnel.switch_point`, time recorded).
#[cfg(any(feature = "metrics", feature = "tracing"))]
pub(crate) async fn switch_point<F, T>(initiator: bool, txn: u64, fut: F) -> T
where
    F: Future<Output = T>,
{
    let role = if initiator { "initiator" } else { "follower" };
    let start = std::time::Instant::now();
    #[cfg(feature = "tracing")]
    let fut = tracing::Instrument::instrument(
        fut,
        tracing::info_span!("chunnel.switch_point", role, txn),
    );
    #[cfg(not(feature = "tracing"))]
    let _ = txn;
    let r = fut.await;
    #[cfg(feature = "metrics")]
    {
        names::describe();
        metrics::histogram!(names::MULTILATERAL_SWITCH_POINT, "role" => role)
            .record(start.elapsed().as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (role, start);
    r
}

/// Without observation: `fut` itself.
#[cfg(not(any(feature = "metrics", feature = "tracing")))]
#[inline(always)]
pub(crate) fn switch_point<F>(_initiator: bool, _txn: u64, fut: F) -> F {
    fut
}

/// A two-phase-commit event at this end (a `tracing` event inside the coordinator's span).
#[inline(always)]
pub(crate) fn commit_event<E: std::fmt::Debug>(_e: &E) {
    #[cfg(feature = "tracing")]
    tracing::debug!(event = ?_e, "two-phase commit");
}

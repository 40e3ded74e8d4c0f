//! Reconfiguration with metrics and a trace: [`reconfigure`] wraps
//! [`ReconfigHandle::prepare`] + [`PreparedSwitch::commit`](chunnel::PreparedSwitch::commit).

use std::time::Instant;

use chunnel::{Error, ReconfigHandle, Side};
use tracing::Instrument;

use crate::names;

fn side_label(s: Side) -> &'static str {
    match s {
        Side::Left => "left",
        Side::Right => "right",
    }
}

/// Switches every live connection of `handle` to branch `to`, like
/// [`ReconfigHandle::reconfigure`], and records it: `chunnel_reconfig_switches_total`
/// (`result` `ok` or `failed`), the commit's duration in `chunnel_reconfig_switch_pause_seconds`
/// (building the new branches happens before, while traffic flows; the commit is when
/// connections wait at their gates) and the connections moved in
/// `chunnel_reconfig_switched_connections`, all labelled `stack`. A `tracing` span
/// `chunnel.reconfigure` (fields `stack`, `to`) holds one span per phase, `prepare` and `commit`.
///
/// Returns how many connections changed branch.
///
/// ```
/// # use chunnel::{select, Noop, Side, Layered, Chunnel, Handover, Handoff};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), chunnel::Error> {
/// # let sel = select(chunnel::Identity, chunnel::Identity);
/// # let _ = sel;
/// // `handle` comes from `Select::reconfigurable`:
/// // let (select, handle) = select(a, b).reconfigurable();
/// // let moved = chunnel_metrics::reconfigure(&handle, Side::Right, "kv").await?;
/// # Ok(()) }
/// ```
pub async fn reconfigure(handle: &ReconfigHandle, to: Side, stack: &str) -> Result<usize, Error> {
    let span = tracing::info_span!("chunnel.reconfigure", stack, to = side_label(to));
    let stack_l = stack.to_string();
    async move {
        let prepared = match handle
            .prepare(to)
            .instrument(tracing::info_span!("prepare"))
            .await
        {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "reconfiguration failed: nothing switched");
                names::describe();
                metrics::counter!(names::SWITCHES, "stack" => stack_l, "to" => side_label(to), "result" => "failed")
                    .increment(1);
                return Err(e);
            }
        };
        let t = Instant::now();
        let n = prepared
            .commit()
            .instrument(tracing::info_span!("commit"))
            .await;
        let pause = t.elapsed();
        tracing::info!(switched = n, pause_us = pause.as_micros() as u64, "reconfigured");
        names::describe();
        metrics::counter!(names::SWITCHES, "stack" => stack_l.clone(), "to" => side_label(to), "result" => "ok")
            .increment(1);
        metrics::histogram!(names::SWITCH_PAUSE, "stack" => stack_l.clone()).record(pause.as_secs_f64());
        metrics::histogram!(names::SWITCHED_CONNECTIONS, "stack" => stack_l).record(n as f64);
        Ok(n)
    }
    .instrument(span)
    .await
}

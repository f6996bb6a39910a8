//! The replicas of one worker group (DESIGN §9): who they are (static endpoints, or
//! every address behind a `dns:///` name, resolved again on an interval and when a
//! replica fails), how each is doing (`grpc.health.v1` Watch, and what calls see), and
//! which one takes the next call (the least loaded of the healthy ones).
//!
//! A replica is in one of four states:
//! - `Unknown`: not heard from yet (or its worker does not serve health); usable.
//! - `Serving`: its health stream says SERVING; preferred.
//! - `Draining`: it said NOT_SERVING (a worker sent SIGTERM); no new calls.
//! - `Down`: its connection or health stream failed; ejected until it says SERVING.
//!
//! Calls go to `Serving` replicas, to `Unknown` ones when none is serving, and only
//! when neither is left to `Down` or `Draining` ones (a connection attempt costs
//! little, and a draining worker refuses as not started), so that a health view that
//! lags does not fail calls a replica could take.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use airlock_proto::v1::tool_worker_client::ToolWorkerClient;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tonic::transport::Uri;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::endpoints::{Dialer, EndpointSpec};
use crate::worker_channel::{ORIGIN, WorkerChannel};

/// Largest gRPC message exchanged with a worker.
const MAX_MESSAGE_BYTES: usize = 32 * 1024 * 1024;
/// The health service a worker reports for its tools.
const TOOL_WORKER_SERVICE: &str = "airlock.v1.ToolWorker";
/// How long opening a health stream may take.
const WATCH_OPEN_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause before a failed health stream is opened again, doubling up to the maximum.
const WATCH_RETRY_MIN: Duration = Duration::from_millis(250);
const WATCH_RETRY_MAX: Duration = Duration::from_secs(2);
/// How often a worker without a health service is asked again whether it has one.
const NO_HEALTH_RETRY: Duration = Duration::from_secs(30);
/// Least time between two resolutions that a failure asks for.
const RESOLVE_SPACING: Duration = Duration::from_millis(250);

/// How a replica is doing, as far as this orchestrator knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReplicaState {
    Unknown = 0,
    Serving = 1,
    Draining = 2,
    Down = 3,
}

impl ReplicaState {
    fn from_u8(value: u8) -> Self {
        match value {
            1 => Self::Serving,
            2 => Self::Draining,
            3 => Self::Down,
            _ => Self::Unknown,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Serving => "serving",
            Self::Draining => "draining",
            Self::Down => "down",
        }
    }
}

/// One worker replica: its channel (lazily connecting, self-reconnecting), its state
/// and the calls it runs for this orchestrator now.
pub struct Replica {
    pub endpoint: String,
    channel: WorkerChannel,
    state: AtomicU8,
    in_flight: AtomicUsize,
    watched: AtomicBool,
    /// Ends the health watch when the replica is dropped (it left the resolved set).
    unwatch: CancellationToken,
}

impl Replica {
    pub(crate) fn new(endpoint: String, channel: WorkerChannel) -> Self {
        Self {
            endpoint,
            channel,
            state: AtomicU8::new(ReplicaState::Unknown as u8),
            in_flight: AtomicUsize::new(0),
            watched: AtomicBool::new(false),
            unwatch: CancellationToken::new(),
        }
    }

    /// A client of the replica's health service.
    pub fn health(&self) -> HealthClient<WorkerChannel> {
        HealthClient::with_origin(self.channel.clone(), Uri::from_static(ORIGIN))
    }

    /// Starts `request` on the replica: its stream of events, decoded without tonic's
    /// copy of each message (crate::execute_stream).
    pub async fn execute(
        &self,
        request: tonic::Request<airlock_proto::v1::ExecuteRequest>,
    ) -> Result<crate::execute_stream::ExecuteStream, tonic::Status> {
        crate::execute_stream::open(self.channel.clone(), request, MAX_MESSAGE_BYTES).await
    }

    pub fn client(&self) -> ToolWorkerClient<WorkerChannel> {
        ToolWorkerClient::with_origin(self.channel.clone(), Uri::from_static(ORIGIN))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn state(&self) -> ReplicaState {
        ReplicaState::from_u8(self.state.load(Ordering::Relaxed))
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Records a new state; a change is logged, since ejection and re-admission are
    /// what an operator looks for when calls move between replicas.
    pub fn set_state(&self, state: ReplicaState, why: &str) {
        let before = ReplicaState::from_u8(self.state.swap(state as u8, Ordering::Relaxed));
        if before == state {
            return;
        }
        let (endpoint, from, to) = (&self.endpoint, before.as_str(), state.as_str());
        match state {
            ReplicaState::Down => {
                tracing::warn!(%endpoint, from, to, why, "replica ejected")
            }
            ReplicaState::Serving if before != ReplicaState::Unknown => {
                tracing::info!(%endpoint, from, to, why, "replica re-admitted")
            }
            ReplicaState::Draining => {
                tracing::info!(%endpoint, from, to, why, "replica draining: no new calls")
            }
            _ => tracing::debug!(%endpoint, from, to, why, "replica state"),
        }
    }

    /// Counts a call against this replica until the guard is dropped.
    pub fn start_call(self: &Arc<Self>) -> CallLoad {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        CallLoad(self.clone())
    }

    /// Starts the health watch once.
    fn watch(self: &Arc<Self>) {
        if self.watched.swap(true, Ordering::Relaxed) {
            return;
        }
        let (replica, client, stop) = (Arc::downgrade(self), self.health(), self.unwatch.clone());
        tokio::spawn(watch_health(replica, client, stop));
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.unwatch.cancel();
    }
}

/// A call running on a replica; counted in its load while this lives.
pub struct CallLoad(Arc<Replica>);

impl Drop for CallLoad {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Follows one replica's `grpc.health.v1` Watch stream until the replica is dropped.
/// The stream shares the calls' connection, so a replica whose connection dies (its
/// process killed, or frozen past the keepalive timeout) is ejected at once.
async fn watch_health(
    replica: Weak<Replica>,
    client: HealthClient<WorkerChannel>,
    stop: CancellationToken,
) {
    let set = |state: ReplicaState, why: &str| match replica.upgrade() {
        Some(r) => {
            r.set_state(state, why);
            true
        }
        None => false,
    };
    let mut failures: u32 = 0;
    loop {
        let mut client = client.clone();
        let request = HealthCheckRequest {
            service: TOOL_WORKER_SERVICE.to_owned(),
        };
        let opened = tokio::select! {
            _ = stop.cancelled() => return,
            opened = tokio::time::timeout(WATCH_OPEN_TIMEOUT, client.watch(request)) => opened,
        };
        let mut pause = None;
        let alive = match opened {
            Ok(Ok(response)) => {
                let mut stream = response.into_inner();
                let mut last = ReplicaState::Unknown;
                loop {
                    let message = tokio::select! {
                        _ = stop.cancelled() => return,
                        message = stream.message() => message,
                    };
                    match message {
                        Ok(Some(answer)) => {
                            last = match ServingStatus::try_from(answer.status) {
                                Ok(ServingStatus::Serving) => ReplicaState::Serving,
                                Ok(ServingStatus::NotServing) => ReplicaState::Draining,
                                // A worker that does not report this service: judged
                                // by its calls alone.
                                _ => ReplicaState::Unknown,
                            };
                            if !set(last, "health") {
                                return;
                            }
                            failures = 0;
                        }
                        // A draining worker ends the stream after NOT_SERVING: it stays
                        // draining until it is gone or serves again.
                        Ok(None) if last == ReplicaState::Draining => break true,
                        Ok(None) => break set(ReplicaState::Down, "health stream ended"),
                        Err(status) => {
                            break set(ReplicaState::Down, &format!("health stream: {status}"));
                        }
                    }
                }
            }
            Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => {
                // An external worker without health: usable, judged by its calls.
                if !set(ReplicaState::Unknown, "no health service") {
                    return;
                }
                pause = Some(NO_HEALTH_RETRY);
                true
            }
            Ok(Err(status)) => set(ReplicaState::Down, &format!("health: {status}")),
            Err(_) => set(ReplicaState::Down, "health: no answer"),
        };
        if !alive {
            return;
        }
        let pause = pause.unwrap_or_else(|| {
            failures = failures.saturating_add(1);
            WATCH_RETRY_MIN
                .saturating_mul(1 << failures.min(4))
                .min(WATCH_RETRY_MAX)
        });
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// Whether a failed `Execute` certainly never reached a worker's tool: the connection
/// could not be made, the worker said it did not start the call (it is draining), or
/// the server's GOAWAY said it would not process the stream. Any call may then go to
/// another replica; for anything else the call may have run.
pub fn never_started(status: &tonic::Status) -> bool {
    if status.code() != tonic::Code::Unavailable {
        return false;
    }
    if status
        .metadata()
        .get(airlock_proto::NOT_STARTED_METADATA)
        .is_some()
    {
        return true;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(status);
    while let Some(error) = source {
        if error.downcast_ref::<tonic::ConnectError>().is_some() {
            return true;
        }
        if let Some(h2) = error.downcast_ref::<h2::Error>()
            && h2.is_go_away()
            && h2.is_remote()
            && h2.reason() == Some(h2::Reason::NO_ERROR)
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// Every replica of one group, and how the next call picks one.
pub struct ReplicaSet {
    group: String,
    specs: Vec<EndpointSpec>,
    dialer: Dialer,
    /// The name a worker's certificate must carry, when not the endpoint's host.
    server_name: Option<String>,
    replicas: RwLock<Vec<Arc<Replica>>>,
    /// Breaks ties between equally loaded replicas in turn.
    next: AtomicUsize,
    resolve_interval: Duration,
    resolve_now: Notify,
}

impl ReplicaSet {
    pub fn new(
        group: &str,
        specs: Vec<EndpointSpec>,
        dialer: &Dialer,
        server_name: Option<String>,
        resolve_interval: Duration,
    ) -> Result<Self, crate::endpoints::EndpointError> {
        let replicas = specs
            .iter()
            .filter_map(|spec| dialer.static_replica(spec, server_name.as_deref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            group: group.to_owned(),
            specs,
            dialer: dialer.clone(),
            server_name,
            replicas: RwLock::new(replicas.into_iter().map(Arc::new).collect()),
            next: AtomicUsize::new(0),
            resolve_interval,
            resolve_now: Notify::new(),
        })
    }

    /// Every replica known now.
    pub fn all(&self) -> Vec<Arc<Replica>> {
        match self.replicas.read() {
            Ok(r) => r.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The replica for the next call, not one of `tried`: the least loaded of the
    /// serving ones, else of the unknown ones, else of the rest (see the module doc).
    pub fn choose(&self, tried: &[Arc<Replica>]) -> Option<Arc<Replica>> {
        let replicas = self.all();
        let untried = |r: &&Arc<Replica>| !tried.iter().any(|t| Arc::ptr_eq(t, r));
        let tiers: [&[ReplicaState]; 3] = [
            &[ReplicaState::Serving],
            &[ReplicaState::Unknown],
            &[ReplicaState::Down, ReplicaState::Draining],
        ];
        for tier in tiers {
            // Loads are read once: they change while this runs.
            let candidates: Vec<(&Arc<Replica>, usize)> = replicas
                .iter()
                .filter(untried)
                .filter(|r| tier.contains(&r.state()))
                .map(|r| (r, r.in_flight()))
                .collect();
            let Some(least) = candidates.iter().map(|(_, load)| *load).min() else {
                continue;
            };
            let least: Vec<&Arc<Replica>> = candidates
                .into_iter()
                .filter(|(_, load)| *load == least)
                .map(|(r, _)| r)
                .collect();
            let turn = self.next.fetch_add(1, Ordering::Relaxed) % least.len().max(1);
            if let Some(chosen) = least.get(turn) {
                return Some((*chosen).clone());
            }
        }
        None
    }

    /// Records that `replica`'s connection failed: it is ejected until its health says
    /// SERVING again, and a `dns:///` name is resolved again soon.
    pub fn failed(&self, replica: &Replica, why: &str) {
        if replica.state() != ReplicaState::Draining {
            replica.set_state(ReplicaState::Down, why);
        }
        self.resolve_now.notify_one();
    }

    /// Marks `replica` usable: it answered a call or a probe.
    pub fn answered(&self, replica: &Replica) {
        if replica.state() == ReplicaState::Down {
            replica.set_state(ReplicaState::Unknown, "answered");
        }
    }

    /// Keeps the set current until `stop`: resolves `dns:///` endpoints every
    /// `[dispatch] resolve_interval_ms` and when a replica fails, and watches the
    /// health of every replica.
    pub async fn maintain(&self, stop: CancellationToken) {
        loop {
            self.resolve().await;
            for replica in self.all() {
                replica.watch();
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(self.resolve_interval) => {}
                _ = self.resolve_now.notified() => {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(RESOLVE_SPACING) => {}
                    }
                }
            }
        }
    }

    /// Resolves every `dns:///` endpoint again; a name that does not resolve keeps
    /// the replicas it had (a resolver outage does not empty the group).
    async fn resolve(&self) {
        if !self.specs.iter().any(EndpointSpec::is_dns) {
            return;
        }
        let current = self.all();
        let mut fresh: Vec<Arc<Replica>> = Vec::new();
        for spec in &self.specs {
            let resolved = self
                .dialer
                .resolve(spec, self.server_name.as_deref(), &current)
                .await;
            match resolved {
                Ok(replicas) => fresh.extend(replicas),
                Err(error) => {
                    tracing::warn!(group = %self.group, endpoint = %spec, %error, "cannot resolve worker endpoint; keeping the last known replicas");
                    return;
                }
            }
        }
        // DNS servers rotate the order of their answers (Docker's does, on every query):
        // in endpoint order, an unchanged set reads as unchanged.
        fresh.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        let before: Vec<String> = current.iter().map(|r| r.endpoint.clone()).collect();
        let after: Vec<String> = fresh.iter().map(|r| r.endpoint.clone()).collect();
        if before != after {
            tracing::info!(group = %self.group, replicas = ?after, "worker replicas changed");
        }
        if let Ok(mut replicas) = self.replicas.write() {
            *replicas = fresh;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::unix_channel;

    fn replica(name: &str, state: ReplicaState, load: usize) -> Arc<Replica> {
        let r = Arc::new(Replica::new(
            name.to_owned(),
            unix_channel(format!("/nonexistent/{name}.sock").into()),
        ));
        r.state.store(state as u8, Ordering::Relaxed);
        r.in_flight.store(load, Ordering::Relaxed);
        r
    }

    fn set_of(replicas: Vec<Arc<Replica>>) -> ReplicaSet {
        let set = ReplicaSet::new(
            "fs",
            Vec::new(),
            &Dialer::default(),
            None,
            Duration::from_secs(5),
        )
        .unwrap();
        *set.replicas.write().unwrap() = replicas;
        set
    }

    #[tokio::test]
    async fn the_least_loaded_serving_replica_takes_the_call() {
        let set = set_of(vec![
            replica("a", ReplicaState::Serving, 3),
            replica("b", ReplicaState::Serving, 1),
            replica("c", ReplicaState::Unknown, 0),
            replica("d", ReplicaState::Draining, 0),
            replica("e", ReplicaState::Down, 0),
        ]);
        let first = set.choose(&[]).unwrap();
        assert_eq!(first.endpoint, "b");
        // With b tried, a (serving, busier) comes before c (unknown, idle).
        assert_eq!(
            set.choose(std::slice::from_ref(&first)).unwrap().endpoint,
            "a"
        );
        let serving: Vec<_> = set.all().into_iter().take(2).collect();
        assert_eq!(set.choose(&serving).unwrap().endpoint, "c");
        // Draining and down replicas only when nothing else is left.
        let first_three: Vec<_> = set.all().into_iter().take(3).collect();
        let last = set.choose(&first_three).unwrap().endpoint.clone();
        assert!(last == "d" || last == "e", "{last}");
        assert!(set.choose(&set.all()).is_none());
    }

    #[tokio::test]
    async fn equally_loaded_replicas_take_turns_and_load_is_counted() {
        let set = set_of(vec![
            replica("a", ReplicaState::Serving, 0),
            replica("b", ReplicaState::Serving, 0),
        ]);
        let one = set.choose(&[]).unwrap();
        let two = set.choose(&[]).unwrap();
        assert_ne!(one.endpoint, two.endpoint);
        let held = one.start_call();
        assert_eq!(one.in_flight(), 1);
        for _ in 0..4 {
            assert_eq!(set.choose(&[]).unwrap().endpoint, two.endpoint);
        }
        drop(held);
        assert_eq!(one.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_failed_replica_is_ejected_and_readmitted_when_it_answers() {
        let set = set_of(vec![
            replica("a", ReplicaState::Serving, 0),
            replica("b", ReplicaState::Serving, 5),
        ]);
        let a = set.all()[0].clone();
        set.failed(&a, "connection reset");
        assert_eq!(a.state(), ReplicaState::Down);
        assert_eq!(set.choose(&[]).unwrap().endpoint, "b");
        set.answered(&a);
        assert_eq!(a.state(), ReplicaState::Unknown);
        // A draining replica stays draining when its connection then fails.
        let b = set.all()[1].clone();
        b.set_state(ReplicaState::Draining, "health");
        set.failed(&b, "gone");
        assert_eq!(b.state(), ReplicaState::Draining);
    }

    /// A call to a replica that cannot be connected to certainly never started; one
    /// that failed otherwise may have.
    #[tokio::test]
    async fn only_a_call_that_never_left_counts_as_not_started() {
        let dead = replica("dead", ReplicaState::Unknown, 0);
        let status = dead
            .client()
            .list_tools(airlock_proto::v1::ListToolsRequest {})
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(never_started(&status), "{status:?}");

        let mut refused = tonic::Status::unavailable("the worker is draining");
        refused.metadata_mut().insert(
            airlock_proto::NOT_STARTED_METADATA,
            tonic::metadata::MetadataValue::from_static("true"),
        );
        assert!(never_started(&refused));
        assert!(!never_started(&tonic::Status::unavailable(
            "the worker closed the stream without a result"
        )));
        assert!(!never_started(&tonic::Status::internal("boom")));
    }
}

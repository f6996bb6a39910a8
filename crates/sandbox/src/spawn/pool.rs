//! Pre-built strict sandboxes, each used by one call and then destroyed.
//!
//! Creating the namespaces (the network namespace above all), writing the id maps and
//! mounting the part of the new root that every call shares cost more than everything
//! else a strict sandbox does (docs/decisions.md, "The sandbox's hot path"). A pool
//! keeps `prebuilt` sandboxes that have done exactly that: each is a child cloned into
//! its namespaces and its own cgroup, released by the same handshake as a fresh one,
//! which ran the same [`before_call`](super::child) steps — cgroup, cgroup namespace,
//! hostname, the proxy's listener, the shared root with the host's root still at
//! `/oldroot` — and then waits for its call on a socket.
//!
//! A call takes one entry and sends it the per-call plan ([`super::wire`]): the
//! workspace, the working directory, the rlimits, the `execve`. The entry reads it into
//! a buffer and a pointer array it had before `clone` (it cannot allocate), and runs
//! the same `after_call` steps as a fresh sandbox: the workspace bound, the old root
//! detached, rlimits, descriptors, `no_new_privs`, capabilities, Landlock, seccomp,
//! then init and `execve`. Same barriers, same order, same code, same report.
//!
//! An entry is never reused: it becomes the call's sandbox, which is killed and reaped
//! with its cgroup when the call ends, like a fresh one. A thread refills the pool in
//! the background, once the call that took an entry has started its command (see
//! [`Starting`]); it is the entries' parent (their parent-death signal follows it),
//! and it lives as long as the [`Pool`], whose drop kills and reaps every entry still
//! waiting and removes their cgroups.
//!
//! The call runs in a fresh sandbox instead — never in a weaker one — when none is
//! ready (after waiting for one being built, if no other call waits for it), when the
//! call does not fit the entry's buffer, when the entry does not see the call's
//! workspace as the host does (a volume mounted after the entry was cloned), or when
//! the entry cannot be handed its call. Entries older than [`MAX_AGE`] are replaced:
//! the `/etc` files an entry binds are the host's of when it was built.

use std::collections::VecDeque;
use std::io;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::child;
use super::parent::{self, Child, Origin, Request, Supervision, Timing};
use super::plan::{CallView, ChildPlan, strict_landlock};
use super::wire::{self, CALL_BYTES, CALL_POINTERS};
use super::{
    Call, ParentEnds, child_plan, create_cgroup, pipes, proxy_channel, setup_result, start,
};
use crate::Cancel;
use crate::fds::ChildFds;
use crate::loopback;
use crate::sandbox::{CommandSpec, Factory, OutputSink, RunOutcome, SandboxError};
use crate::step::{AtStep, Failure, Step};
use crate::sys::{self, ZeroedPages};

/// How long an entry waits for a call before it is replaced by a newer one.
pub(super) const MAX_AGE: Duration = Duration::from_secs(60);

/// How long a build may take to report that its entry is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// After a failed build, how long the thread waits before it tries again (calls run in
/// fresh sandboxes meanwhile, whose errors name the cause).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a call waits for the entry being built before it builds its own.
const CLAIM_WAIT: Duration = Duration::from_secs(2);

/// Pre-built strict sandboxes of one factory (see the module documentation).
pub(crate) struct Pool {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("size", &self.shared.size)
            .field("ready", &self.ready())
            .finish()
    }
}

struct Shared {
    factory: Arc<Factory>,
    size: usize,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    ready: VecDeque<Entry>,
    /// The thread is building an entry.
    building: bool,
    /// A call waits for the entry being built.
    claimed: bool,
    /// Calls handed an entry whose command has not started yet (see [`Starting`]).
    starting: usize,
    stopping: bool,
    /// Why the last build failed, for the calls that ran fresh meanwhile.
    last_error: Option<String>,
}

/// One pre-built sandbox: its first process waiting for a call, and the worker's ends
/// of its pipes.
struct Entry {
    child: Child,
    ours: ParentEnds,
    /// The worker's end of the socket the call is sent on.
    channel: OwnedFd,
    /// `network = "proxy"`: the listener the entry opened in its network namespace.
    listener: Option<TcpListener>,
    built: Instant,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Pool {
    /// Starts the thread that keeps `size` entries ready.
    pub(crate) fn start(factory: Arc<Factory>, size: usize) -> Self {
        let shared = Arc::new(Shared {
            factory,
            size,
            state: Mutex::new(State {
                // The first call waits for the first entry rather than build its own.
                building: true,
                ..State::default()
            }),
            changed: Condvar::new(),
        });
        let thread = std::thread::Builder::new()
            .name("airlock-prebuild".into())
            .spawn({
                let shared = shared.clone();
                move || refill(&shared)
            });
        let thread = match thread {
            Ok(thread) => Some(thread),
            Err(e) => {
                // No thread, no entries: every call runs fresh and says why.
                let mut state = lock(&shared.state);
                state.building = false;
                state.stopping = true;
                state.last_error = Some(format!("the pool's thread did not start: {e}"));
                None
            }
        };
        Pool { shared, thread }
    }

    /// Entries ready right now.
    pub(crate) fn ready(&self) -> usize {
        lock(&self.shared.state).ready.len()
    }

    /// Runs the call in a pre-built sandbox: `Ok` with the run's result, or `Err` with
    /// why it must run in a fresh one.
    pub(super) fn run(
        &self,
        sandbox: &Factory,
        call: &Call,
        spec: &CommandSpec,
        sink: &mut dyn OutputSink,
        cancel: &Cancel,
        requested: Instant,
    ) -> Result<Result<RunOutcome, SandboxError>, String> {
        let message = wire::encode(call).map_err(|e| e.to_string())?;
        let (entry, starting) = self.take()?;
        entry.sees(&call.workspace)?;
        let Entry {
            mut child,
            ours,
            channel,
            listener,
            built: _,
        } = entry;
        // SAFETY: `message` is a valid buffer of its length; MSG_NOSIGNAL turns a gone
        // entry into EPIPE instead of a signal.
        let sent = unsafe {
            libc::send(
                channel.as_raw_fd(),
                message.as_ptr().cast(),
                message.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if usize::try_from(sent).ok() != Some(message.len()) {
            // The entry is killed and reaped as `child` drops.
            return Err(format!(
                "the pre-built sandbox could not be handed its call: {}",
                io::Error::last_os_error()
            ));
        }
        drop(channel);
        let started = Instant::now();
        Ok((|| {
            setup_result(&mut child, &ours.error_r)?;
            drop(starting);
            let spawn = requested.elapsed();
            if let Some(listener) = listener {
                sink.proxy_listener(listener);
            }
            let timing = Timing { started, spawn };
            let request = Request {
                sandbox,
                spec,
                cancel,
            };
            let run = Supervision::new(
                request,
                child,
                ours,
                call.report.clone(),
                timing,
                Origin::Prebuilt,
            );
            parent::supervise(run, sink)
        })())
    }

    /// A ready entry; or, when none is, the one being built if no other call waits for
    /// it already.
    fn take(&self) -> Result<(Entry, Starting<'_>), String> {
        let shared = &self.shared;
        let mut state = lock(&shared.state);
        if let Some(entry) = state.ready.pop_front() {
            return Ok((entry, Starting::new(shared, &mut state)));
        }
        if state.building && !state.claimed && !state.stopping {
            state.claimed = true;
            state = shared
                .changed
                .wait_timeout_while(state, CLAIM_WAIT, |s| {
                    s.building && s.ready.is_empty() && !s.stopping
                })
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.claimed = false;
            if let Some(entry) = state.ready.pop_front() {
                return Ok((entry, Starting::new(shared, &mut state)));
            }
        }
        Err(match &state.last_error {
            Some(e) => format!("no pre-built sandbox is ready (the last build failed: {e})"),
            None => "no pre-built sandbox is ready".to_owned(),
        })
    }
}

/// A call between taking its entry and its command's start. While one is, the thread
/// does not start building the entry that replaces it (unless no entry is ready): the
/// build's `clone3` into new namespaces — the mount namespace copied under the
/// namespace lock that the call's own mounts and unmounts take — and its cgroup writes
/// ran beside the call's last confinement steps and slowed them down
/// (docs/decisions.md, "The pool refills once its call has started").
struct Starting<'a> {
    shared: &'a Shared,
}

impl<'a> Starting<'a> {
    /// Counts a call that just took an entry out of `state`, and wakes the thread.
    fn new(shared: &'a Shared, state: &mut State) -> Self {
        state.starting += 1;
        shared.changed.notify_all();
        Starting { shared }
    }
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.shared.state);
        state.starting = state.starting.saturating_sub(1);
        self.shared.changed.notify_all();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        lock(&self.shared.state).stopping = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // Without a thread (it never started), nothing was built; this is a no-op.
        let rest: Vec<Entry> = lock(&self.shared.state).ready.drain(..).collect();
        drop(rest);
    }
}

/// The thread: keeps `size` entries ready, replaces those older than [`MAX_AGE`],
/// and destroys every waiting entry when the pool stops. Entries are killed, reaped
/// and their cgroups removed outside the lock.
fn refill(shared: &Shared) {
    let mut retry_at: Option<Instant> = None;
    loop {
        let mut state = lock(&shared.state);
        let mut retired = Vec::new();
        while state
            .ready
            .front()
            .is_some_and(|e| e.built.elapsed() >= MAX_AGE)
        {
            retired.extend(state.ready.pop_front());
        }
        if state.stopping {
            retired.extend(state.ready.drain(..));
            state.building = false;
            shared.changed.notify_all();
            drop(state);
            drop(retired);
            return;
        }
        if !retired.is_empty() {
            drop(state);
            drop(retired);
            continue;
        }
        let now = Instant::now();
        let retry_due = retry_at.is_none_or(|at| now >= at);
        if builds_now(state.ready.len(), shared.size, state.starting, retry_due) {
            state.building = true;
            drop(state);
            let built = build(&shared.factory);
            let mut state = lock(&shared.state);
            state.building = false;
            match built {
                Ok(entry) => {
                    state.ready.push_back(entry);
                    state.last_error = None;
                    retry_at = None;
                }
                Err(e) => {
                    state.last_error = Some(e.to_string());
                    retry_at = Some(Instant::now() + RETRY_AFTER);
                }
            }
            shared.changed.notify_all();
            continue;
        }
        state.building = false;
        shared.changed.notify_all();
        // Sleep until a call takes an entry, the pool stops, the oldest entry is due,
        // or a failed build may be tried again.
        let mut wake = state
            .ready
            .front()
            .map_or(MAX_AGE, |e| MAX_AGE.saturating_sub(e.built.elapsed()));
        if let Some(at) = retry_at {
            wake = wake.min(at.saturating_duration_since(now));
        }
        let size = state.ready.len();
        let starting = state.starting;
        let _ = shared
            .changed
            .wait_timeout_while(state, wake.max(Duration::from_millis(1)), |s| {
                !s.stopping && s.ready.len() == size && s.starting == starting
            })
            .unwrap_or_else(PoisonError::into_inner);
    }
}

/// Whether the thread builds an entry now: the pool is short of `size`, a failed build
/// is not waiting out its pause, and no call is starting in an entry it took — unless
/// no entry is ready at all, when the next call would otherwise run fresh.
fn builds_now(ready: usize, size: usize, starting: usize, retry_due: bool) -> bool {
    ready < size && retry_due && (starting == 0 || ready == 0)
}

/// Builds one entry: the same preparation, clone and handshake as a fresh sandbox,
/// then waits until the child reports that it is ready for a call.
fn build(sandbox: &Factory) -> Result<Entry, SandboxError> {
    let landlock = strict_landlock(sandbox)?;
    let cgroup = create_cgroup(sandbox)?;
    let (ours, sync_w, theirs) = pipes(None)?;
    let proxy_channel = proxy_channel(sandbox)?;
    let (channel, child_channel) = call_channel()?;
    let plan = child_plan(
        sandbox,
        &theirs,
        cgroup.as_deref(),
        proxy_channel.as_ref().map(|(_, child)| child.as_raw_fd()),
        landlock,
    )?;
    // The buffers the call is read into, mapped before `clone` and never written here:
    // the child writes only its own copy of them (`sys::ZeroedPages`).
    let mut entry_side = EntrySide {
        channel: child_channel.as_raw_fd(),
        buffer: ZeroedPages::new(CALL_BYTES).map_err(SandboxError::Io)?,
        pointers: ZeroedPages::new(CALL_POINTERS).map_err(SandboxError::Io)?,
    };
    let mut child = start(sandbox, cgroup, sync_w, || {
        child::prebuilt_main(&plan, &mut entry_side)
    })?;
    drop(theirs);
    drop(child_channel);
    drop(plan);
    drop(entry_side);

    if !wait_ready(&channel)? {
        // The child stopped at a step before its call: the error pipe names it.
        setup_result(&mut child, &ours.error_r)?;
        return Err(SandboxError::Io(io::Error::other(
            "the pre-built sandbox exited before it was ready",
        )));
    }
    let listener = match proxy_channel {
        Some((ours, _child)) => Some(loopback::receive_listener(&ours)?),
        None => None,
    };
    Ok(Entry {
        child,
        ours,
        channel,
        listener,
        built: Instant::now(),
    })
}

/// The socket pair a call is sent on, one message each way (ready, then the call);
/// the child's end is above 0–2, which it overwrites with its pipes.
fn call_channel() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    sys::seqpacket_pair().map_err(SandboxError::Io)
}

/// Waits for the entry's ready message: `true` when it came, `false` when the child
/// closed the socket (it failed a step, or exited).
fn wait_ready(channel: &OwnedFd) -> Result<bool, SandboxError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(SandboxError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "the pre-built sandbox did not become ready within 10 s",
            )));
        }
        let mut pfd = libc::pollfd {
            fd: channel.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: `pfd` is one valid pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ready == -1 {
            if sys::errno() == libc::EINTR {
                continue;
            }
            return Err(SandboxError::Io(io::Error::last_os_error()));
        }
        if ready == 0 {
            continue;
        }
        let mut byte = [0u8; 1];
        // SAFETY: reading one byte into a valid buffer.
        let n = unsafe { libc::recv(channel.as_raw_fd(), byte.as_mut_ptr().cast(), 1, 0) };
        match n {
            1 => return Ok(true),
            0 => return Ok(false),
            _ if sys::errno() == libc::EINTR => {}
            _ => return Err(SandboxError::Io(io::Error::last_os_error())),
        }
    }
}

impl Entry {
    /// Whether the entry sees the call's workspace as the host does. Its mount
    /// namespace is a copy of the worker's from when it was cloned: a volume mounted
    /// on the workspace since (a per-workspace quota) is not in it, and binding the
    /// directory underneath would be the wrong one.
    fn sees(&self, workspace: &Path) -> Result<(), String> {
        let host = std::fs::metadata(workspace)
            .map_err(|e| format!("the workspace {}: {e}", workspace.display()))?;
        let inside = PathBuf::from(format!("/proc/{}/root/oldroot", self.child.pid))
            .join(workspace.strip_prefix("/").unwrap_or(workspace));
        match std::fs::metadata(&inside) {
            Ok(theirs) if (theirs.dev(), theirs.ino()) == (host.dev(), host.ino()) => Ok(()),
            Ok(_) => Err(format!(
                "the pre-built sandbox does not see the workspace {} as the host does (mounted since it was built)",
                workspace.display()
            )),
            Err(e) => Err(format!(
                "the pre-built sandbox does not see the workspace {}: {e}",
                workspace.display()
            )),
        }
    }
}

/// The child's side of an entry: its end of the socket and the buffers its call is
/// read into, all made before `clone`.
pub(super) struct EntrySide {
    channel: RawFd,
    buffer: ZeroedPages<u8>,
    pointers: ZeroedPages<*const libc::c_char>,
}

impl EntrySide {
    /// Child: after the steps that do not depend on the call, keeps only its own
    /// descriptors (and `landlock`, its prepared ruleset), says it is ready, and waits
    /// for its call (async-signal-safe). End-of-file means the pool let it go: it stops
    /// here, having run nothing.
    pub(super) fn wait_for_call<'a>(
        &'a mut self,
        plan: &ChildPlan<'_>,
        landlock: RawFd,
    ) -> Result<CallView<'a>, Failure> {
        // a. A waiting entry must not hold the worker's other descriptors (its
        //    sockets, other sandboxes' pipes, whose ends would never close).
        keep_only(plan.fds, self.channel, landlock).at(Step::CloseFds)?;
        // b. A recognisable name in `ps` while it waits.
        // SAFETY: prctl with a NUL-terminated string.
        unsafe { libc::prctl(libc::PR_SET_NAME, c"airlock-ready".as_ptr(), 0, 0, 0) };
        // c. Ready.
        // SAFETY: sending one byte from a valid buffer.
        let sent =
            unsafe { libc::send(self.channel, [1u8].as_ptr().cast(), 1, libc::MSG_NOSIGNAL) };
        if sent != 1 {
            return Err(Failure::new(Step::ReceiveCall, sys::errno()));
        }
        // d. The call, one message; MSG_TRUNC reports a longer one's whole length.
        let buffer = self.buffer.as_mut_slice();
        let received = loop {
            // SAFETY: receiving into the buffer mapped before clone, of its length.
            let n = unsafe {
                libc::recv(
                    self.channel,
                    buffer.as_mut_ptr().cast(),
                    buffer.len(),
                    libc::MSG_TRUNC,
                )
            };
            match usize::try_from(n) {
                Ok(0) => return Err(Failure::new(Step::ReceiveCall, libc::EPIPE)),
                Ok(n) if n > buffer.len() => {
                    return Err(Failure::new(Step::ReceiveCall, libc::EMSGSIZE));
                }
                Ok(n) => break n,
                Err(_) if sys::errno() == libc::EINTR => {}
                Err(_) => return Err(Failure::new(Step::ReceiveCall, sys::errno())),
            }
        };
        // SAFETY: closing our end of the socket, once.
        unsafe { libc::close(self.channel) };
        wire::decode(&buffer[..received], self.pointers.as_mut_slice())
            .ok_or(Failure::new(Step::ReceiveCall, libc::EINVAL))
    }
}

/// Closes every descriptor but the entry's own: its stdin, stdout, stderr, error and
/// status pipes, its socket and its prepared Landlock ruleset (async-signal-safe).
fn keep_only(fds: ChildFds, channel: RawFd, landlock: RawFd) -> Result<(), i32> {
    // The worker's stdin, stdout and stderr give way to the entry's own pipes, as
    // `fds::install` will leave them.
    for (source, target) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)] {
        // SAFETY: dup2 takes no pointers.
        sys::check_int(unsafe { libc::dup2(source, target) })?;
    }
    let mut keep = [
        fds.stdin, fds.stdout, fds.stderr, fds.error, fds.status, channel, landlock,
    ];
    keep.sort_unstable();
    let mut from: RawFd = 3;
    for fd in keep {
        if fd > from {
            close_range(from, fd - 1)?;
        }
        from = from.max(fd.saturating_add(1));
    }
    close_range(from, RawFd::MAX)
}

fn close_range(first: RawFd, last: RawFd) -> Result<(), i32> {
    // SAFETY: close_range takes no pointers.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first.cast_unsigned(),
            last.cast_unsigned(),
            0u32,
        )
    };
    sys::check(ret).map(drop)
}

#[cfg(test)]
mod tests {
    use super::builds_now;

    #[test]
    fn the_replacement_waits_until_its_call_has_started_unless_none_is_ready() {
        // (ready, size, starting, retry due) → builds
        let cases = [
            ((1, 2, 0, true), true),
            ((1, 2, 1, true), false),
            ((0, 2, 1, true), true),
            ((0, 2, 2, true), true),
            ((2, 2, 0, true), false),
            ((0, 2, 0, false), false),
            ((1, 2, 1, false), false),
        ];
        for ((ready, size, starting, retry_due), builds) in cases {
            assert_eq!(
                builds_now(ready, size, starting, retry_due),
                builds,
                "ready {ready} of {size}, {starting} starting, retry due {retry_due}"
            );
        }
    }
}

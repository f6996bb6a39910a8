//! The parent: the running child's handle (killed and reaped on every exit path), output
//! capture, and the supervision loop that enforces the wall clock and cancellation.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use super::ParentEnds;
use super::handshake::{self, InitReport};
use super::plan::CallTmp;
use crate::Cancel;
use crate::cgroup::CallCgroup;
use crate::sandbox::{CommandSpec, Factory, OutputSink, RunOutcome, SandboxError, Stream, Usage};
use crate::sys;

/// How long output is still drained after the command exited, for descendants that
/// escaped the kill (only possible in standard mode without a cgroup).
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// How long one wait for a killed child's pidfd lasts before the loop looks again.
const KILLED_WAIT: Duration = Duration::from_secs(1);

/// How often the loop wakes when an event has no descriptor to wake it: a kernel
/// without pidfds, a [`Cancel`] whose eventfd could not be made, a kill just sent.
const FALLBACK_TICK: Duration = Duration::from_millis(20);

/// The running child, killed and reaped on every exit path.
pub(super) struct Child {
    pub(super) pid: libc::pid_t,
    pub(super) strict: bool,
    pub(super) cgroup: Option<Box<dyn CallCgroup>>,
    pub(super) reaped: bool,
}

impl Child {
    /// Ends the sandbox (a timeout, a cancel): kills its cgroup and, in strict mode, its
    /// init, whose pid namespace goes with it. At the standard level init is asked with
    /// `SIGTERM`: it kills everything the command started — wherever that moved, which
    /// only init can find — reports and exits; [`Self::kill_now`] if it does not.
    pub(super) fn kill(&self) {
        if let Some(cgroup) = &self.cgroup {
            let _ = cgroup.kill();
        }
        let signal = if self.strict {
            libc::SIGKILL
        } else {
            libc::SIGTERM
        };
        // SAFETY: kill takes no pointers; the pid is our unreaped child, so it cannot
        // have been recycled.
        unsafe { libc::kill(self.pid, signal) };
    }

    /// Kills the sandbox at once: its cgroup, its init, and (standard mode) init's
    /// process group; a standard command dies with its init. Without a cgroup, what the
    /// command started outlives this: for a sandbox that failed before its command ran,
    /// or an init that did not end when asked.
    pub(super) fn kill_now(&self) {
        if let Some(cgroup) = &self.cgroup {
            let _ = cgroup.kill();
        }
        // SAFETY: kill takes no pointers; the pid is our unreaped child, so it cannot
        // have been recycled.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        if !self.strict {
            // SAFETY: as above; the child made itself a process group leader.
            unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        }
    }

    /// Tears down a strict sandbox whose init has reported (and so is exiting by
    /// itself): reaps init, then removes the cgroup. The kill only makes sure init goes
    /// (a no-op for a process already exiting); reaping first means the cgroup is empty
    /// when it is removed, where removing it while init still exits would poll its
    /// process list, sleeping between rounds.
    pub(super) fn finish_after_report(&mut self) -> Result<(), SandboxError> {
        // SAFETY: kill takes no pointers; the pid is our unreaped child.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        self.reap()?;
        match self.cgroup.take() {
            Some(mut cgroup) => cgroup.remove().map_err(SandboxError::from),
            None => Ok(()),
        }
    }

    /// Blocks until the child exits; returns its wait status and resource usage.
    pub(super) fn reap(&mut self) -> Result<(i32, libc::rusage), SandboxError> {
        let mut status = 0;
        // SAFETY: an all-zero rusage is valid for the kernel to overwrite.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: valid out-pointers; waits for our own child only.
            let ret = unsafe { libc::wait4(self.pid, &mut status, 0, &mut usage) };
            if ret == self.pid {
                self.reaped = true;
                return Ok((status, usage));
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                self.reaped = true;
                return Err(SandboxError::Io(err));
            }
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if !self.reaped {
            self.kill_now();
            let _ = self.reap();
        }
        if let Some(cgroup) = &mut self.cgroup {
            let _ = cgroup.remove();
        }
    }
}

/// Captured output of one stream.
struct Capture {
    fd: Option<OwnedFd>,
    data: Vec<u8>,
    cap: usize,
    truncated: bool,
    stream: Stream,
}

impl Capture {
    /// Reads what is left; whether the stream reached its end (a stream already closed,
    /// or never ours, has).
    fn read_to_end(&mut self, sink: &mut dyn OutputSink) -> bool {
        self.read(sink);
        self.fd.is_none()
    }

    fn new(fd: Option<OwnedFd>, cap: usize, stream: Stream) -> Self {
        Capture {
            fd,
            data: Vec::new(),
            cap,
            truncated: false,
            stream,
        }
    }

    /// Reads what is available; keeps draining past the cap so the child never blocks.
    ///
    /// What is kept is read straight into `data`, which grows as output comes. A
    /// zeroed buffer on the stack (64 KiB, before) was written on every read: each of
    /// its pages, shared copy-on-write with the sandboxes the worker forked since, took
    /// a fault and a page copy — sixteen a call for an `echo`.
    fn read(&mut self, sink: &mut dyn OutputSink) {
        let Some(fd) = self.fd.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        loop {
            let room = self.cap.saturating_sub(self.data.len());
            let n = if room == 0 {
                drain(fd, &mut self.truncated)
            } else {
                let kept_before = self.data.len();
                let n = read_into(fd, &mut self.data, room);
                if self.data.len() > kept_before {
                    sink.chunk(self.stream, &self.data[kept_before..]);
                }
                n
            };
            if n > 0 {
                continue;
            }
            if n == 0 || sys::errno() != libc::EINTR {
                if n == 0 {
                    self.fd = None;
                }
                return;
            }
        }
    }
}

/// Bytes first set aside for a stream's output; `data` doubles from there as it fills.
const FIRST_READ_BYTES: usize = 4096;

/// One `read` of at most `room` bytes appended to `data`; returns what `read` returned.
fn read_into(fd: RawFd, data: &mut Vec<u8>, room: usize) -> isize {
    data.reserve(room.min(FIRST_READ_BYTES));
    let spare = data.spare_capacity_mut();
    let ask = spare.len().min(room);
    // SAFETY: `spare` is writable memory of at least `ask` bytes, owned by `data`.
    let n = unsafe { libc::read(fd, spare.as_mut_ptr().cast(), ask) };
    if let Ok(len @ 1..) = usize::try_from(n) {
        // SAFETY: the kernel wrote `len` (at most `ask`) bytes after the initialised part.
        unsafe { data.set_len(data.len() + len) };
    }
    n
}

/// One `read` past the cap, into a buffer of its own (a frame only a stream over its
/// cap ever has), thrown away; marks the stream truncated when anything came.
#[inline(never)]
fn drain(fd: RawFd, truncated: &mut bool) -> isize {
    let mut buf = [0u8; 16 * 1024];
    // SAFETY: `buf` is a valid writable buffer of its length.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n > 0 {
        *truncated = true;
    }
    n
}

/// What the parent holds once the child runs: its handle, the parent's ends of the
/// pipes, and what the outcome reports.
pub(super) struct Supervision<'a> {
    pub(super) sandbox: &'a Factory,
    pub(super) spec: &'a CommandSpec,
    pub(super) cancel: &'a Cancel,
    pub(super) child: Child,
    pub(super) started: Instant,
    /// How long the sandbox took to reach the command's `exec`.
    pub(super) spawn: Duration,
    pub(super) report: crate::IsolationReport,
    /// Our end of the command's stdin, `None` when the caller holds it (attached).
    pub(super) stdin_w: Option<OwnedFd>,
    /// Our end of the command's stdout, `None` when the caller holds it (attached).
    pub(super) stdout_r: Option<OwnedFd>,
    pub(super) stderr_r: OwnedFd,
    pub(super) status_r: OwnedFd,
    /// Standard mode's per-call `/tmp`, removed when the run ends.
    pub(super) call_tmp: Option<CallTmp>,
    /// Whether the sandbox was pre-built (see `spawn::pool`).
    pub(super) prebuilt: bool,
    /// Why a factory with a pool ran this call in a fresh sandbox.
    pub(super) fallback: Option<String>,
}

/// The call a sandbox runs, as its supervision sees it.
pub(super) struct Request<'a> {
    pub(super) sandbox: &'a Factory,
    pub(super) spec: &'a CommandSpec,
    pub(super) cancel: &'a Cancel,
}

/// Where a sandbox came from, and what that leaves the parent to report or clean up.
pub(super) enum Origin {
    /// Cloned for this call.
    Fresh {
        /// Standard mode's per-call `/tmp`, removed when the run ends.
        call_tmp: Option<CallTmp>,
        /// Why a factory with a pool ran this call in a fresh sandbox.
        fallback: Option<String>,
    },
    /// Taken from the pool (strict mode: no per-call `/tmp`).
    Prebuilt,
}

/// When a sandbox's command started: the wall clock's start, and how long the sandbox
/// took to reach the command's `exec`.
pub(super) struct Timing {
    pub(super) started: Instant,
    pub(super) spawn: Duration,
}

impl<'a> Supervision<'a> {
    /// The supervision of a sandbox whose setup succeeded (its error pipe has told all
    /// it will, and is closed here).
    pub(super) fn new(
        request: Request<'a>,
        child: Child,
        ours: ParentEnds,
        report: crate::IsolationReport,
        timing: Timing,
        origin: Origin,
    ) -> Self {
        let Request {
            sandbox,
            spec,
            cancel,
        } = request;
        let ParentEnds {
            stdin_w,
            stdout_r,
            stderr_r,
            error_r: _,
            status_r,
        } = ours;
        let (call_tmp, prebuilt, fallback) = match origin {
            Origin::Fresh { call_tmp, fallback } => (call_tmp, false, fallback),
            Origin::Prebuilt => (None, true, None),
        };
        Supervision {
            sandbox,
            spec,
            cancel,
            child,
            started: timing.started,
            spawn: timing.spawn,
            report,
            stdin_w,
            stdout_r,
            stderr_r,
            status_r,
            call_tmp,
            prebuilt,
            fallback,
        }
    }
}

/// The parent's loop: feeds stdin, captures output, enforces the wall clock and
/// cancellation, reaps, and cleans up. It sleeps in `poll` until something happens —
/// output, stdin room, the child's exit (pidfd), init's report, a cancel (the
/// [`Cancel`]'s eventfd) or the deadline — and never polls on a timer.
///
/// A strict sandbox whose command has exited is answered for as soon as init's report
/// is in, nothing but init is left in the call's cgroup and the output is at its end:
/// init's exit and the cgroups' removal then happen on the factory's reaper
/// (`spawn::reaper`). Otherwise — a command that left processes behind, no cgroup to
/// look into, a timeout, a cancel — the sandbox is killed, reaped and removed here.
pub(super) fn supervise(
    run: Supervision<'_>,
    sink: &mut dyn OutputSink,
) -> Result<RunOutcome, SandboxError> {
    let Supervision {
        sandbox,
        spec,
        cancel,
        mut child,
        started,
        spawn,
        report,
        stdin_w,
        stdout_r,
        stderr_r,
        status_r,
        call_tmp,
        prebuilt,
        fallback,
    } = run;
    let cap = sandbox.config().output_cap_bytes;
    let deadline = started + spec.timeout;
    for fd in [
        stdin_w.as_ref(),
        stdout_r.as_ref(),
        Some(&stderr_r),
        Some(&status_r),
    ]
    .into_iter()
    .flatten()
    {
        sys::set_nonblocking(fd.as_raw_fd()).map_err(SandboxError::Io)?;
    }
    let mut stdout = Capture::new(stdout_r, cap, Stream::Stdout);
    let mut stderr = Capture::new(Some(stderr_r), cap, Stream::Stderr);
    let mut stdin = stdin_w.filter(|_| !spec.stdin.is_empty());
    let mut stdin_pos = 0usize;
    let pidfd = pidfd_open(child.pid);

    let mut timed_out = false;
    let mut cancelled = false;
    let mut exit: Option<(i32, libc::rusage)> = None;
    let mut drain_deadline = None;
    // Strict mode: init's report, once read (`Some(None)`: init ended without one).
    let mut init_report: Option<Option<InitReport>> = None;
    let mut answered_early = false;
    // When the sandbox was asked to end (a timeout, a cancel), until it is killed at once.
    let mut asked_to_end: Option<Instant> = None;

    loop {
        let now = Instant::now();
        if exit.is_none() && !timed_out && !cancelled {
            if now >= deadline {
                timed_out = true;
                child.kill();
                asked_to_end = Some(now);
            } else if cancel.is_cancelled() {
                cancelled = true;
                child.kill();
                asked_to_end = Some(now);
            }
        }
        // A standard sandbox's init that has not ended a second after it was asked (a
        // process it cannot reap, stuck in the kernel): killed with what is in its group.
        if exit.is_none() && asked_to_end.is_some_and(|at| now >= at + KILLED_WAIT) {
            child.kill_now();
            asked_to_end = None;
        }
        if exit.is_some()
            && (stdout.fd.is_none() && stderr.fd.is_none()
                || drain_deadline.is_some_and(|d| now >= d))
        {
            break;
        }

        let mut pfds: Vec<libc::pollfd> = Vec::with_capacity(6);
        let mut push = |fd: RawFd, events: libc::c_short| {
            pfds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        };
        push(
            stdout.fd.as_ref().map_or(-1, |f| f.as_raw_fd()),
            libc::POLLIN,
        );
        push(
            stderr.fd.as_ref().map_or(-1, |f| f.as_raw_fd()),
            libc::POLLIN,
        );
        push(stdin.as_ref().map_or(-1, |f| f.as_raw_fd()), libc::POLLOUT);
        let watch_exit = exit.is_none();
        push(
            match (&pidfd, watch_exit) {
                (Some(fd), true) => fd.as_raw_fd(),
                _ => -1,
            },
            libc::POLLIN,
        );
        let watch_cancel = exit.is_none() && !timed_out && !cancelled;
        push(
            match (cancel.wake_fd(), watch_cancel) {
                (Some(fd), true) => fd,
                _ => -1,
            },
            libc::POLLIN,
        );
        let watch_report = child.strict && init_report.is_none() && watch_cancel;
        push(
            if watch_report {
                status_r.as_raw_fd()
            } else {
                -1
            },
            libc::POLLIN,
        );
        // Without a pidfd (Linux < 5.3) or an eventfd the exit or the cancel has no
        // descriptor to wake us, and a short tick stands in for it.
        let ticking =
            (watch_exit && pidfd.is_none()) || (watch_cancel && cancel.wake_fd().is_none());
        let until = match (exit.is_some(), drain_deadline) {
            (true, Some(d)) => d,
            // Killed and not yet gone: the pidfd says when (past the deadline, which
            // is behind us now); without one, the tick.
            _ if timed_out || cancelled => match pidfd {
                Some(_) => now + KILLED_WAIT,
                None => now + FALLBACK_TICK,
            },
            _ if ticking => deadline.min(now + FALLBACK_TICK),
            _ => deadline,
        };
        // At most a second per wait: the loop re-checks its deadlines when it wakes.
        let wait_ms =
            libc::c_int::try_from(until.saturating_duration_since(now).as_millis().min(1000))
                .unwrap_or(1000);
        let nfds = libc::nfds_t::try_from(pfds.len()).unwrap_or(0);
        // SAFETY: `pfds` is a valid array of pollfd of the given length.
        let ready = unsafe { libc::poll(pfds.as_mut_ptr(), nfds, wait_ms) };
        if ready == -1 && sys::errno() != libc::EINTR {
            return Err(SandboxError::Io(io::Error::last_os_error()));
        }

        if pfds[0].revents != 0 {
            stdout.read(sink);
        }
        if pfds[1].revents != 0 {
            stderr.read(sink);
        }
        if pfds[2].revents != 0
            && let Some(fd) = &stdin
        {
            let rest = &spec.stdin[stdin_pos..];
            // SAFETY: `rest` is a valid readable slice.
            let n = unsafe { libc::write(fd.as_raw_fd(), rest.as_ptr().cast(), rest.len()) };
            if let Ok(written) = usize::try_from(n) {
                stdin_pos += written;
            }
            // Done, or the child closed its stdin (EPIPE; Rust ignores SIGPIPE).
            if stdin_pos >= spec.stdin.len()
                || (n == -1 && !matches!(sys::errno(), libc::EAGAIN | libc::EINTR))
            {
                stdin = None;
            }
        }
        let exited = if watch_exit {
            match &pidfd {
                Some(_) => pfds[3].revents != 0,
                None => has_exited(child.pid),
            }
        } else {
            false
        };
        if watch_report && pfds[5].revents != 0 {
            let reported = handshake::read_status(&status_r);
            init_report = Some(reported);
            if reported.is_some()
                && only_init_left(&child)
                && stdout.read_to_end(sink)
                && stderr.read_to_end(sink)
            {
                answered_early = true;
                break;
            }
        }
        if exited {
            // Init has ended: kill whatever is left, then reap. A standard init killed
            // everything its command started before it ended, unless it was killed
            // itself; its process group is killed too, for that case: init is not
            // reaped yet, so its pid, the group's id, cannot be recycled.
            if let Some(cgroup) = &child.cgroup {
                let _ = cgroup.kill();
            }
            if !child.strict {
                // SAFETY: kill takes no pointers; the group is our unreaped child's.
                unsafe { libc::kill(-child.pid, libc::SIGKILL) };
            }
            exit = Some(child.reap()?);
            drain_deadline = Some(Instant::now() + DRAIN_GRACE);
            stdin = None;
        }
    }
    let duration = started.elapsed();
    let ended = match (exit, init_report) {
        (_, Some(Some(report))) if answered_early => report,
        // The command's own status: reported by init in strict mode, else the child's;
        // the resource use is init's, which includes every process it reaped.
        (Some((init_status, rusage)), report) => {
            let reported = report.unwrap_or_else(|| handshake::read_status(&status_r));
            InitReport {
                status: reported.map_or(init_status, |r| r.status),
                ..InitReport::from_rusage(init_status, &rusage)
            }
        }
        (None, _) => {
            return Err(SandboxError::Io(io::Error::other(
                "the sandbox was not reaped",
            )));
        }
    };
    let status = ended.status;
    let (exit_code, signal) = if libc::WIFEXITED(status) {
        (Some(libc::WEXITSTATUS(status)), None)
    } else if libc::WIFSIGNALED(status) {
        (None, Some(libc::WTERMSIG(status)))
    } else {
        (None, None)
    };

    let cg_peak = child.cgroup.as_ref().and_then(|c| c.peak_memory_bytes());
    let cg_cpu = child.cgroup.as_ref().and_then(|c| c.cpu_usage_us());
    if answered_early {
        if let Err(mut child) = sandbox.reaper().hand_over(child) {
            // The reaper's queue is full: this call tears its sandbox down itself.
            child.finish_after_report()?;
        }
    } else if let Some(mut cgroup) = child.cgroup.take() {
        cgroup.remove()?;
    }
    drop(call_tmp);

    let usage = Usage {
        cpu_user_ms: cg_cpu.map_or(ended.user_us, |(u, _)| u) / 1000,
        cpu_system_ms: cg_cpu.map_or(ended.system_us, |(_, s)| s) / 1000,
        peak_memory_bytes: cg_peak.unwrap_or(ended.max_rss_kib.saturating_mul(1024)),
    };
    Ok(RunOutcome {
        exit_code,
        signal,
        stdout: stdout.data,
        stderr: stderr.data,
        stdout_truncated: stdout.truncated,
        stderr_truncated: stderr.truncated,
        timed_out,
        cancelled,
        duration,
        spawn,
        prebuilt,
        fallback,
        usage,
        isolation: report,
    })
}

/// Whether nothing but the sandbox's init is left in its cgroup (or nothing at all):
/// then no process of the command can write output, fork or use the host any more.
/// Without a cgroup to look into, the answer is no.
fn only_init_left(child: &Child) -> bool {
    child.cgroup.as_ref().is_some_and(|cgroup| {
        cgroup
            .processes()
            .is_ok_and(|pids| pids.iter().all(|&pid| pid == child.pid))
    })
}

/// A pidfd for our child (Linux 5.3+), to poll for its exit.
pub(super) fn pidfd_open(pid: libc::pid_t) -> Option<OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes no pointers.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
    let fd = RawFd::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: on success the descriptor is new and owned by nobody else.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Without pidfds: whether the child has exited, without reaping it.
fn has_exited(pid: libc::pid_t) -> bool {
    // SAFETY: an all-zero siginfo is valid for the kernel to overwrite.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; WNOWAIT leaves the child reapable.
    let ret = unsafe {
        libc::waitid(
            libc::P_PID,
            libc::id_t::try_from(pid).unwrap_or(0),
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    // SAFETY: si_pid is valid to read for SIGCHLD-type siginfo (zero when none).
    ret == 0 && unsafe { info.si_pid() } != 0
}

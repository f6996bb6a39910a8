//! The named steps of the child-side confinement sequence, and how a failed step travels
//! back to the parent.
//!
//! Between `clone` and `execve` the child cannot allocate, so a failure is two integers —
//! the step and the errno — written to a close-on-exec pipe. The parent reads end-of-file
//! when `execve` succeeded (the pipe closed with the exec), or these eight bytes when a
//! step failed; then it refuses the run with an error naming the step. The child never
//! execs with a layer missing.

/// One step of the child-side sequence (see `spawn::child_main`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Step {
    WaitForParent = 1,
    JoinCgroup,
    ParentDeathSignal,
    NewSession,
    CgroupNamespace,
    Hostname,
    MakeMountsPrivate,
    MountRootTmpfs,
    PivotRoot,
    BindSystemDir,
    SystemSymlink,
    MinimalEtc,
    BindWorkspace,
    MountTmp,
    MountProc,
    ProcSysReadOnly,
    MinimalDev,
    DetachOldRoot,
    RootReadOnly,
    ChangeDirectory,
    Rlimits,
    StandardStreams,
    CloseFds,
    NoNewPrivs,
    DropCapabilities,
    Landlock,
    Seccomp,
    Exec,
    /// Appended, so the numbers of the others stay as they were on the wire.
    NotDumpable,
    LoopbackUp,
    ProxyListener,
    ReceiveCall,
    SignalDefaults,
    Subreaper,
    CommandGroup,
}

const ALL: [Step; 35] = [
    Step::WaitForParent,
    Step::JoinCgroup,
    Step::ParentDeathSignal,
    Step::NewSession,
    Step::CgroupNamespace,
    Step::Hostname,
    Step::MakeMountsPrivate,
    Step::MountRootTmpfs,
    Step::PivotRoot,
    Step::BindSystemDir,
    Step::SystemSymlink,
    Step::MinimalEtc,
    Step::BindWorkspace,
    Step::MountTmp,
    Step::MountProc,
    Step::ProcSysReadOnly,
    Step::MinimalDev,
    Step::DetachOldRoot,
    Step::RootReadOnly,
    Step::ChangeDirectory,
    Step::Rlimits,
    Step::StandardStreams,
    Step::CloseFds,
    Step::NoNewPrivs,
    Step::DropCapabilities,
    Step::Landlock,
    Step::Seccomp,
    Step::Exec,
    Step::NotDumpable,
    Step::LoopbackUp,
    Step::ProxyListener,
    Step::ReceiveCall,
    Step::SignalDefaults,
    Step::Subreaper,
    Step::CommandGroup,
];

impl Step {
    /// What the step does, for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            Step::WaitForParent => "wait for the parent (id maps, cgroup)",
            Step::JoinCgroup => "join the call's cgroup",
            Step::ParentDeathSignal => "set the parent-death signal",
            Step::NewSession => "start a new session",
            Step::CgroupNamespace => "enter a cgroup namespace",
            Step::Hostname => "set the hostname",
            Step::MakeMountsPrivate => "make mounts private",
            Step::MountRootTmpfs => "mount the new root tmpfs",
            Step::PivotRoot => "pivot_root into the new root",
            Step::BindSystemDir => "bind a system directory read-only",
            Step::SystemSymlink => "create a merged-usr symlink",
            Step::MinimalEtc => "write the minimal /etc",
            Step::BindWorkspace => "bind the workspace at /workspace",
            Step::MountTmp => "mount the size-limited /tmp",
            Step::MountProc => "mount a fresh /proc",
            Step::ProcSysReadOnly => "make /proc/sys read-only",
            Step::MinimalDev => "populate the minimal /dev",
            Step::DetachOldRoot => "detach the old root",
            Step::RootReadOnly => "remount the new root read-only",
            Step::ChangeDirectory => "change to the working directory",
            Step::Rlimits => "set rlimits",
            Step::StandardStreams => "set up stdin, stdout and stderr",
            Step::CloseFds => "close inherited file descriptors",
            Step::NoNewPrivs => "set no_new_privs",
            Step::DropCapabilities => "drop capabilities",
            Step::Landlock => "apply the Landlock ruleset",
            Step::Seccomp => "install the seccomp filter",
            Step::Exec => "execute the command",
            Step::NotDumpable => "make the sandbox's first process non-dumpable",
            Step::LoopbackUp => "bring up the sandbox's loopback interface",
            Step::ProxyListener => "open the egress proxy's listener and hand it to the worker",
            Step::ReceiveCall => "receive the call in a pre-built sandbox",
            Step::SignalDefaults => "reset signal dispositions and the signal mask",
            Step::CommandGroup => "give the command a process group of its own",
            Step::Subreaper => {
                "make the sandbox's init the subreaper of its command and open its list of \
                 children (/proc/thread-self/children, CONFIG_PROC_CHILDREN)"
            }
        }
    }

    fn from_u32(v: u32) -> Option<Step> {
        ALL.iter().copied().find(|s| *s as u32 == v)
    }
}

/// A failed step and its errno: what crosses the error pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Failure {
    pub step: Step,
    pub errno: i32,
}

impl Failure {
    pub(crate) fn new(step: Step, errno: i32) -> Self {
        Failure { step, errno }
    }

    pub(crate) fn encode(self) -> [u8; 8] {
        let mut out = [0u8; 8];
        out[..4].copy_from_slice(&(self.step as u32).to_ne_bytes());
        out[4..].copy_from_slice(&self.errno.to_ne_bytes());
        out
    }

    pub(crate) fn decode(bytes: [u8; 8]) -> Option<Self> {
        let step = u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let errno = i32::from_ne_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        Some(Failure {
            step: Step::from_u32(step)?,
            errno,
        })
    }
}

/// Attaches a step to an errno result.
pub(crate) trait AtStep<T> {
    fn at(self, step: Step) -> Result<T, Failure>;
}

impl<T> AtStep<T> for Result<T, i32> {
    fn at(self, step: Step) -> Result<T, Failure> {
        self.map_err(|errno| Failure::new(step, errno))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_round_trips() {
        for step in ALL {
            let f = Failure::new(step, libc::EPERM);
            assert_eq!(Failure::decode(f.encode()), Some(f));
        }
    }
}

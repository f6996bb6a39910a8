//! The `[sandbox]` section of `airlock.toml`.

use std::path::PathBuf;

use airlock_policy::IsolationLevel;
use airlock_sandbox::{Network, SandboxConfig};
use serde::Deserialize;

/// Sandbox limits and shell defaults. Every key has the default DESIGN.md pins.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShellConfig {
    /// Root of the workspaces; set by the binary from the data dir.
    #[serde(skip)]
    pub workspaces_root: PathBuf,
    /// `strict` (every layer) or `standard` (no namespaces, for unprivileged containers).
    pub min_isolation: IsolationLevel,
    pub memory_bytes: u64,
    pub pids: u64,
    /// CPUs (1.0 = one CPU).
    pub cpu: f64,
    pub tmp_bytes: u64,
    pub fsize_bytes: u64,
    pub nofile: u64,
    /// Captured output per stream.
    pub output_bytes: usize,
    /// Output per stream the model sees in the result (the rest is flagged truncated).
    pub model_output_bytes: usize,
    /// Default and maximum `timeout_seconds`.
    pub timeout_seconds: u64,
    pub max_timeout_seconds: u64,
    /// The sandboxes' network (DESIGN §12): `"none"` (default; `false` means the same),
    /// `"proxy"` (only the egress proxy, under `[sandbox.egress]`), or `"host"` (the
    /// worker's whole network, no egress rules). `true` is refused: it could mean either
    /// of the last two, and one of them has no rules at all.
    #[serde(deserialize_with = "network_setting")]
    pub network: Network,
    /// `[sandbox.egress]`: what a `network = "proxy"` sandbox may reach (DESIGN §12).
    pub egress: crate::egress::EgressConfig,
    /// Environment variable names a call may set.
    pub allowed_env: Vec<String>,
    /// Parent cgroup of the sandboxes: a name under the worker's own cgroup, or a path
    /// from the root of each hierarchy (`/…`, a delegated subtree).
    pub cgroup_parent: String,
    /// Sandboxes that run at once (default: twice the CPUs); more wait inside their
    /// deadline.
    pub max_concurrent: usize,
    /// Strict sandboxes kept pre-built, each used by one call and then destroyed (their
    /// namespaces, id maps and shared root made before the call); `0` builds each
    /// sandbox when its call comes.
    pub prebuilt: usize,
    /// The kernel-enforced size of each workspace (DESIGN §16): bytes and inodes of the
    /// file system mounted for it. Both `0`: no per-workspace quota.
    pub workspace_bytes: u64,
    pub workspace_inodes: u64,
    /// The broker that mounts those file systems; set by the binary when the quota is on.
    #[serde(skip)]
    pub volumes: Option<airlock_worker::volumes::VolumeClient>,
    /// Where sandbox start-up times and kills are counted; set by the binary.
    #[serde(skip)]
    pub metrics: crate::metrics::SandboxMetrics,
    /// Run at exactly this level instead of the strongest the host offers (set by
    /// `airlock sandbox run --profile`).
    #[serde(skip)]
    pub force_level: Option<IsolationLevel>,
}

impl Default for ShellConfig {
    fn default() -> Self {
        Self {
            workspaces_root: PathBuf::from("/var/lib/airlock/workspaces"),
            min_isolation: IsolationLevel::Strict,
            memory_bytes: 512 << 20,
            pids: 256,
            cpu: 1.0,
            tmp_bytes: 64 << 20,
            fsize_bytes: 1 << 30,
            nofile: 1024,
            output_bytes: 1 << 20,
            model_output_bytes: 64 << 10,
            timeout_seconds: 30,
            max_timeout_seconds: 600,
            network: Network::None,
            egress: crate::egress::EgressConfig::default(),
            allowed_env: ["LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "NO_COLOR", "CI"]
                .map(String::from)
                .to_vec(),
            cgroup_parent: "airlock".to_owned(),
            max_concurrent: airlock_sandbox::default_max_concurrent(),
            prebuilt: 2,
            workspace_bytes: 1 << 30,
            workspace_inodes: 100_000,
            volumes: None,
            metrics: crate::metrics::SandboxMetrics::default(),
            force_level: None,
        }
    }
}

/// `network = false | "none" | "proxy" | "host"`; `true` is refused, naming both.
fn network_setting<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Network, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Setting {
        Switch(bool),
        Mode(String),
    }
    match Setting::deserialize(de)? {
        Setting::Switch(false) => Ok(Network::None),
        Setting::Switch(true) => Err(serde::de::Error::custom(
            "network = true: write \"proxy\" (only the hosts [sandbox.egress] allow, through the worker's egress proxy) or \"host\" (the worker's whole network, with no egress rules)",
        )),
        Setting::Mode(mode) => match mode.as_str() {
            "none" => Ok(Network::None),
            "proxy" => Ok(Network::Proxy),
            "host" => Ok(Network::Host),
            other => Err(serde::de::Error::custom(format!(
                "network = {other:?}: use \"none\" (no network), \"proxy\" (only the hosts [sandbox.egress] allow) or \"host\""
            ))),
        },
    }
}

impl ShellConfig {
    pub fn sandbox_config(&self) -> SandboxConfig {
        SandboxConfig {
            min_isolation: self.min_isolation,
            force_level: self.force_level,
            memory_bytes: self.memory_bytes,
            pids: self.pids,
            cpu_millis: (self.cpu * 1000.0).round().max(1.0) as u64,
            tmp_bytes: self.tmp_bytes,
            fsize_bytes: self.fsize_bytes,
            nofile: self.nofile,
            output_cap_bytes: self.output_bytes,
            network: self.network,
            cgroup_parent: self.cgroup_parent.clone(),
            max_concurrent: self.max_concurrent,
            prebuilt: self.prebuilt,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_true_is_refused_naming_both_meanings() {
        let e = toml::from_str::<ShellConfig>("network = true")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"proxy\"") && e.contains("\"host\""), "{e}");
        for (text, network) in [
            ("network = false", Network::None),
            ("network = \"none\"", Network::None),
            ("network = \"proxy\"", Network::Proxy),
            ("network = \"host\"", Network::Host),
        ] {
            assert_eq!(
                toml::from_str::<ShellConfig>(text).unwrap().network,
                network,
                "{text}"
            );
        }
    }
}

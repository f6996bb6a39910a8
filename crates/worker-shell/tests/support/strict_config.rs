// The shell worker's configuration for these tests: workspaces under `root`, per-call
// cgroups under a parent of the test's own (`airlock-test-<test>-<pid>`, returned too, so
// that the test can check nothing is left there), sandboxes built per call and no
// workspace quota (no loop-mounted file system to clean up).

use airlock_worker_shell::ShellConfig;

pub fn strict_config(test: &str, root: &std::path::Path) -> (ShellConfig, String) {
    let parent = format!("airlock-test-{test}-{}", std::process::id());
    let config = ShellConfig {
        workspaces_root: root.to_owned(),
        cgroup_parent: parent.clone(),
        prebuilt: 0,
        workspace_bytes: 0,
        ..ShellConfig::default()
    };
    (config, parent)
}

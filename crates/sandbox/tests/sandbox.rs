//! Integration tests of the sandbox with real processes. Nothing is skipped: a host
//! without a required feature fails the test with a message naming it.
#![allow(unsafe_code)]
// Helpers outside #[test] functions panic on setup failures too, like the tests.
#![allow(clippy::expect_used, clippy::unwrap_used)]

/// Sandboxes are built for each call here.
const PREBUILT: usize = 0;

include!("support/checks.rs");

#[path = "support/v2_vm.rs"]
mod v2_vm;

/// The cgroup v2 backend on a host that has it: this host mounts v1 controllers, so the
/// tests that exercise the sandbox's cgroups run again in a guest with cgroup v2 alone
/// (every v1 controller disabled on its kernel command line), where the backend is
/// chosen by probing as on any host — and the report must say `v2`.
#[test]
fn cgroup_v2_backend_on_a_pure_v2_host() {
    const IN_GUEST: [&str; 12] = [
        "true_exits_zero",
        "echo_streams_and_captures_output",
        "exit_codes_and_signals",
        "timeout_kills_a_spinner",
        "cancel_kills_the_sandbox",
        "setsid_and_double_fork_escapees_are_killed",
        "standard_mode_escapees_are_killed_through_the_cgroup",
        "pids_limit_stops_a_fork_bomb",
        "memory_bomb_kills_only_the_sandbox",
        "strict_report_has_every_layer",
        "max_concurrent_sandboxes_run_at_once_and_the_rest_wait_within_their_deadline",
        "sandboxes_started_at_once_on_many_threads_all_start",
    ];
    let run = v2_vm::run_in_v2_guest(&IN_GUEST);
    let console = &run.console;
    assert!(
        console.contains("guest v1 mounts: 0"),
        "the guest has cgroup v2 only:\n{console}"
    );
    let controllers = console
        .lines()
        .find(|l| l.contains("guest cgroup:"))
        .unwrap_or_else(|| panic!("the guest did not report its cgroups:\n{console}"));
    for controller in ["memory", "pids", "cpu"] {
        assert!(
            controllers.contains(controller),
            "{controller} is enabled in the guest: {controllers}"
        );
    }
    assert_eq!(
        run.exit_status,
        Some(0),
        "the tests failed in the guest:\n{console}"
    );
    assert!(
        console.contains(&format!("test result: ok. {} passed", IN_GUEST.len())),
        "every test ran in the guest:\n{console}"
    );
}

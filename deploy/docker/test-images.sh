#!/usr/bin/env bash
# Checks that the images build-images.sh made are real: they run, as 65532, on a
# read-only root file system, a worker in them serves gRPC and drains on SIGTERM, the
# shell image has the tools sandboxes offer, and a shell worker in a plain container
# refuses strict isolation it cannot have, naming the fix. Prints the image sizes.
#
#   deploy/docker/test-images.sh        (after deploy/docker/build-images.sh)
#
# Needs docker and python3 with grpcio (pip install grpcio) for the health check.
# AIRLOCK_IMAGE_TAG: tag of the images (default dev). Exits non-zero if any check fails.
set -euo pipefail
shopt -s inherit_errexit

tag="${AIRLOCK_IMAGE_TAG:-dev}"
image="airlock:$tag"
shell_image="airlock-shell:$tag"

die() { echo "test-images: $*" >&2; exit 1; }
command -v docker >/dev/null 2>&1 || die "docker not found: install the Docker engine and client (apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "docker cannot reach the Docker engine (docker info failed): start it"
python3 -c 'import grpc' 2>/dev/null || die "python3 cannot import grpc (the health check's client): python3 -m pip install grpcio"
for i in "$image" "$shell_image"; do
    docker image inspect "$i" >/dev/null 2>&1 || die "no image $i: build it with deploy/docker/build-images.sh"
done

work="$(mktemp -d)"
# Every container this script starts carries this label; all are removed at the end.
label="airlock-test-images=$$"
cleanup() {
    docker ps -aq --filter "label=$label" | xargs -r docker rm -f >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

# Worker configurations, mounted read-only at /etc/airlock. Plaintext TCP (a lab switch;
# TLS is tested elsewhere) and no per-workspace quota (mounting needs the launcher).
mkdir -p "$work/strict" "$work/standard"
cat >"$work/strict/worker.toml" <<'EOF'
[tls]
insecure_plaintext = true

[sandbox]
workspace_bytes = 0
workspace_inodes = 0

[worker]
drain_seconds = 5
EOF
sed 's/^workspace_inodes = 0$/&\nmin_isolation = "standard"/' "$work/strict/worker.toml" >"$work/standard/worker.toml"
chmod 0755 "$work" "$work/strict" "$work/standard"
chmod 0644 "$work/strict/worker.toml" "$work/standard/worker.toml"

passed=0
failed=0
fail() { echo "    FAIL: $*" >&2; return 1; }
# check TITLE FUNCTION: runs FUNCTION in a subshell that stops at its first failure.
check() {
    local title=$1 rc
    shift
    echo "--- $title"
    set +e
    (
        set -e
        "$@"
    )
    rc=$?
    set -e
    if [ "$rc" = 0 ]; then
        echo "    ok"
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
    fi
}

# run_detached NAME IMAGE ARGS...: starts a container (kept after exit for its exit code).
run_detached() {
    local name=$1
    shift
    docker run -d --label "$label" --name "$name" "$@" >/dev/null
}

# wait_log NAME TEXT [exited]: waits up to 20 s for TEXT in the container's log; fails
# at once if the container stops first, unless "exited" says it already has (the engine
# may copy its last lines to the log a moment after it reports the exit).
wait_log() {
    local name=$1 text=$2 exited=${3:-} i
    for i in $(seq 1 100); do
        # Captured first: `… | grep -q` under pipefail fails when grep stops reading early.
        if grep -qF -- "$text" <<<"$(docker logs "$name" 2>&1)"; then return 0; fi
        if [ -z "$exited" ] && [ "$(docker inspect -f '{{.State.Running}}' "$name")" != true ]; then
            docker logs "$name" 2>&1 | tail -n 20 >&2
            fail "$name exited before logging '$text'"
            return 1
        fi
        sleep 0.2
    done
    docker logs "$name" 2>&1 | tail -n 20 >&2
    fail "no '$text' in the log of $name within 20 s"
}

# stop_and_expect_exit0 NAME: SIGTERM (docker stop), then exit code 0 and "drained".
stop_and_expect_exit0() {
    local name=$1 code
    docker stop -t 20 "$name" >/dev/null
    code="$(docker inspect -f '{{.State.ExitCode}}' "$name")"
    [ "$code" = 0 ] || { docker logs "$name" 2>&1 | tail -n 20 >&2; fail "$name exited $code after SIGTERM, not 0"; }
    wait_log "$name" 'SIGTERM received' exited
    wait_log "$name" 'drained' exited
}

indent() { sed 's/^/    /'; }

# proc_status NAME FIELD: a field of /proc/<pid>/status of the container's first process.
proc_status() {
    local pid
    pid="$(docker inspect -f '{{.State.Pid}}' "$1")"
    awk -v f="$2:" '$1 == f { $1 = ""; sub(/^ /, ""); print; exit }' "/proc/$pid/status"
}

# health NAME PORT SERVICE...: grpc.health.v1.Health/Check of each SERVICE ("" is the
# server as a whole) over the container network must answer SERVING. Also the readiness
# to wait for before a stop: a worker serves once its SIGTERM handler is in place.
health() {
    local name=$1 port=$2 ip
    shift 2
    ip="$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$name")"
    [ -n "$ip" ] || fail "$name has no IP address"
    # Hand-encoded messages: HealthCheckRequest {service = 1}, HealthCheckResponse
    # {status = 1}; SERVING is 1.
    python3 - "$ip:$port" "$@" <<'EOF' || fail "health check of $name failed"
import sys, grpc
channel = grpc.insecure_channel(sys.argv[1])
grpc.channel_ready_future(channel).result(timeout=20)
check = channel.unary_unary("/grpc.health.v1.Health/Check",
                            request_serializer=lambda b: b, response_deserializer=lambda b: b)
for service in sys.argv[2:]:
    s = service.encode()
    response = check(b"\x0a" + bytes([len(s)]) + s if s else b"", timeout=5)
    print(f"    health {service or '(server)'}: {response.hex()}")
    if response != b"\x08\x01":
        sys.exit(f"{service or '(server)'} is not SERVING")
EOF
}

t_config() {
    local i volumes
    for i in "$image" "$shell_image"; do
        [ "$(docker image inspect -f '{{.Config.User}}' "$i")" = 65532:65532 ] || fail "$i: User is not 65532:65532"
        [ "$(docker image inspect -f '{{json .Config.Entrypoint}}' "$i")" = '["/usr/local/bin/airlock"]' ] ||
            fail "$i: Entrypoint is $(docker image inspect -f '{{json .Config.Entrypoint}}' "$i")"
        volumes="$(docker image inspect -f '{{json .Config.Volumes}}' "$i")"
        grep -q '"/var/lib/airlock"' <<<"$volumes" || fail "$i: /var/lib/airlock is not a volume"
        grep -q '"/tmp"' <<<"$volumes" || fail "$i: /tmp is not a volume"
    done
}

t_version() {
    local out
    out="$(docker run --rm --label "$label" --read-only "$image" --version)" || fail "docker run --read-only $image --version failed"
    [[ $out == "airlock "* ]] || fail "--version printed '$out'"
    echo "    $out"
    out="$(docker run --rm --label "$label" --read-only "$shell_image" --version)" || fail "docker run --read-only $shell_image --version failed"
    [[ $out == "airlock "* ]] || fail "$shell_image --version printed '$out'"
}

# The minimal image holds the binary, its libraries and a few files of /etc: no shell.
t_contents() {
    local name="airlock-test-contents-$$" files
    docker create --label "$label" --name "$name" "$image" >/dev/null
    files="$(docker export "$name" | tar -t)"
    grep -qx 'usr/local/bin/airlock' <<<"$files" || fail "no usr/local/bin/airlock"
    grep -qx 'etc/ssl/certs/ca-certificates.crt' <<<"$files" || fail "no CA bundle"
    grep -qx 'etc/nsswitch.conf' <<<"$files" || fail "no nsswitch.conf"
    if grep -qE '^(usr/)?bin/(sh|bash|dash)$' <<<"$files"; then fail "the minimal image has a shell"; fi
    echo "    $(grep -c -v '/$' <<<"$files") entries: $(grep -E '\.so' <<<"$files" | tr '\n' ' ')"
}

t_fs_worker() {
    local name="airlock-test-fs-$$"
    run_detached "$name" --read-only --tmpfs /tmp -v "$work/strict:/etc/airlock:ro" \
        "$image" serve worker fs --listen 0.0.0.0:50051 --config /etc/airlock/worker.toml
    wait_log "$name" "fs worker starting"
    wait_log "$name" "confined:"
    [ "$(proc_status "$name" Uid | awk '{print $1, $2}')" = "65532 65532" ] || fail "the worker's uid is $(proc_status "$name" Uid)"
    [ "$(proc_status "$name" Gid | awk '{print $1, $2}')" = "65532 65532" ] || fail "the worker's gid is $(proc_status "$name" Gid)"
    [ "$(proc_status "$name" NoNewPrivs)" = 1 ] || fail "NoNewPrivs is not 1"
    [ "$(proc_status "$name" Seccomp)" = 2 ] || fail "Seccomp is not 2 (filter)"
    [ "$(proc_status "$name" CapEff)" = 0000000000000000 ] || fail "CapEff is $(proc_status "$name" CapEff)"
    health "$name" 50051 "" airlock.v1.ToolWorker airlock.insecure_plaintext
    stop_and_expect_exit0 "$name"
}

t_shell_tools() {
    local out
    out="$(docker run --rm --label "$label" --read-only --tmpfs /tmp --entrypoint /bin/sh "$shell_image" -c \
        'id -u; id -g; git --version; python3 -c "import sys; print(sys.version.split()[0])"; ls --version | head -n1; test -s /etc/ssl/certs/ca-certificates.crt && echo certs')" ||
        fail "running /bin/sh in $shell_image failed"
    indent <<<"$out"
    [ "$(sed -n 1p <<<"$out")" = 65532 ] || fail "id -u is not 65532"
    [ "$(sed -n 2p <<<"$out")" = 65532 ] || fail "id -g is not 65532"
    grep -q '^git version ' <<<"$out" || fail "no git"
    grep -qE '^3\.[0-9]+' <<<"$out" || fail "no python3"
    grep -q 'GNU coreutils' <<<"$out" || fail "no coreutils"
    grep -qx certs <<<"$out" || fail "no CA bundle"
}

# A sandbox in the shell image sees its tools. A plain container allows no user
# namespaces, so this is the standard level.
t_sandbox_run() {
    local out
    out="$(docker run --rm --label "$label" --read-only --tmpfs /tmp "$shell_image" sandbox run --profile standard -- \
        /bin/sh -c 'id -u; git --version; python3 -c "print(6 * 7)"' 2>"$work/sandbox.err")" ||
        { cat "$work/sandbox.err" >&2; fail "airlock sandbox run --profile standard failed"; }
    indent <<<"$out"
    grep -qx 65532 <<<"$out" || fail "the sandbox's uid is not 65532"
    grep -q '^git version ' <<<"$out" || fail "no git in the sandbox"
    grep -qx 42 <<<"$out" || fail "no python3 in the sandbox"
    grep -qE '"level": *"standard"' "$work/sandbox.err" || { cat "$work/sandbox.err" >&2; fail "no standard isolation report"; }
}

# Fail closed (DESIGN §5): strict isolation (the default) needs user namespaces and
# cgroups, which a plain container (Docker's default seccomp profile, read-only cgroupfs)
# does not give. The worker must refuse to start and name the ways out.
t_shell_strict_refused() {
    local name="airlock-test-shell-strict-$$" code log
    run_detached "$name" --read-only --tmpfs /tmp -v "$work/strict:/etc/airlock:ro" \
        "$shell_image" serve worker shell --listen 0.0.0.0:50052 --config /etc/airlock/worker.toml
    code="$(docker wait "$name")"
    log="$(docker logs "$name" 2>&1)"
    [ "$code" != 0 ] || { echo "$log" >&2; fail "the shell worker started without strict isolation"; }
    grep -qF 'refusing to start' <<<"$log" || { echo "$log" >&2; fail "no 'refusing to start'"; }
    grep -qF 'user namespaces are not available' <<<"$log" || fail "the refusal does not name user namespaces"
    grep -qF 'hostUsers: false' <<<"$log" || fail "the refusal does not name hostUsers: false"
    grep -qF -- '--security-opt seccomp=' <<<"$log" || fail "the refusal does not name Docker's --security-opt seccomp="
    grep -qF 'min_isolation = "standard"' <<<"$log" || fail "the refusal does not name min_isolation = \"standard\""
    echo "    exit $code: $(grep -o 'refusing to start: [^:]*: [^(]*' <<<"$log" | head -n1)"
}

# What each option buys: Airlock's strict seccomp profile (the one Kubernetes nodes load
# for components/shell-strict) and unmasked /proc give the container user namespaces;
# the worker still refuses, now naming only cgroups, since Docker mounts the cgroup file
# system read-only in every unprivileged container.
t_shell_strict_profile() {
    local name="airlock-test-shell-profile-$$" code log profile
    profile="$(cd "$(dirname "${BASH_SOURCE[0]}")/../k8s/components/shell-strict/node" && pwd)/shell-strict.json"
    run_detached "$name" --read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges \
        --security-opt "seccomp=$profile" --security-opt systempaths=unconfined \
        -v "$work/strict:/etc/airlock:ro" \
        "$shell_image" serve worker shell --listen 0.0.0.0:50052 --config /etc/airlock/worker.toml
    code="$(docker wait "$name")"
    log="$(docker logs "$name" 2>&1)"
    [ "$code" != 0 ] || { echo "$log" >&2; fail "the shell worker started strict without a writable cgroup"; }
    grep -qF 'refusing to start' <<<"$log" || { echo "$log" >&2; fail "no 'refusing to start'"; }
    grep -qF 'cgroups are not usable' <<<"$log" || { echo "$log" >&2; fail "the refusal does not name cgroups"; }
    if grep -qF 'user namespaces are not available' <<<"$log"; then
        echo "$log" >&2
        fail "user namespaces are still refused under $profile"
    fi
    echo "    exit $code: $(grep -o 'refusing to start: [^(]*' <<<"$log" | head -n1)"
}

t_shell_standard() {
    local name="airlock-test-shell-standard-$$"
    run_detached "$name" --read-only --tmpfs /tmp -v "$work/standard:/etc/airlock:ro" \
        "$shell_image" serve worker shell --listen 0.0.0.0:50052 --config /etc/airlock/worker.toml
    wait_log "$name" "shell worker starting"
    wait_log "$name" "confined:"
    grep -qE '"level": *"standard"' <<<"$(docker logs "$name" 2>&1)" || fail "no standard isolation report at start"
    [ "$(proc_status "$name" Uid | awk '{print $1}')" = 65532 ] || fail "the worker's uid is $(proc_status "$name" Uid)"
    health "$name" 50052 "" airlock.v1.ToolWorker
    stop_and_expect_exit0 "$name"
}

check "image config: 65532:65532, ENTRYPOINT airlock, volumes" t_config
check "airlock --version on a read-only root" t_version
check "airlock:dev holds the binary, its libraries, /etc and no shell" t_contents
check "fs worker: starts read-only as 65532, confined, serves health, drains on SIGTERM" t_fs_worker
check "airlock-shell:dev: sh, coreutils, git, python3, uid 65532" t_shell_tools
check "airlock-shell:dev: a standard sandbox sees sh, git, python3" t_sandbox_run
check "shell worker refuses strict isolation in a plain container, naming the fix" t_shell_strict_refused
check "shell worker under the strict seccomp profile: user namespaces, but no writable cgroup" t_shell_strict_profile
check "shell worker with min_isolation = standard starts and drains" t_shell_standard

for i in "$image" "$shell_image"; do
    size="$(docker image inspect -f '{{.Size}}' "$i")"
    echo "size $i: $size bytes ($((size / 1024 / 1024)) MiB)"
done
echo "images: $passed passed, $failed failed"
[ "$failed" = 0 ]

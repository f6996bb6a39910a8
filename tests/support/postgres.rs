//! A real PostgreSQL server for tests, shared by every test of one test binary.
//!
//! Include it as a module (it is not a crate):
//!
//! ```ignore
//! #[path = "../../../tests/support/postgres.rs"]
//! mod postgres;
//! ```
//!
//! The first call to [`server`] runs `initdb` and starts `postgres` on a free loopback
//! port (as the unprivileged user `nobody` when the tests run as root: initdb refuses
//! root). A watchdog shell holds the read end of a pipe whose write end lives in this
//! process; when the test binary exits — however it exits — the pipe closes and the
//! watchdog stops the server and deletes its directory.
//!
//! Authentication over TCP: the superuser [`SUPERUSER`] is trusted (tests connect with
//! no password; a password given anyway is ignored), every other role must log in with
//! its password (SCRAM), see [`Server::create_role`]. Unix-socket logins are trusted.
//!
//! [`start_tls`] starts a server of the caller's own that takes only TLS connections over
//! TCP (`ssl = on`, `hostssl` lines only, so the server itself refuses plaintext),
//! stopped when it is dropped.
//!
//! The server binaries are looked up in `$AIRLOCK_PG_BIN`, /usr/local/bin,
//! /usr/lib/postgresql/*/bin (newest first) and PATH. When they are missing the tests
//! FAIL — never skip — telling how to install them.
#![allow(
    dead_code,
    reason = "each test binary uses a different part of the harness"
)]

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The superuser `initdb` creates; trusted on loopback.
pub const SUPERUSER: &str = "airlock";

const DIR_PREFIX: &str = "airlock-pg-";

const PG_MISSING: &str = "PostgreSQL server binaries (initdb, postgres) were not found in \
     $AIRLOCK_PG_BIN, /usr/local/bin, /usr/lib/postgresql/*/bin or PATH: install postgresql \
     (apt-get install postgresql; .ci/run does this)";

/// The running test server.
pub struct Server {
    /// The loopback TCP port.
    pub port: u16,
    /// The server's own directory (data dir, log, Unix socket). Files put here (password
    /// files, say) are removed with the server at exit.
    pub dir: PathBuf,
    /// The directory holding `initdb`, `postgres` and (usually) `psql`.
    pub bin: PathBuf,
    /// Where [`Server::sql`] connects: loopback TCP, or the Unix socket in `dir` for a
    /// TLS-only server.
    psql_host: String,
    /// Closing this pipe makes the watchdog stop postgres and delete `dir`.
    _watchdog_stdin: Mutex<ChildStdin>,
    _watchdog: Mutex<Child>,
}

static SERVER: OnceLock<Result<Server, String>> = OnceLock::new();
static NAME_COUNTER: AtomicU32 = AtomicU32::new(0);

/// The shared server, started on first use. Panics (failing the test) when it cannot
/// start, with the reason — e.g. how to install PostgreSQL.
pub fn server() -> &'static Server {
    match SERVER.get_or_init(start) {
        Ok(server) => server,
        Err(message) => panic!("cannot start the test PostgreSQL: {message}"),
    }
}

/// The shared server's port.
pub fn port() -> u16 {
    server().port
}

/// Creates a fresh database owned by the superuser; returns its superuser URL.
pub fn create_database(name: &str) -> String {
    server().create_database(name)
}

/// A database or role name unique within this machine's test runs: `prefix_pid_n`.
pub fn unique_name(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        NAME_COUNTER.fetch_add(1, Ordering::SeqCst)
    )
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

impl Server {
    /// `postgres://airlock@127.0.0.1:<port>/<db>` (no password needed).
    pub fn url(&self, db: &str) -> String {
        self.url_as(SUPERUSER, db)
    }

    /// `postgres://<user>@127.0.0.1:<port>/<db>`; the password goes elsewhere.
    pub fn url_as(&self, user: &str, db: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }

    /// Runs SQL as the superuser with `psql` (each `;`-separated statement on its own,
    /// stopping at the first error); returns the unaligned, tuples-only output.
    pub fn sql(&self, db: &str, sql: &str) -> Result<String, String> {
        let psql = self.psql();
        let mut child = Command::new(&psql)
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                &self.psql_host,
            ])
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                SUPERUSER,
                "-d",
                db,
                "-f",
                "-",
            ])
            .env("PGCONNECT_TIMEOUT", "10")
            .env_remove("PGPASSWORD")
            .env_remove("PGSERVICE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", psql.display()))?;
        let mut stdin = child.stdin.take().unwrap();
        let script = sql.to_owned();
        let writer = std::thread::spawn(move || {
            use std::io::Write as _;
            let _ = stdin.write_all(script.as_bytes());
        });
        let out = child.wait_with_output().map_err(|e| format!("psql: {e}"))?;
        let _ = writer.join();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "psql on {db} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Creates database `name` (owned by the superuser); returns its superuser URL.
    pub fn create_database(&self, name: &str) -> String {
        self.sql("postgres", &format!("CREATE DATABASE {name};"))
            .unwrap_or_else(|e| panic!("{e}"));
        self.url(name)
    }

    /// Creates a login role that must authenticate with `password` over TCP.
    pub fn create_role(&self, name: &str, password: &str) {
        let password = password.replace('\'', "''");
        self.sql(
            "postgres",
            &format!("CREATE ROLE {name} LOGIN PASSWORD '{password}';"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    fn psql(&self) -> PathBuf {
        let beside = self.bin.join("psql");
        if beside.is_file() {
            return beside;
        }
        PathBuf::from("psql")
    }
}

// ---------------------------------------------------------------------------------
// Finding the binaries
// ---------------------------------------------------------------------------------

fn has_bins(dir: &Path) -> bool {
    dir.join("initdb").is_file() && dir.join("postgres").is_file()
}

/// The directory of `initdb` and `postgres`; a symlinked `initdb` (Debian links
/// /usr/local/bin or /usr/bin entries to /usr/lib/postgresql/N/bin) resolves to the
/// real directory, where `psql` lives too.
pub fn bin_dir() -> Result<PathBuf, String> {
    let resolve = |dir: PathBuf| -> PathBuf {
        std::fs::canonicalize(dir.join("initdb"))
            .ok()
            .and_then(|real| real.parent().map(Path::to_path_buf))
            .filter(|real| has_bins(real))
            .unwrap_or(dir)
    };
    if let Some(dir) = std::env::var_os("AIRLOCK_PG_BIN").map(PathBuf::from) {
        return if has_bins(&dir) {
            Ok(resolve(dir))
        } else {
            Err(format!(
                "AIRLOCK_PG_BIN={} has no initdb and postgres",
                dir.display()
            ))
        };
    }
    let mut candidates = vec![PathBuf::from("/usr/local/bin")];
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort();
    candidates.extend(versions.into_iter().rev().map(|(_, dir)| dir));
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path));
    }
    candidates
        .into_iter()
        .find(|dir| has_bins(dir))
        .map(resolve)
        .ok_or_else(|| PG_MISSING.to_owned())
}

// ---------------------------------------------------------------------------------
// Dropping to `nobody`
// ---------------------------------------------------------------------------------

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

fn id_of(flag: &str, user: &str) -> Result<u32, String> {
    let out = Command::new("id")
        .args([flag, user])
        .output()
        .map_err(|e| format!("cannot run `id`: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|_| format!("user `{user}` does not exist (needed to run PostgreSQL as non-root)"))
}

/// The uid and gid that own the server's files, when we drop to them.
type Owner = Option<(u32, u32)>;

/// The command prefix that runs a program as `nobody` when we are root (empty
/// otherwise), and nobody's uid and gid.
fn as_nobody() -> Result<(Vec<String>, Owner), String> {
    if !running_as_root() {
        return Ok((Vec::new(), None));
    }
    let uid = id_of("-u", "nobody")?;
    let gid = id_of("-g", "nobody")?;
    for dir in ["/usr/bin", "/bin", "/usr/sbin", "/sbin"] {
        let setpriv = Path::new(dir).join("setpriv");
        if setpriv.is_file() {
            return Ok((
                vec![
                    setpriv.display().to_string(),
                    format!("--reuid={uid}"),
                    format!("--regid={gid}"),
                    "--clear-groups".into(),
                    "--".into(),
                ],
                Some((uid, gid)),
            ));
        }
    }
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        let runuser = Path::new(dir).join("runuser");
        if runuser.is_file() {
            return Ok((
                vec![
                    runuser.display().to_string(),
                    "-u".into(),
                    "nobody".into(),
                    "--".into(),
                ],
                Some((uid, gid)),
            ));
        }
    }
    Err(
        "running as root, and neither setpriv nor runuser (util-linux) is installed to drop \
         to `nobody` for PostgreSQL (apt-get install util-linux)"
            .into(),
    )
}

// ---------------------------------------------------------------------------------
// Starting the server
// ---------------------------------------------------------------------------------

/// Deletes server directories left by test binaries that are gone (e.g. SIGKILLed
/// together with their watchdog).
fn remove_stale_dirs(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(DIR_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .filter(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

const HBA: &str = "\
local all all trust
host all airlock 127.0.0.1/32 trust
host all airlock ::1/128 trust
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
";

/// A TLS-only server: TCP connections without TLS match no line and are refused.
const HBA_TLS: &str = "\
local all all trust
hostssl all airlock 127.0.0.1/32 trust
hostssl all airlock ::1/128 trust
hostssl all all 127.0.0.1/32 scram-sha-256
hostssl all all ::1/128 scram-sha-256
";

/// The watchdog: starts postgres in the background, waits for its stdin to close (this
/// process exiting), then stops postgres (fast shutdown) and deletes the directory.
/// Arguments after the third are more server options (`-c ssl=on`, ...).
const WATCHDOG: &str = r#"
bin=$1; dir=$2; port=$3; shift 3
"$bin" -D "$dir/data" -p "$port" -k "$dir" -c listen_addresses=127.0.0.1 -c fsync=off \
  -c synchronous_commit=off -c full_page_writes=off -c max_connections=400 \
  -c shared_buffers=32MB "$@" >"$dir/postgres.log" 2>&1 &
pid=$!
read -r _ignored || true
kill -INT "$pid" 2>/dev/null
wait "$pid"
rm -rf "$dir"
"#;

fn start() -> Result<Server, String> {
    start_with(None)
}

/// Starts a server of the caller's own (stopped when dropped) that serves TLS with
/// `cert` and `key` (copied into its directory, the key mode 0600 and owned by the
/// server's user, as PostgreSQL requires) and refuses TCP connections without TLS.
pub fn start_tls(cert: &Path, key: &Path) -> Result<Server, String> {
    start_with(Some((cert, key)))
}

fn start_with(tls: Option<(&Path, &Path)>) -> Result<Server, String> {
    let bin = bin_dir()?;
    let (prefix, owner) = as_nobody()?;
    let tmp = std::env::temp_dir();
    remove_stale_dirs(&tmp);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = tmp.join(format!("{DIR_PREFIX}{}-{stamp}", std::process::id()));
    std::fs::create_dir(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("chmod {}: {e}", dir.display()))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
            .map_err(|e| format!("chown {} to nobody: {e}", dir.display()))?;
    }
    let data = dir.join("data");
    let command = |program: &Path| {
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut cmd = Command::new(first);
                cmd.args(rest).arg(program);
                cmd
            }
            None => Command::new(program),
        };
        cmd.current_dir(&dir);
        cmd
    };
    let out = command(&bin.join("initdb"))
        .arg("-D")
        .arg(&data)
        .args(["-U", SUPERUSER, "-A", "trust", "-E", "UTF8"])
        .args(["--locale=C", "--no-sync"])
        .output()
        .map_err(|e| format!("cannot run initdb: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    // Overwriting keeps the file's owner (nobody) and mode.
    let hba = if tls.is_some() { HBA_TLS } else { HBA };
    std::fs::write(data.join("pg_hba.conf"), hba).map_err(|e| format!("write pg_hba.conf: {e}"))?;
    let mut options: Vec<String> = Vec::new();
    if let Some((cert, key)) = tls {
        let (server_cert, server_key) = (dir.join("server.crt"), dir.join("server.key"));
        std::fs::copy(cert, &server_cert)
            .map_err(|e| format!("copy {} to {}: {e}", cert.display(), server_cert.display()))?;
        std::fs::copy(key, &server_key)
            .map_err(|e| format!("copy {} to {}: {e}", key.display(), server_key.display()))?;
        std::fs::set_permissions(&server_key, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("chmod {}: {e}", server_key.display()))?;
        if let Some((uid, gid)) = owner {
            for file in [&server_cert, &server_key] {
                std::os::unix::fs::chown(file, Some(uid), Some(gid))
                    .map_err(|e| format!("chown {} to nobody: {e}", file.display()))?;
            }
        }
        options.extend([
            "-c".to_owned(),
            "ssl=on".to_owned(),
            "-c".to_owned(),
            format!("ssl_cert_file={}", server_cert.display()),
            "-c".to_owned(),
            format!("ssl_key_file={}", server_key.display()),
        ]);
    }
    let port = free_port();
    let mut watchdog = command(Path::new("/bin/sh"))
        .args(["-c", WATCHDOG, "sh"])
        .arg(bin.join("postgres"))
        .arg(&dir)
        .arg(port.to_string())
        .args(&options)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start postgres: {e}"))?;
    let stdin = watchdog.stdin.take().unwrap();
    let psql_host = if tls.is_some() {
        dir.display().to_string()
    } else {
        "127.0.0.1".to_owned()
    };
    let server = Server {
        port,
        dir,
        bin,
        psql_host,
        _watchdog_stdin: Mutex::new(stdin),
        _watchdog: Mutex::new(watchdog),
    };
    // postmaster.pid's 8th line says `ready` once connections are accepted.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = std::fs::read_to_string(data.join("postmaster.pid"))
            .ok()
            .and_then(|pid| pid.lines().nth(7).map(|l| l.trim() == "ready"))
            .unwrap_or(false);
        if ready && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(server);
        }
        let exited = server
            ._watchdog
            .lock()
            .map(|mut w| w.try_wait().ok().flatten().is_some())
            .unwrap_or(true);
        if exited || Instant::now() > deadline {
            return Err(format!(
                "postgres did not become ready on port {port}: {}",
                server.log()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

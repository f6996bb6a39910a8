//! One `[[databases]]` entry of `airlock.toml`, its validation, and its password.

use std::path::{Path, PathBuf};

use airlock_tls::postgres::{PgTls, PgTlsError, PgUrl};

/// How an entry's `url` is understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

impl Engine {
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Sqlite => "sqlite",
            Engine::Postgres => "postgresql",
        }
    }
}

/// Errors in the `[[databases]]` configuration, found at start-up. None of them ever
/// contains a password.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("database name {0:?} is invalid: use 1 to 64 letters, digits, '_' or '-'")]
    InvalidName(String),
    #[error("database name {0:?} is configured twice")]
    DuplicateName(String),
    #[error(
        "database {name:?}: url must start with sqlite:// (sqlite:///abs/path.db) or postgres:// (postgres://user@host:port/db)"
    )]
    UnknownScheme { name: String },
    #[error("database {name:?}: sqlite url has an empty path")]
    EmptySqlitePath { name: String },
    #[error(
        "database {name:?}: relative sqlite path {path:?} needs a base directory (resolve_relative)"
    )]
    RelativeSqlitePath { name: String, path: PathBuf },
    #[error("database {name:?}: invalid postgres url: {reason}")]
    InvalidPostgresUrl { name: String, reason: String },
    #[error("database {name:?}: {source}")]
    PostgresTls {
        name: String,
        source: airlock_tls::postgres::PgTlsError,
    },
    #[error(
        "database {name:?}: the url must not hold a password; set password_env or password_file instead"
    )]
    PasswordInUrl { name: String },
    #[error("database {name:?}: password_env and password_file are only for postgres urls")]
    PasswordForSqlite { name: String },
    #[error("database {name:?}: set only one of password_env and password_file")]
    TwoPasswordSources { name: String },
    #[error("database {name:?}: environment variable {var} (password_env) is not set")]
    PasswordEnvMissing { name: String, var: String },
    #[error("database {name:?}: cannot read password_file {path:?}: {kind}")]
    PasswordFile {
        name: String,
        path: PathBuf,
        kind: std::io::ErrorKind,
    },
    #[error("database {name:?}: {key} must be at least 1")]
    Zero { name: String, key: &'static str },
}

fn default_true() -> bool {
    true
}
fn default_max_rows() -> u64 {
    1000
}
fn default_timeout() -> u64 {
    30_000
}
fn default_pool() -> u32 {
    4
}

/// One `[[databases]]` entry.
#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Name the model uses in the `database` argument; `^[A-Za-z0-9_-]{1,64}$`.
    pub name: String,
    /// `sqlite:///abs/path.db` (`sqlite://` + path; relative paths are relative to the
    /// config file, see [`DatabaseConfig::resolve_relative`]) or
    /// `postgres://user@host:port/db` (`postgresql://` too; TLS with
    /// `?sslmode=verify-full&sslrootcert=/path/ca.crt`, see airlock_tls::postgres).
    pub url: String,
    /// Environment variable holding the PostgreSQL password.
    #[serde(default)]
    pub password_env: Option<String>,
    /// File holding the PostgreSQL password (trailing newline ignored).
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// When true (the default), `execute_sql` is refused on this database.
    #[serde(default = "default_true")]
    pub read_only: bool,
    /// Upper bound of rows one `query_database` call returns (default 1000).
    #[serde(default = "default_max_rows")]
    pub max_rows: u64,
    /// Per-statement timeout in milliseconds (default 30000).
    #[serde(default = "default_timeout")]
    pub statement_timeout_ms: u64,
    /// Connections to a PostgreSQL database at most; concurrent calls on a SQLite file
    /// at most (default 4).
    #[serde(default = "default_pool")]
    pub pool_size: u32,
    /// TESTS ONLY: switches off the SQL parser layer of `query_database`'s read-only
    /// enforcement, so a test can show that the engine layer alone stops writes. Never
    /// read from a config file.
    #[doc(hidden)]
    #[serde(skip)]
    pub unsafe_skip_parser_for_tests: bool,
    /// TESTS ONLY: switches off the engine layer of `query_database`'s read-only
    /// enforcement (SQLite read-only open, `query_only`, authorizer; PostgreSQL `READ
    /// ONLY` transaction, rollback), so a test can show that the parser alone stops
    /// writes. Never read from a config file.
    #[doc(hidden)]
    #[serde(skip)]
    pub unsafe_skip_engine_read_only_for_tests: bool,
}

impl std::fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("name", &self.name)
            .field("url", &self.url)
            .field("password_env", &self.password_env)
            .field("password_file", &self.password_file)
            .field("read_only", &self.read_only)
            .field("max_rows", &self.max_rows)
            .field("statement_timeout_ms", &self.statement_timeout_ms)
            .field("pool_size", &self.pool_size)
            .finish_non_exhaustive()
    }
}

/// Where an entry points, once validated.
#[derive(Clone)]
pub(crate) enum Target {
    Sqlite(PathBuf),
    Postgres(Box<tokio_postgres::Config>, PgTls),
}

impl DatabaseConfig {
    /// A read-only entry with the default limits.
    pub fn new(name: impl Into<String>, url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            url: url.into(),
            password_env: None,
            password_file: None,
            read_only: true,
            max_rows: default_max_rows(),
            statement_timeout_ms: default_timeout(),
            pool_size: default_pool(),
            unsafe_skip_parser_for_tests: false,
            unsafe_skip_engine_read_only_for_tests: false,
        }
    }

    /// Makes a relative `sqlite://` path and a relative `password_file` relative to
    /// `base_dir` (the directory of the config file). Other urls are left alone.
    pub fn resolve_relative(&mut self, base_dir: &Path) {
        if let Some(path) = sqlite_path_str(&self.url) {
            let p = Path::new(path);
            if !path.is_empty() && p.is_relative() {
                self.url = format!("sqlite://{}", base_dir.join(p).display());
            }
        }
        if let Some(file) = &self.password_file
            && file.is_relative()
        {
            self.password_file = Some(base_dir.join(file));
        }
    }

    /// The engine the url names, if the scheme is known.
    pub fn engine(&self) -> Option<Engine> {
        if sqlite_path_str(&self.url).is_some() {
            Some(Engine::Sqlite)
        } else if self.url.starts_with("postgres://") || self.url.starts_with("postgresql://") {
            Some(Engine::Postgres)
        } else {
            None
        }
    }

    /// The absolute path of a SQLite entry, if it is one and its path is absolute.
    pub fn sqlite_path(&self) -> Option<PathBuf> {
        let p = Path::new(sqlite_path_str(&self.url)?);
        (p.is_absolute()).then(|| p.to_path_buf())
    }

    /// Validates the entry and reads its password.
    pub(crate) fn target(&self) -> Result<Target, DbError> {
        let name = self.name.clone();
        if !valid_name(&self.name) {
            return Err(DbError::InvalidName(name));
        }
        if self.max_rows == 0 {
            return Err(DbError::Zero {
                name,
                key: "max_rows",
            });
        }
        if self.statement_timeout_ms == 0 {
            return Err(DbError::Zero {
                name,
                key: "statement_timeout_ms",
            });
        }
        if self.pool_size == 0 {
            return Err(DbError::Zero {
                name,
                key: "pool_size",
            });
        }
        match self.engine() {
            None => Err(DbError::UnknownScheme { name }),
            Some(Engine::Sqlite) => {
                if self.password_env.is_some() || self.password_file.is_some() {
                    return Err(DbError::PasswordForSqlite { name });
                }
                let raw = sqlite_path_str(&self.url).unwrap_or_default();
                if raw.is_empty() {
                    return Err(DbError::EmptySqlitePath { name });
                }
                match self.sqlite_path() {
                    Some(p) => Ok(Target::Sqlite(p)),
                    None => Err(DbError::RelativeSqlitePath {
                        name,
                        path: PathBuf::from(raw),
                    }),
                }
            }
            Some(Engine::Postgres) => {
                let PgUrl { mut config, tls } =
                    airlock_tls::postgres::parse(&self.url).map_err(|e| match e {
                        PgTlsError::Url(reason) => DbError::InvalidPostgresUrl {
                            name: name.clone(),
                            reason,
                        },
                        source => DbError::PostgresTls {
                            name: name.clone(),
                            source,
                        },
                    })?;
                if config.get_password().is_some() {
                    return Err(DbError::PasswordInUrl { name });
                }
                if let Some(password) = self.password()? {
                    config.password(password);
                }
                if config.get_connect_timeout().is_none() {
                    config.connect_timeout(std::time::Duration::from_secs(5));
                }
                if config.get_application_name().is_none() {
                    config.application_name("airlock-worker-db");
                }
                Ok(Target::Postgres(Box::new(config), tls))
            }
        }
    }

    /// The password from `password_env` or `password_file`, if either is set.
    pub(crate) fn password(&self) -> Result<Option<String>, DbError> {
        let name = self.name.clone();
        match (&self.password_env, &self.password_file) {
            (Some(_), Some(_)) => Err(DbError::TwoPasswordSources { name }),
            (Some(var), None) => match std::env::var(var) {
                Ok(v) => Ok(Some(v)),
                Err(_) => Err(DbError::PasswordEnvMissing {
                    name,
                    var: var.clone(),
                }),
            },
            (None, Some(path)) => match std::fs::read_to_string(path) {
                Ok(v) => Ok(Some(v.trim_end_matches(['\n', '\r']).to_owned())),
                Err(e) => Err(DbError::PasswordFile {
                    name,
                    path: path.clone(),
                    kind: e.kind(),
                }),
            },
            (None, None) => Ok(None),
        }
    }
}

fn sqlite_path_str(url: &str) -> Option<&str> {
    url.strip_prefix("sqlite://")
}

pub(crate) fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_unknown_keys() {
        let c: DatabaseConfig =
            serde_json::from_str(r#"{"name": "demo", "url": "sqlite:///tmp/x.db"}"#).unwrap();
        assert!(c.read_only);
        assert_eq!(c.max_rows, 1000);
        assert_eq!(c.statement_timeout_ms, 30_000);
        assert_eq!(c.pool_size, 4);
        assert!(!c.unsafe_skip_parser_for_tests);
        assert!(
            serde_json::from_str::<DatabaseConfig>(
                r#"{"name": "d", "url": "sqlite:///x", "unsafe_skip_parser_for_tests": true}"#
            )
            .is_err()
        );
    }

    #[test]
    fn sqlite_relative_paths_resolve_against_base() {
        let mut c = DatabaseConfig::new("d", "sqlite://data/demo.db");
        assert!(matches!(
            c.target(),
            Err(DbError::RelativeSqlitePath { .. })
        ));
        c.resolve_relative(Path::new("/etc/airlock"));
        assert_eq!(c.url, "sqlite:///etc/airlock/data/demo.db");
        assert_eq!(
            c.sqlite_path(),
            Some(PathBuf::from("/etc/airlock/data/demo.db"))
        );
        let mut abs = DatabaseConfig::new("d", "sqlite:///var/x.db");
        abs.resolve_relative(Path::new("/etc"));
        assert_eq!(abs.url, "sqlite:///var/x.db");
    }

    #[test]
    fn names_schemes_and_passwords_are_checked() {
        assert!(matches!(
            DatabaseConfig::new("bad name", "sqlite:///x").target(),
            Err(DbError::InvalidName(_))
        ));
        assert!(matches!(
            DatabaseConfig::new("d", "mysql://x").target(),
            Err(DbError::UnknownScheme { .. })
        ));
        let e = DatabaseConfig::new("d", "postgres://u:hunter22@localhost/db")
            .target()
            .err()
            .unwrap();
        assert!(matches!(e, DbError::PasswordInUrl { .. }));
        assert!(!e.to_string().contains("hunter22"));
        let mut c = DatabaseConfig::new("d", "postgres://u@localhost:5/db");
        c.password_env = Some("AIRLOCK_TEST_SURELY_UNSET_VAR".into());
        assert!(matches!(
            c.target(),
            Err(DbError::PasswordEnvMissing { .. })
        ));
        assert!(valid_name("demo_1-x"));
        assert!(!valid_name(""));
        assert!(!valid_name(&"a".repeat(65)));
    }
}

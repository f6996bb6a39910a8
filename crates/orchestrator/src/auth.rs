//! Bearer tokens to principals.
//!
//! Tokens are compared by their SHA-256 digest, so the configuration only ever holds
//! digests or names of environment variables, and a token never appears in a log.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use airlock_policy::validate_segment;
use sha2::{Digest, Sha256};

use crate::config::PrincipalConfig;

/// Name of the principal `airlock up` creates when none is configured.
pub const LOCAL_PRINCIPAL: &str = "local";

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("principal {name:?}: {reason}")]
    BadPrincipal { name: String, reason: String },
    #[error(
        "principal {name:?}: environment variable {var} is not set or empty; export it or use token_sha256"
    )]
    MissingTokenEnv { name: String, var: String },
    #[error("principal {name:?}: token_sha256 must be 64 hex characters")]
    BadDigest { name: String },
    #[error("principals {first:?} and {second:?} have the same token")]
    DuplicateToken { first: String, second: String },
    #[error(
        "principal {name:?} is configured twice with different roles; give each principal one set of roles (several entries of one name are for rotating its token)"
    )]
    ConflictingRoles { name: String },
    #[error("cannot read or create the token file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("token file {path} is empty; delete it to have a new token generated")]
    EmptyTokenFile { path: PathBuf },
    #[error("cannot gather randomness for a token: {0}")]
    Random(String),
}

/// What a principal may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Calls tools.
    Agent,
    /// Decides pending approvals.
    Approver,
    /// Reads the audit log and everything else.
    Admin,
}

impl Role {
    fn parse(value: &str) -> Option<Self> {
        match value {
            "agent" => Some(Role::Agent),
            "approver" => Some(Role::Approver),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub roles: Vec<Role>,
}

impl Principal {
    pub fn has(&self, role: Role) -> bool {
        self.roles.contains(&role) || self.roles.contains(&Role::Admin)
    }
}

/// Why a request did not authenticate; each front door says it in its own way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unauthenticated {
    /// No `Authorization` header at all.
    Missing,
    /// A credential under another scheme (`Basic ...`), or an unreadable header.
    NotBearer,
    /// A bearer token that belongs to no principal.
    InvalidToken,
}

/// Where a caller finds a token when `airlock up` generated it.
const GENERATED_TOKEN_HINT: &str = "airlock up writes the token to <data_dir>/token and CLI clients also read AIRLOCK_TOKEN; there is no OAuth flow";
/// Where a caller finds a token when principals are configured.
const CONFIGURED_TOKEN_HINT: &str = "use the token configured for your principal in airlock.toml ([[principals]]) and CLI clients also read AIRLOCK_TOKEN; there is no OAuth flow";

/// The table of known tokens, by digest. It can be replaced while the orchestrator
/// runs (a SIGHUP reloads `[[principals]]`): a removed principal's token stops working
/// at once, and calls it left waiting for approval are checked against the new table.
#[derive(Debug, Default)]
pub struct Principals {
    table: std::sync::RwLock<Arc<Table>>,
}

#[derive(Debug, Default)]
struct Table {
    by_digest: HashMap<[u8; 32], Principal>,
    /// The single token is the generated `<data_dir>/token`.
    generated: bool,
}

impl Principals {
    /// Builds the table from `[[principals]]`; with none configured, the data dir's token
    /// file (created on first start, owner-only) names one principal with every role.
    pub fn load(configs: &[PrincipalConfig], data_dir: &Path) -> Result<Self, AuthError> {
        let table = Table::load(configs, data_dir)?;
        Ok(Self {
            table: std::sync::RwLock::new(Arc::new(table)),
        })
    }

    fn current(&self) -> Arc<Table> {
        match self.table.read() {
            Ok(table) => table.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Puts `other`'s table in force, for every later request.
    pub fn replace(&self, other: Principals) {
        let fresh = other.current();
        match self.table.write() {
            Ok(mut table) => *table = fresh,
            Err(poisoned) => *poisoned.into_inner() = fresh,
        }
    }

    /// The principal a bearer token belongs to.
    pub fn authenticate(&self, token: &str) -> Option<Principal> {
        if token.is_empty() {
            return None;
        }
        self.current().by_digest.get(&digest(token)).cloned()
    }

    /// The principal of an `Authorization` header value (`None`: no header).
    pub fn authenticate_header(&self, header: Option<&str>) -> Result<Principal, Unauthenticated> {
        let header = header.ok_or(Unauthenticated::Missing)?;
        let token = bearer_token(header).ok_or(Unauthenticated::NotBearer)?;
        self.authenticate(token)
            .ok_or(Unauthenticated::InvalidToken)
    }

    /// The principal named `name` as the table in force knows it (its roles now), or
    /// `None` when no principal of that name is configured any more.
    pub fn by_name(&self, name: &str) -> Option<Principal> {
        self.current()
            .by_digest
            .values()
            .find(|p| p.name == name)
            .cloned()
    }

    /// The names of the configured principals, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .current()
            .by_digest
            .values()
            .map(|p| p.name.clone())
            .collect();
        names.sort();
        names
    }

    /// Where a caller gets a valid token: one line of plain ASCII without quotes, fit
    /// for an error message and for a `WWW-Authenticate` quoted-string. It names the
    /// place, never the token or the data dir's real path (the caller is unauthenticated).
    pub fn token_hint(&self) -> &'static str {
        if self.current().generated {
            GENERATED_TOKEN_HINT
        } else {
            CONFIGURED_TOKEN_HINT
        }
    }
}

impl Table {
    fn load(configs: &[PrincipalConfig], data_dir: &Path) -> Result<Self, AuthError> {
        let mut table = Table::default();
        if configs.is_empty() {
            table.generated = true;
            let token = ensure_token_file(&token_file_path(data_dir))?;
            table.by_digest.insert(
                digest(&token),
                Principal {
                    name: LOCAL_PRINCIPAL.to_owned(),
                    roles: vec![Role::Agent, Role::Approver, Role::Admin],
                },
            );
            return Ok(table);
        }
        // A name is who a principal is (approvals, quorum, audit): several entries of
        // one name may each carry a token (rotation), never different roles, or "bob"
        // would be an agent or an approver depending on which entry a lookup met first.
        let mut roles_by_name: HashMap<String, Vec<Role>> = HashMap::new();
        for config in configs {
            let principal = principal_from_config(config)?;
            let mut roles = principal.roles.clone();
            roles.sort();
            roles.dedup();
            match roles_by_name.get(&principal.name) {
                Some(known) if *known != roles => {
                    return Err(AuthError::ConflictingRoles {
                        name: principal.name,
                    });
                }
                Some(_) => {}
                None => {
                    roles_by_name.insert(principal.name.clone(), roles);
                }
            }
            let token_digest = config_digest(config)?;
            if let Some(existing) = table.by_digest.insert(token_digest, principal) {
                return Err(AuthError::DuplicateToken {
                    first: existing.name,
                    second: config.name.clone(),
                });
            }
        }
        Ok(table)
    }
}

/// `<data_dir>/token`: the generated local token.
pub fn token_file_path(data_dir: &Path) -> PathBuf {
    data_dir.join("token")
}

/// Reads the token file, creating it with a fresh random token (mode 0600) when absent.
pub fn ensure_token_file(path: &Path) -> Result<String, AuthError> {
    let file_err = |source| AuthError::TokenFile {
        path: path.to_owned(),
        source,
    };
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let token = text.trim().to_owned();
            if token.is_empty() {
                return Err(AuthError::EmptyTokenFile {
                    path: path.to_owned(),
                });
            }
            // Tighten a token file someone loosened; the token is a credential.
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(file_err)?;
            Ok(token)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut bytes = [0u8; 32];
            getrandom::fill(&mut bytes).map_err(|e| AuthError::Random(e.to_string()))?;
            let token = format!("alk_{}", hex::encode(bytes));
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(file_err)?;
            file.write_all(format!("{token}\n").as_bytes())
                .map_err(file_err)?;
            file.sync_all().map_err(file_err)?;
            Ok(token)
        }
        Err(e) => Err(file_err(e)),
    }
}

fn principal_from_config(config: &PrincipalConfig) -> Result<Principal, AuthError> {
    let bad = |reason: String| AuthError::BadPrincipal {
        name: config.name.clone(),
        reason,
    };
    validate_segment("principal name", &config.name).map_err(|e| bad(e.to_string()))?;
    let mut roles = Vec::new();
    for role in &config.roles {
        let parsed = Role::parse(role).ok_or_else(|| {
            bad(format!(
                "unknown role {role:?}; use \"agent\", \"approver\" or \"admin\""
            ))
        })?;
        roles.push(parsed);
    }
    if roles.is_empty() {
        return Err(bad(
            "has no roles; give it at least one of agent, approver, admin".into(),
        ));
    }
    Ok(Principal {
        name: config.name.clone(),
        roles,
    })
}

fn config_digest(config: &PrincipalConfig) -> Result<[u8; 32], AuthError> {
    match (&config.token_env, &config.token_sha256) {
        (Some(var), None) => match std::env::var(var) {
            Ok(token) if !token.trim().is_empty() => Ok(digest(token.trim())),
            _ => Err(AuthError::MissingTokenEnv {
                name: config.name.clone(),
                var: var.clone(),
            }),
        },
        (None, Some(hex_digest)) => {
            let bytes = hex::decode(hex_digest.trim()).map_err(|_| AuthError::BadDigest {
                name: config.name.clone(),
            })?;
            bytes.try_into().map_err(|_| AuthError::BadDigest {
                name: config.name.clone(),
            })
        }
        _ => Err(AuthError::BadPrincipal {
            name: config.name.clone(),
            reason: "set exactly one of token_env or token_sha256".to_owned(),
        }),
    }
}

/// The hex SHA-256 of a token, as `[[principals]] token_sha256` holds it.
pub(crate) fn token_sha256_hex(token: &str) -> String {
    hex::encode(digest(token))
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Extracts the token of an `Authorization: Bearer <token>` header value.
pub fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_token_file_is_private_and_stable() {
        let dir = tempfile::tempdir().unwrap();
        let table = Principals::load(&[], dir.path()).unwrap();
        let path = token_file_path(dir.path());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let token = std::fs::read_to_string(&path).unwrap();
        let principal = table.authenticate(token.trim()).unwrap();
        assert!(principal.has(Role::Approver));
        assert!(table.authenticate("wrong").is_none());
        let again = Principals::load(&[], dir.path()).unwrap();
        assert!(again.authenticate(token.trim()).is_some());
    }

    #[test]
    fn configured_digests_and_env_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let hex_digest = hex::encode(digest("s3cret"));
        let configs = vec![PrincipalConfig {
            name: "ci".into(),
            token_env: None,
            token_sha256: Some(hex_digest),
            roles: vec!["agent".into()],
        }];
        let table = Principals::load(&configs, dir.path()).unwrap();
        let p = table.authenticate("s3cret").unwrap();
        assert_eq!(p.name, "ci");
        assert!(!p.has(Role::Approver));
        let bad_role = vec![PrincipalConfig {
            roles: vec!["root".into()],
            ..configs[0].clone()
        }];
        assert!(Principals::load(&bad_role, dir.path()).is_err());
        let missing_env = vec![PrincipalConfig {
            name: "x".into(),
            token_env: Some("AIRLOCK_TEST_UNSET_VARIABLE".into()),
            token_sha256: None,
            roles: vec!["agent".into()],
        }];
        assert!(matches!(
            Principals::load(&missing_env, dir.path()),
            Err(AuthError::MissingTokenEnv { .. })
        ));
    }

    /// One name, two tokens: fine with the same roles (a token being rotated), refused
    /// with different ones, whose lookup by name would depend on hash order.
    #[test]
    fn a_name_configured_twice_keeps_one_set_of_roles() {
        let dir = tempfile::tempdir().unwrap();
        let config = |token: &str, roles: &[&str]| PrincipalConfig {
            name: "bob".into(),
            token_env: None,
            token_sha256: Some(hex::encode(digest(token))),
            roles: roles.iter().map(|r| (*r).to_owned()).collect(),
        };
        let rotating = [
            config("old", &["agent", "approver"]),
            config("new", &["approver", "agent"]),
        ];
        let table = Principals::load(&rotating, dir.path()).unwrap();
        assert_eq!(table.authenticate("old").unwrap().name, "bob");
        assert_eq!(table.authenticate("new").unwrap().name, "bob");
        let conflicting = [config("a", &["agent"]), config("b", &["approver"])];
        let e = Principals::load(&conflicting, dir.path())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("\"bob\" is configured twice"), "{e}");
    }

    #[test]
    fn header_failures_are_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let table = Principals::load(&[], dir.path()).unwrap();
        let token = std::fs::read_to_string(token_file_path(dir.path())).unwrap();
        let header = format!("Bearer {}", token.trim());
        assert_eq!(
            table.authenticate_header(Some(&header)).unwrap().name,
            "local"
        );
        assert_eq!(
            table.authenticate_header(None),
            Err(Unauthenticated::Missing)
        );
        assert_eq!(
            table.authenticate_header(Some("Basic abc")),
            Err(Unauthenticated::NotBearer)
        );
        assert_eq!(
            table.authenticate_header(Some("Bearer alk_wrong")),
            Err(Unauthenticated::InvalidToken)
        );
        for hint in [GENERATED_TOKEN_HINT, CONFIGURED_TOKEN_HINT] {
            assert!(
                hint.bytes()
                    .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
            );
        }
        assert!(table.token_hint().contains("<data_dir>/token"));
    }

    #[test]
    fn a_replaced_table_revokes_removed_principals_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let config = |name: &str, token: &str, roles: &[&str]| PrincipalConfig {
            name: name.into(),
            token_env: None,
            token_sha256: Some(hex::encode(digest(token))),
            roles: roles.iter().map(|r| (*r).to_owned()).collect(),
        };
        let table = Principals::load(
            &[
                config("ann", "ann-token", &["agent"]),
                config("bob", "bob-token", &["approver"]),
            ],
            dir.path(),
        )
        .unwrap();
        assert_eq!(table.names(), ["ann", "bob"]);
        assert!(table.by_name("ann").unwrap().has(Role::Agent));
        let reloaded = Principals::load(
            &[config("bob", "bob-token", &["approver", "agent"])],
            dir.path(),
        )
        .unwrap();
        table.replace(reloaded);
        assert!(table.authenticate("ann-token").is_none());
        assert!(table.by_name("ann").is_none());
        assert!(table.by_name("bob").unwrap().has(Role::Agent));
        assert_eq!(table.names(), ["bob"]);
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer"), None);
    }
}

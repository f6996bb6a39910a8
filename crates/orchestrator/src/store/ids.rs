//! The ids the store keys its rows by: a call's and an approval's, each its own type so
//! that one cannot be passed where the other is meant. Both are the plain text the gate
//! chose (`call_…`, `apr_…`); on the wire and in the audit log they are that string.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;

use serde::{Deserialize, Serialize};

macro_rules! text_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<String> for $name {
            fn from(id: String) -> Self {
                Self(id)
            }
        }

        impl From<&str> for $name {
            fn from(id: &str) -> Self {
                Self(id.to_owned())
            }
        }

        impl From<&String> for $name {
            fn from(id: &String) -> Self {
                Self(id.clone())
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> Self {
                id.0
            }
        }

        // Read-only access as text (logs, messages, `json!`, comparisons with what the
        // wire sent), so callers holding a `String` need no conversion to look at one.
        impl Deref for $name {
            type Target = str;

            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &self.0 == other
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, other: &$name) -> bool {
                self == other.0
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }
    };
}

text_id!(
    /// A call's id (`call_…`): the key of the `calls` table, and what workers
    /// deduplicate a re-dispatched call by.
    CallId
);

text_id!(
    /// An approval's id (`apr_…`): the key of the `approvals` table and the paging
    /// cursor of `GET /v1/approvals`.
    ApprovalId
);

/// A new id for a row of `calls` or `approvals`: `prefix` and a UUID version 7 as 32
/// hexadecimal digits — the time in milliseconds, then 74 random bits.
///
/// Time first, so that each new id sorts after the ones before it (within a millisecond,
/// in any order): the B-trees keyed by it (the table's primary key, the audit log's
/// `(call_id, seq)` index) grow at their right edge, where the last call's pages already
/// are, as every other index of a call does. A random id (version 4) sent each insert to a
/// page anywhere in those trees — one read when the store is larger than SQLite's cache,
/// and pages left about two thirds full by splits in their middle. The random part is
/// drawn afresh for every id (no counter carried from one id to the next, which the
/// crate's shared context would use), so an id says nothing about the ids made beside
/// it: it is as hard to guess as before but for the time, which the row records anyway.
///
/// The time is the store's clock ([`super::now_millis`]), which stamps the rows too.
pub fn fresh_id(prefix: &str) -> String {
    let millis = u64::try_from(super::now_millis()).unwrap_or(0);
    let time = uuid::Timestamp::from_unix(
        uuid::NoContext,
        millis / 1000,
        // Below 1000 × 1 000 000, so the conversion never fails.
        u32::try_from(millis % 1000 * 1_000_000).unwrap_or(0),
    );
    format!("{prefix}{}", uuid::Uuid::new_v7(time).simple())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_ids_sort_by_time_and_share_no_counter() {
        let first = fresh_id("call_");
        std::thread::sleep(std::time::Duration::from_millis(2));
        let ids: Vec<String> = (0..64).map(|_| fresh_id("call_")).collect();
        for id in &ids {
            assert!(id.starts_with("call_") && id.len() == 5 + 32, "{id}");
            assert!(id[5..].bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
            assert!(*id > first, "an id made later sorts after {first}: {id}");
            let uuid = uuid::Uuid::parse_str(&id[5..]).unwrap();
            assert_eq!(uuid.get_version_num(), 7);
        }
        // Made within the same millisecond or two, the ids differ in their random bits
        // well beyond a counter's step: no two consecutive ones are one apart.
        let unique: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!(unique.len(), ids.len());
        let low = |id: &str| u128::from_str_radix(&id[5..], 16).unwrap() & ((1u128 << 62) - 1);
        let close = ids
            .windows(2)
            .filter(|w| low(&w[1]).abs_diff(low(&w[0])) < 1 << 20)
            .count();
        assert_eq!(close, 0, "consecutive ids look counted: {ids:?}");
    }

    #[test]
    fn ids_are_their_text_on_the_wire() {
        let call = CallId::from("call_1");
        assert_eq!(serde_json::to_value(&call).unwrap(), "call_1");
        let back: ApprovalId = serde_json::from_value(serde_json::json!("apr_1")).unwrap();
        assert_eq!(back.as_str(), "apr_1");
        assert_eq!(back.to_string(), "apr_1");
        assert_eq!(call, "call_1");
        assert_eq!(String::from(call), "call_1");
    }
}

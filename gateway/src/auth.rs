//! API keys and what each may reach. A key is either scoped to named collections
//! (`KEY=coll1,coll2`: any other collection answers 404, as if it did not exist) or reaches
//! every collection (`KEY`); an admin key (`--admin-key`) reaches every collection and also
//! sees what `/health` shows nobody else (collection names, model file paths).

use crate::api::validate_collection;
use axum::http::{header, HeaderMap};
use std::sync::Arc;

/// One accepted bearer token and its reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub key: String,
    /// The collections it may use; `None`: every collection.
    pub collections: Option<Vec<String>>,
    pub admin: bool,
}

impl ApiKey {
    /// An admin key: every collection, and the details `/health` hides from others.
    pub fn admin(key: &str) -> Result<Self, String> {
        let mut k: Self = key.parse()?;
        if k.collections.is_some() {
            return Err("an admin key reaches every collection: drop its `=...` scope".into());
        }
        k.admin = true;
        Ok(k)
    }
}

impl std::str::FromStr for ApiKey {
    type Err = String;

    /// `KEY` (every collection) or `KEY=coll1,coll2`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (key, scope) = match s.split_once('=') {
            Some((k, c)) => (k, Some(c)),
            None => (s, None),
        };
        if key.is_empty() {
            return Err("an API key is empty".into());
        }
        if key.contains(',') {
            return Err(
                "an API key cannot contain `,`: separate keys with `;` (or repeat --api-key), \
                 scope one with KEY=coll1,coll2"
                    .into(),
            );
        }
        if key.chars().any(|c| !c.is_ascii_graphic()) {
            return Err("an API key must be printable ASCII without spaces".into());
        }
        let collections = match scope {
            None => None,
            Some(list) => {
                let names: Vec<String> = list.split(',').map(str::to_string).collect();
                for n in &names {
                    validate_collection("api-key", n).map_err(|e| e.to_string())?;
                }
                Some(names)
            }
        };
        Ok(Self {
            key: key.to_string(),
            collections,
            admin: false,
        })
    }
}

/// What one request may reach (from its key; everything when the server has no keys).
#[derive(Debug, Clone)]
pub struct Grant {
    collections: Option<Arc<[String]>>,
    pub admin: bool,
}

impl Grant {
    /// Everything (a server without keys).
    pub fn open() -> Self {
        Self {
            collections: None,
            admin: true,
        }
    }

    fn of(k: &ApiKey) -> Self {
        Self {
            collections: k.collections.as_deref().map(Arc::from),
            admin: k.admin,
        }
    }

    /// The collections within reach; `None`: every one.
    pub fn collections(&self) -> Option<&[String]> {
        self.collections.as_deref()
    }

    /// True when `collection` is within reach.
    pub fn allows(&self, collection: &str) -> bool {
        self.collections
            .as_ref()
            .is_none_or(|c| c.iter().any(|n| n == collection))
    }
}

/// The token of an `Authorization` value of the Bearer scheme, whose name is matched
/// case-insensitively (RFC 9110, section 11.1): `Bearer k`, `bearer k` and `BEARER k` alike.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
}

/// The grant of the bearer token in `headers`: `Some(open)` without keys, `None` when the
/// token is missing or matches no key. Every key is compared in full, so timing does not
/// reveal a matching prefix.
pub fn grant(keys: &[ApiKey], headers: &HeaderMap) -> Option<Grant> {
    if keys.is_empty() {
        return Some(Grant::open());
    }
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .unwrap_or("");
    let mut found = None;
    for k in keys {
        let same = k.key.len() == given.len()
            && k.key
                .bytes()
                .zip(given.bytes())
                .fold(0u8, |d, (a, b)| d | (a ^ b))
                == 0;
        if same && found.is_none() {
            found = Some(Grant::of(k));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    type R = Result<(), Box<dyn std::error::Error>>;

    #[test]
    fn keys_parse_with_their_scope_and_refuse_what_is_ambiguous() -> R {
        let k: ApiKey = "abc".parse()?;
        assert_eq!(k.collections, None);
        let k: ApiKey = "abc=docs,wiki".parse()?;
        assert_eq!(k.collections, Some(vec!["docs".into(), "wiki".into()]));
        for bad in ["", "=docs", "a,b", "abc=", "abc=bad name", "a b"] {
            assert!(bad.parse::<ApiKey>().is_err(), "{bad:?}");
        }
        assert!(ApiKey::admin("root=docs").is_err());
        assert!(ApiKey::admin("root")?.admin);
        Ok(())
    }

    #[test]
    fn a_grant_follows_the_key() -> R {
        let keys: Vec<ApiKey> = vec!["a=docs".parse()?, ApiKey::admin("r")?];
        let mut h = HeaderMap::new();
        assert!(grant(&keys, &h).is_none());
        h.insert(header::AUTHORIZATION, "Bearer a".parse()?);
        let g = grant(&keys, &h).ok_or("no grant")?;
        assert!(g.allows("docs") && !g.allows("wiki") && !g.admin);
        h.insert(header::AUTHORIZATION, "Bearer r".parse()?);
        let g = grant(&keys, &h).ok_or("no grant")?;
        assert!(g.allows("wiki") && g.admin);
        h.insert(header::AUTHORIZATION, "Bearer x".parse()?);
        assert!(grant(&keys, &h).is_none());
        assert!(grant(&[], &HeaderMap::new()).is_some_and(|g| g.admin));
        Ok(())
    }

    #[test]
    fn the_bearer_scheme_is_matched_whatever_its_case() -> R {
        let keys: Vec<ApiKey> = vec!["a".parse()?];
        let mut h = HeaderMap::new();
        for ok in ["bearer a", "BEARER a", "Bearer  a"] {
            h.insert(header::AUTHORIZATION, ok.parse()?);
            assert!(grant(&keys, &h).is_some(), "{ok:?}");
        }
        for bad in ["Basic a", "Bearera", "a", "Bearer", "Bearer b"] {
            h.insert(header::AUTHORIZATION, bad.parse()?);
            assert!(grant(&keys, &h).is_none(), "{bad:?}");
        }
        Ok(())
    }
}

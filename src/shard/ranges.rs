//! Sharding by namespace, the pure part: the hash the API server uses for
//! `shardSelector` (64-bit FNV-1a of the namespace name, KEP-5866), sets of hash ranges
//! and their wire form, and what `/status` shows. (The assignment of ranges to replicas
//! is the pure [`super::plan`].)
//!
//! Why ranges are cut at load quantiles and not in equal slices: FNV-1a clusters similar
//! names in its high bits (`team-a` … `team-z` all land in the top quarter of the space),
//! so equal slices would give one replica nearly everything. The coordinator knows every
//! namespace and its parent count, so it cuts where the load is.

/// What `/status` shows of the sharding.
#[derive(Clone, Debug, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardStatus {
    pub mode: String,
    pub identity: String,
    pub coordinator: Option<String>,
    pub generation: u64,
    pub members: Vec<String>,
    pub ranges: String,
    pub percent_of_hash_space: f64,
    pub waiting_for: Vec<String>,
    /// Namespaces (by hash) too large for one member's fair share.
    pub oversized: Vec<String>,
}

/// Where the hash space ends (exclusive): 2^64.
pub const TOP: u128 = 1 << 64;

/// The 64-bit FNV-1a hash of `s`, as the API server computes it for `shardRange`.
pub fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A set of half-open hash ranges `[start, end)` within `[0, 2^64)`, sorted, disjoint
/// and not touching (adjacent ranges are merged).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ranges(Vec<(u128, u128)>);

impl Ranges {
    pub fn none() -> Ranges {
        Ranges(Vec::new())
    }

    pub fn all() -> Ranges {
        Ranges(vec![(0, TOP)])
    }

    /// The set of the given ranges (empty and out-of-space parts dropped).
    pub fn of(ranges: impl IntoIterator<Item = (u128, u128)>) -> Ranges {
        let mut v: Vec<(u128, u128)> = ranges
            .into_iter()
            .map(|(s, e)| (s.min(TOP), e.min(TOP)))
            .filter(|(s, e)| s < e)
            .collect();
        v.sort_unstable();
        let mut out: Vec<(u128, u128)> = Vec::with_capacity(v.len());
        for (s, e) in v {
            match out.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => out.push((s, e)),
            }
        }
        Ranges(out)
    }

    pub fn spans(&self) -> &[(u128, u128)] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, hash: u64) -> bool {
        let h = u128::from(hash);
        self.0.iter().any(|(s, e)| *s <= h && h < *e)
    }

    /// Whether objects in namespace `ns` fall in this set.
    pub fn holds_namespace(&self, ns: &str) -> bool {
        self.contains(fnv1a(ns))
    }

    pub fn union(&self, other: &Ranges) -> Ranges {
        Ranges::of(self.0.iter().chain(&other.0).copied())
    }

    pub fn intersect(&self, other: &Ranges) -> Ranges {
        let mut out = Vec::new();
        for (a, b) in &self.0 {
            for (c, d) in &other.0 {
                let (s, e) = ((*a).max(*c), (*b).min(*d));
                if s < e {
                    out.push((s, e));
                }
            }
        }
        Ranges::of(out)
    }

    pub fn minus(&self, other: &Ranges) -> Ranges {
        let mut out = Vec::new();
        for &(mut s, e) in &self.0 {
            for &(c, d) in &other.0 {
                if d <= s || c >= e {
                    continue;
                }
                if c > s {
                    out.push((s, c));
                }
                s = s.max(d);
                if s >= e {
                    break;
                }
            }
            if s < e {
                out.push((s, e));
            }
        }
        Ranges::of(out)
    }

    /// The fraction of the hash space this set covers, in percent (for `/status`).
    pub fn percent(&self) -> f64 {
        let covered: u128 = self.0.iter().map(|(s, e)| e - s).sum();
        covered as f64 * 100.0 / TOP as f64
    }

    /// The API server's `shardSelector` for these ranges over the namespace hash, or
    /// `None` for the empty set (which has no selector: a replica without ranges runs no
    /// sharded cache at all).
    pub fn selector(&self) -> Option<String> {
        if self.0.is_empty() {
            return None;
        }
        Some(
            self.0
                .iter()
                .map(|(s, e)| {
                    format!(
                        "shardRange(object.metadata.namespace, '{}', '{}')",
                        hex(*s),
                        hex(*e)
                    )
                })
                .collect::<Vec<_>>()
                .join(" || "),
        )
    }

    /// The compact text form kept in the assignment: `start-end,start-end` in hex.
    pub fn encode(&self) -> String {
        self.0
            .iter()
            .map(|(s, e)| format!("{}-{}", hex(*s), hex(*e)))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn decode(text: &str) -> Result<Ranges, ShardError> {
        let mut v = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (s, e) = part
                .split_once('-')
                .ok_or_else(|| ShardError::BadRange(part.to_string()))?;
            let (s, e) = (unhex(s, part)?, unhex(e, part)?);
            if s >= e || e > TOP {
                return Err(ShardError::BadRange(part.to_string()));
            }
            v.push((s, e));
        }
        Ok(Ranges::of(v))
    }
}

/// `0x` and 16 lowercase hex digits (17 for 2^64), the form the API server compares.
fn hex(v: u128) -> String {
    format!("0x{v:016x}")
}

fn unhex(s: &str, part: &str) -> Result<u128, ShardError> {
    let digits = s
        .trim()
        .strip_prefix("0x")
        .ok_or_else(|| ShardError::BadRange(part.to_string()))?;
    u128::from_str_radix(digits, 16).map_err(|_| ShardError::BadRange(part.to_string()))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShardError {
    #[error("not a hash range: {0:?}")]
    BadRange(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_the_api_servers() {
        // Go: fmt.Sprintf("%016x", fnv.New64a().Sum64()) of these strings.
        assert_eq!(fnv1a(""), 0xcbf29ce484222325);
        assert_eq!(fnv1a("a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a("foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn similar_names_cluster_in_the_hash_space() {
        // The reason for load quantiles (the measurement, checked).
        let top_quarter = (b'a'..=b'z')
            .map(|c| fnv1a(&format!("team-{}", c as char)))
            .filter(|h| *h >= 3 << 62)
            .count();
        assert_eq!(top_quarter, 26);
    }

    #[test]
    fn set_algebra() {
        let a = Ranges::of([(0, 10), (20, 30)]);
        let b = Ranges::of([(5, 25)]);
        assert_eq!(a.intersect(&b), Ranges::of([(5, 10), (20, 25)]));
        assert_eq!(a.minus(&b), Ranges::of([(0, 5), (25, 30)]));
        assert_eq!(a.union(&b), Ranges::of([(0, 30)]));
        assert_eq!(Ranges::all().minus(&Ranges::all()), Ranges::none());
        assert!(Ranges::of([(0, 10)]).contains(9));
        assert!(!Ranges::of([(0, 10)]).contains(10));
        assert!(Ranges::all().contains(u64::MAX));
    }

    #[test]
    fn wire_forms() {
        let r = Ranges::of([(0, 1 << 63), (3 << 62, TOP)]);
        assert_eq!(
            r.selector().as_deref(),
            Some(
                "shardRange(object.metadata.namespace, '0x0000000000000000', '0x8000000000000000') || shardRange(object.metadata.namespace, '0xc000000000000000', '0x10000000000000000')"
            )
        );
        assert_eq!(Ranges::decode(&r.encode()), Ok(r));
        assert_eq!(Ranges::decode(""), Ok(Ranges::none()));
        assert!(Ranges::decode("0x10-0x5").is_err());
        assert!(Ranges::decode("zz").is_err());
        assert_eq!(Ranges::none().selector(), None);
        assert!((Ranges::of([(0, 1 << 62)]).percent() - 25.0).abs() < 1e-9);
    }
}

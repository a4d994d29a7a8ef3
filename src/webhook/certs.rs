//! The webhook's certificates: a CA and a serving certificate it signs, and the pure
//! schedule that renews them ([`next`]). No I/O: `store.rs` keeps the result in a Secret
//! that every replica reads, and decides nothing itself.
//!
//! Generated with `rcgen` (rustls' own certificate generator; ECDSA P-256 keys through
//! `ring`, the provider rustls already uses here for the API client, so no second crypto
//! library). A signing CA is rebuilt from its key alone ([`authority`]): its subject is
//! derived from its public key, so no X.509 parser (rcgen's `x509-parser` feature) is
//! needed to sign with a CA read back from the Secret.
//!
//! The schedule, every time in seconds since the epoch:
//! - no bundle, or its CA expired: a new CA and serving certificate (`fresh`);
//! - the serving certificate past 2/3 of its lifetime, for other host names, or from
//!   another CA: a new one from the current CA. Both are trusted: a replica that still
//!   serves the old one is fine;
//! - the CA past 2/3 of its lifetime: a new CA joins the trusted bundle while the old
//!   CA's serving certificate still serves (`Adding`); once every live replica confirms
//!   it trusts the new CA, a serving certificate from the new CA (`Dropping`); once every
//!   live replica confirms it serves that one, the old CA leaves the bundle (`Stable`).
//!   The API server trusts whatever a replica serves at every step.
//!
//! The confirmations ([`Confirmation`]): while a rotation is under way, every replica
//! records what it serves and trusts, and repeats it every third of `settle` (store.rs);
//! a record older than `settle` is a replica gone. A step waits at least `settle` after
//! the one before, so that every live replica has spoken (each reads the Secret every
//! refresh, a third of `settle` at most), and then for every live record to confirm it:
//! a replica that still serves the old CA's certificate keeps the old CA in the bundle
//! for as long as it keeps saying so. With no record at all (replicas of a version that
//! writes none) a step advances on time, as before.

use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType,
};
use sha2::{Digest, Sha256};

/// A certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("cannot generate a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("host name {0:?} cannot be put in a certificate")]
    Name(String),
    #[error("time {0} is out of range")]
    Time(i64),
}

/// Where the CA rotation stands (see the module header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// One CA, trusted and signing the serving certificate.
    Stable,
    /// A new CA is trusted beside the old one, whose serving certificate still serves.
    Adding,
    /// The serving certificate is the new CA's; the old CA is still trusted.
    Dropping,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Stable => "Stable",
            Phase::Adding => "Adding",
            Phase::Dropping => "Dropping",
        }
    }

    pub fn parse(s: &str) -> Option<Phase> {
        [Phase::Stable, Phase::Adding, Phase::Dropping]
            .into_iter()
            .find(|p| p.as_str() == s)
    }
}

/// Everything the Secret holds: PEM texts and the schedule's times.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bundle {
    /// The CA that signs new serving certificates.
    pub ca_cert: String,
    pub ca_key: String,
    pub ca_issued: i64,
    pub ca_expires: i64,
    /// The serving certificate every replica serves, and its key.
    pub tls_cert: String,
    pub tls_key: String,
    pub tls_issued: i64,
    pub tls_expires: i64,
    /// The host names and addresses it is valid for.
    pub tls_names: Vec<String>,
    /// [`fingerprint`] of the CA certificate that signed it.
    pub tls_ca: String,
    /// The CAs the API server must trust (`caBundle`): one, or two during a rotation.
    pub trusted: String,
    pub phase: Phase,
    pub phase_since: i64,
}

/// What one replica said it serves and trusts, and when (seconds since the epoch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Confirmation {
    /// [`fingerprint`] of the CA that signed the certificate it serves.
    pub serving: String,
    /// [`fingerprint`]s of the CAs in the bundle it publishes (`caBundle`).
    pub trusted: Vec<String>,
    pub at: i64,
}

impl Confirmation {
    /// What a replica serving `b` confirms at `at`.
    pub fn of(b: &Bundle, at: i64) -> Confirmation {
        Confirmation {
            serving: b.tls_ca.clone(),
            trusted: fingerprints(&b.trusted),
            at,
        }
    }

    /// The same statement, whatever its time.
    pub fn says_the_same(&self, other: &Confirmation) -> bool {
        self.serving == other.serving && self.trusted == other.trusted
    }
}

/// The [`fingerprint`] of each certificate in a PEM bundle.
pub fn fingerprints(bundle: &str) -> Vec<String> {
    const END: &str = "-----END CERTIFICATE-----";
    let mut out = Vec::new();
    let mut rest = bundle;
    while let (Some(b), Some(e)) = (rest.find("-----BEGIN CERTIFICATE-----"), rest.find(END)) {
        if e < b {
            rest = &rest[e + END.len()..];
            continue;
        }
        out.push(fingerprint(&rest[b..e + END.len()]));
        rest = &rest[e + END.len()..];
    }
    out
}

/// Whether every replica live at `now` (its record younger than `settle`) says `ok`.
fn confirmed(
    replicas: &[Confirmation],
    now: i64,
    settle: i64,
    ok: impl Fn(&Confirmation) -> bool,
) -> bool {
    replicas
        .iter()
        .filter(|c| c.at > now.saturating_sub(settle))
        .all(ok)
}

/// How long certificates live and how the rotation waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub ca_validity: Duration,
    pub tls_validity: Duration,
    /// The least time between rotation steps, and the age at which a replica's
    /// confirmation means it is gone (module header).
    pub settle: Duration,
    /// The serving certificate's host names and IP addresses.
    pub names: Vec<String>,
}

/// A short, stable name of a PEM text (SHA-256, hex, 16 characters).
pub fn fingerprint(pem: &str) -> String {
    hex::encode(&Sha256::digest(pem.trim().as_bytes())[..8])
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX / 4)
}

fn time(t: i64) -> Result<time::OffsetDateTime, CertError> {
    time::OffsetDateTime::from_unix_timestamp(t).map_err(|_| CertError::Time(t))
}

/// Past 2/3 of the lifetime from `issued` to `expires`.
pub fn due(issued: i64, expires: i64, now: i64) -> bool {
    now >= issued.saturating_add(expires.saturating_sub(issued).saturating_mul(2) / 3)
}

/// A CA's parameters, rebuilt from its key: the subject names the key, so a CA read back
/// from the Secret signs with exactly the issuer name its certificate carries.
fn ca_params(key: &KeyPair) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "rulebook");
    dn.push(
        DnType::CommonName,
        format!(
            "rulebook webhook CA {}",
            hex::encode(&Sha256::digest(key.der_bytes())[..6])
        ),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

/// The issuer of a CA whose key is `ca_key` (PEM).
fn authority(ca_key: &str) -> Result<Issuer<'static, KeyPair>, CertError> {
    let key = KeyPair::from_pem(ca_key)?;
    Ok(Issuer::new(ca_params(&key), key))
}

/// A certificate and its key, PEM, with its validity.
pub struct Issued {
    pub cert: String,
    pub key: String,
    pub issued: i64,
    pub expires: i64,
}

/// Certificates are valid from a minute before they are made, for clocks a little behind.
const BACKDATE: i64 = 60;

/// A new self-signed CA valid for `validity` from `now`.
pub fn new_ca(now: i64, validity: Duration) -> Result<Issued, CertError> {
    let key = KeyPair::generate()?;
    let mut params = ca_params(&key);
    let expires = now.saturating_add(secs(validity));
    params.not_before = time(now - BACKDATE)?;
    params.not_after = time(expires)?;
    let cert = params.self_signed(&key)?;
    Ok(Issued {
        cert: cert.pem(),
        key: key.serialize_pem(),
        issued: now,
        expires,
    })
}

/// A serving certificate for `names`, signed by the CA whose key is `ca_key`, valid for
/// `validity` from `now` but not past `cap` (the CA's own expiry).
pub fn new_serving(
    ca_key: &str,
    names: &[String],
    now: i64,
    validity: Duration,
    cap: i64,
) -> Result<Issued, CertError> {
    let issuer = authority(ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    for name in names {
        let san = match name.parse::<std::net::IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(
                name.clone()
                    .try_into()
                    .map_err(|_| CertError::Name(name.clone()))?,
            ),
        };
        params.subject_alt_names.push(san);
    }
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        names.first().cloned().unwrap_or_else(|| "rulebook".into()),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::NoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let expires = now.saturating_add(secs(validity)).min(cap);
    params.not_before = time(now - BACKDATE)?;
    params.not_after = time(expires)?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Issued {
        cert: cert.pem(),
        key: key.serialize_pem(),
        issued: now,
        expires,
    })
}

/// A new CA and a serving certificate from it.
fn fresh(policy: &Policy, now: i64) -> Result<Bundle, CertError> {
    let ca = new_ca(now, policy.ca_validity)?;
    let tls = new_serving(&ca.key, &policy.names, now, policy.tls_validity, ca.expires)?;
    Ok(Bundle {
        tls_ca: fingerprint(&ca.cert),
        trusted: ca.cert.clone(),
        ca_cert: ca.cert,
        ca_key: ca.key,
        ca_issued: ca.issued,
        ca_expires: ca.expires,
        tls_cert: tls.cert,
        tls_key: tls.key,
        tls_issued: tls.issued,
        tls_expires: tls.expires,
        tls_names: policy.names.clone(),
        phase: Phase::Stable,
        phase_since: now,
    })
}

/// `b` with a new serving certificate from its current CA.
fn reissue(b: &Bundle, policy: &Policy, now: i64) -> Result<Bundle, CertError> {
    let tls = new_serving(
        &b.ca_key,
        &policy.names,
        now,
        policy.tls_validity,
        b.ca_expires,
    )?;
    Ok(Bundle {
        tls_cert: tls.cert,
        tls_key: tls.key,
        tls_issued: tls.issued,
        tls_expires: tls.expires,
        tls_names: policy.names.clone(),
        tls_ca: fingerprint(&b.ca_cert),
        ..b.clone()
    })
}

/// The bundle to write now, or `None` when `current` needs no change (module header),
/// given what the replicas confirmed.
pub fn next(
    current: Option<&Bundle>,
    policy: &Policy,
    now: i64,
    replicas: &[Confirmation],
) -> Result<Option<Bundle>, CertError> {
    let Some(b) = current else {
        return fresh(policy, now).map(Some);
    };
    if b.ca_expires <= now {
        return fresh(policy, now).map(Some);
    }
    let settle = secs(policy.settle);
    let settled = now >= b.phase_since.saturating_add(settle);
    let signing = fingerprint(&b.ca_cert);
    let trusted_everywhere =
        settled && confirmed(replicas, now, settle, |c| c.trusted.contains(&signing));
    let served_everywhere = settled && confirmed(replicas, now, settle, |c| c.serving == signing);
    let tls_stale =
        due(b.tls_issued, b.tls_expires, now) || b.tls_names != policy.names || b.tls_ca != signing;
    match b.phase {
        Phase::Stable if due(b.ca_issued, b.ca_expires, now) => {
            let ca = new_ca(now, policy.ca_validity)?;
            Ok(Some(Bundle {
                trusted: format!("{}\n{}", b.ca_cert.trim_end(), ca.cert),
                ca_cert: ca.cert,
                ca_key: ca.key,
                ca_issued: ca.issued,
                ca_expires: ca.expires,
                phase: Phase::Adding,
                phase_since: now,
                ..b.clone()
            }))
        }
        Phase::Stable if tls_stale => reissue(b, policy, now).map(Some),
        Phase::Stable => Ok(None),
        // The old CA's certificate serves until the new CA is trusted everywhere.
        Phase::Adding if trusted_everywhere => {
            let mut n = reissue(b, policy, now)?;
            n.phase = Phase::Dropping;
            n.phase_since = now;
            Ok(Some(n))
        }
        Phase::Adding => Ok(None),
        Phase::Dropping if served_everywhere => Ok(Some(Bundle {
            trusted: b.ca_cert.clone(),
            phase: Phase::Stable,
            phase_since: now,
            ..b.clone()
        })),
        Phase::Dropping if tls_stale => reissue(b, policy, now).map(Some),
        Phase::Dropping => Ok(None),
    }
}

/// Seconds from `now` until [`next`] may have something to do for `b`.
pub fn until_next(b: &Bundle, policy: &Policy, now: i64) -> i64 {
    let tls = b.tls_issued + (b.tls_expires - b.tls_issued) * 2 / 3;
    let ca = b.ca_issued + (b.ca_expires - b.ca_issued) * 2 / 3;
    let step = match b.phase {
        Phase::Stable => tls.min(ca),
        // Past `settle`, waiting for confirmations: look again every second.
        Phase::Adding => b
            .phase_since
            .saturating_add(secs(policy.settle))
            .max(now + 1),
        Phase::Dropping => tls.min(
            b.phase_since
                .saturating_add(secs(policy.settle))
                .max(now + 1),
        ),
    };
    (step - now).max(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy {
            ca_validity: Duration::from_secs(300),
            tls_validity: Duration::from_secs(90),
            settle: Duration::from_secs(10),
            names: vec!["127.0.0.1".into(), "rulebook.ns.svc".into()],
        }
    }

    #[test]
    fn a_fresh_bundle_trusts_the_ca_that_signed_its_certificate() {
        let b = next(None, &policy(), 1_000, &[]).unwrap().unwrap();
        assert_eq!(b.trusted, b.ca_cert);
        assert_eq!(b.tls_ca, fingerprint(&b.ca_cert));
        assert_eq!((b.tls_expires, b.ca_expires), (1_090, 1_300));
        assert!(b.tls_cert.starts_with("-----BEGIN CERTIFICATE-----"));
        assert_eq!(next(Some(&b), &policy(), 1_010, &[]).unwrap(), None);
    }

    #[test]
    fn the_serving_certificate_is_renewed_at_two_thirds_of_its_life() {
        let p = policy();
        let b = next(None, &p, 1_000, &[]).unwrap().unwrap();
        assert_eq!(next(Some(&b), &p, 1_059, &[]).unwrap(), None);
        let n = next(Some(&b), &p, 1_060, &[]).unwrap().expect("renewed");
        assert_ne!(n.tls_cert, b.tls_cert);
        assert_eq!(
            (n.ca_cert.clone(), n.trusted.clone()),
            (b.ca_cert.clone(), b.trusted.clone())
        );
        assert_eq!(n.tls_expires, 1_150);
    }

    #[test]
    fn other_host_names_get_a_new_certificate() {
        let mut p = policy();
        let b = next(None, &p, 1_000, &[]).unwrap().unwrap();
        p.names = vec!["localhost".into()];
        let n = next(Some(&b), &p, 1_001, &[]).unwrap().expect("reissued");
        assert_eq!(n.tls_names, vec!["localhost".to_string()]);
    }

    /// The CA rotation keeps whatever any replica serves trusted at every step.
    #[test]
    fn a_ca_rotation_trusts_old_and_new_until_the_new_certificate_serves() {
        let p = policy();
        let b = next(None, &p, 1_000, &[]).unwrap().unwrap();
        // Keep the serving certificate fresh until the CA is due (at 1,200).
        let mut cur = b.clone();
        let mut t = 1_000;
        while cur.phase == Phase::Stable && cur.ca_cert == b.ca_cert {
            t += 5;
            if let Some(n) = next(Some(&cur), &p, t, &[]).unwrap() {
                cur = n;
            }
        }
        assert_eq!((t, cur.phase), (1_200, Phase::Adding));
        let old_ca = b.ca_cert.clone();
        assert!(cur.trusted.contains(old_ca.trim()) && cur.trusted.contains(cur.ca_cert.trim()));
        assert_eq!(
            cur.tls_ca,
            fingerprint(&old_ca),
            "the old CA's certificate still serves"
        );
        assert_eq!(
            next(Some(&cur), &p, 1_209, &[]).unwrap(),
            None,
            "waits to settle"
        );
        let dropping = next(Some(&cur), &p, 1_210, &[])
            .unwrap()
            .expect("new certificate");
        assert_eq!(dropping.phase, Phase::Dropping);
        assert_eq!(dropping.tls_ca, fingerprint(&dropping.ca_cert));
        assert!(
            dropping.trusted.contains(old_ca.trim()),
            "old CA kept while replicas switch"
        );
        assert_eq!(next(Some(&dropping), &p, 1_215, &[]).unwrap(), None);
        let stable = next(Some(&dropping), &p, 1_220, &[])
            .unwrap()
            .expect("old CA dropped");
        assert_eq!(stable.phase, Phase::Stable);
        assert_eq!(stable.trusted, stable.ca_cert);
        assert!(stable.ca_expires > 1_220 + 200);
    }

    /// A rotation starting now: `(the Adding bundle, the old CA's fingerprint)`.
    fn adding_at(t: i64) -> (Bundle, String) {
        let p = policy();
        let b = next(None, &p, t - 200, &[]).unwrap().unwrap();
        let adding = next(Some(&b), &p, t, &[]).unwrap().unwrap();
        assert_eq!(adding.phase, Phase::Adding);
        (adding, fingerprint(&b.ca_cert))
    }

    /// Each step waits for every live replica's confirmation; a replica silent for
    /// longer than `settle` is gone and holds nothing back.
    #[test]
    fn a_step_waits_for_every_live_replica_to_confirm_it() {
        let p = policy();
        let (adding, old) = adding_at(1_200);
        let new = fingerprint(&adding.ca_cert);
        assert_eq!(
            fingerprints(&adding.trusted),
            vec![old.clone(), new.clone()]
        );
        let a = Confirmation::of(&adding, 1_205);
        assert_eq!((a.serving.as_str(), a.trusted.len()), (old.as_str(), 2));
        // A replica still on the bundle before the rotation (trusting the old CA only).
        let behind = Confirmation {
            serving: old.clone(),
            trusted: vec![old.clone()],
            at: 1_208,
        };
        let at = |c: &Confirmation, t: i64| Confirmation { at: t, ..c.clone() };
        assert_eq!(
            next(Some(&adding), &p, 1_209, std::slice::from_ref(&a)).unwrap(),
            None,
            "not yet settled"
        );
        assert_eq!(
            next(Some(&adding), &p, 1_212, &[a.clone(), behind.clone()]).unwrap(),
            None,
            "a live replica does not trust the new CA yet"
        );
        let dropping = next(Some(&adding), &p, 1_212, &[a.clone(), at(&a, 1_211)])
            .unwrap()
            .expect("every live replica trusts both");
        assert_eq!(dropping.phase, Phase::Dropping);
        // Gone: its last word is older than `settle`.
        assert!(
            next(Some(&adding), &p, 1_219, &[a.clone(), behind.clone()])
                .unwrap()
                .is_some()
        );

        // Dropping: the old CA stays while a live replica serves its certificate.
        let switched = Confirmation::of(&dropping, 1_215);
        assert_eq!(switched.serving, new);
        let still_old = at(&a, 1_219);
        for t in [1_222, 1_225, 1_228] {
            let keeps_saying = at(&still_old, t - 2);
            assert_eq!(
                next(
                    Some(&dropping),
                    &p,
                    t,
                    &[at(&switched, t - 1), keeps_saying]
                )
                .unwrap(),
                None,
                "old CA kept at {t}: a live replica serves its certificate"
            );
        }
        let stable = next(
            Some(&dropping),
            &p,
            1_230,
            &[at(&switched, 1_229), still_old],
        )
        .unwrap()
        .expect("the replica on the old certificate went silent: gone");
        assert_eq!(
            (stable.phase, fingerprints(&stable.trusted)),
            (Phase::Stable, vec![new])
        );
    }

    #[test]
    fn an_expired_ca_starts_over() {
        let p = policy();
        let b = next(None, &p, 1_000, &[]).unwrap().unwrap();
        let n = next(Some(&b), &p, 1_300, &[]).unwrap().expect("fresh");
        assert_ne!(n.ca_cert, b.ca_cert);
        assert_eq!(n.phase, Phase::Stable);
    }

    #[test]
    fn the_ca_is_rebuilt_from_its_key_with_the_same_subject() {
        let ca = new_ca(1_000, Duration::from_secs(100)).unwrap();
        let key = KeyPair::from_pem(&ca.key).unwrap();
        let again = ca_params(&key);
        let first = ca_params(&KeyPair::from_pem(&ca.key).unwrap());
        let names = |p: &CertificateParams| {
            format!("{:?}", p.distinguished_name.iter().collect::<Vec<_>>())
        };
        assert_eq!(names(&again), names(&first));
        let leaf = new_serving(
            &ca.key,
            &["127.0.0.1".into()],
            1_000,
            Duration::from_secs(50),
            ca.expires,
        )
        .unwrap();
        assert_eq!(leaf.expires, 1_050);
        let capped = new_serving(
            &ca.key,
            &["a.b".into()],
            1_000,
            Duration::from_secs(500),
            ca.expires,
        )
        .unwrap();
        assert_eq!(capped.expires, 1_100, "never past the CA");
    }
}

//! The HTTP endpoint against hostile clients, on loopback (no cluster): a client that
//! sends half a request, or trickles it byte by byte, is disconnected after the header
//! timeout; a kept-alive connection is closed after the connection lifetime; at the
//! connection limit further clients wait until a slot frees, and are then served.
//!
//! Each test serves with short limits so that it runs in seconds; the production limits
//! (`HttpLimits::default()`) are the same code with other numbers. The time bounds are
//! not speed claims but tell which timer acted (a 1 s limit against a 30 or 60 s one,
//! so 0.8-5 s); they allow for a loaded machine but fail when a limit is not enforced at
//! all. Each measured time is printed.

#[path = "common/http_get.rs"]
mod http_get;

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use http_get::http_get;
use rulebook::engine::EngineStatus;
use rulebook::http::{AppState, HttpLimits, RuleSetState, router, serve_on};
use rulebook::metrics::Metrics;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Serves the real router with `limits` on a loopback port; returns `host:port`.
async fn endpoint(limits: HttpLimits) -> String {
    let state = AppState {
        metrics: Arc::new(Metrics::new()),
        engine: Arc::new(EngineStatus::default()),
        ruleset: Arc::new(RwLock::new(RuleSetState::default())),
        leader: Arc::new(|| true),
        sharding: None,
        webhook: None,
        git: None,
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    tokio::spawn(serve_on(listener, router(state), limits));
    addr
}

/// Reads until the server closes the connection (or `bound` passes); returns what was
/// read and when the connection closed, `None` when it was still open after `bound`.
async fn read_until_closed(s: &mut TcpStream, bound: Duration) -> (String, Option<Duration>) {
    let start = Instant::now();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(bound, async {
        let mut chunk = [0u8; 4096];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .is_ok();
    (
        String::from_utf8_lossy(&buf).to_string(),
        closed.then(|| start.elapsed()),
    )
}

const HALF_REQUEST: &[u8] = b"GET /status HTTP/1.1\r\nHost: x\r\n";

#[tokio::test]
async fn half_a_request_is_closed_after_the_header_timeout() {
    let addr = endpoint(HttpLimits {
        header_read: Duration::from_secs(1),
        connection: Duration::from_secs(60),
        max_connections: 8,
        per_client: 8,
    })
    .await;
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    s.write_all(HALF_REQUEST).await.expect("write");
    let (answer, closed) = read_until_closed(&mut s, Duration::from_secs(10)).await;
    let closed = closed.expect("the server closes a half-sent request");
    println!("half a request closed after {closed:?}");
    assert!(
        closed >= Duration::from_millis(800) && closed < Duration::from_secs(5),
        "closed after {closed:?}; the header timeout is 1s"
    );
    assert!(
        !answer.contains("200 OK"),
        "no answer to half a request: {answer}"
    );
    // The endpoint still serves complete requests.
    assert_eq!(
        http_get(&format!("http://{addr}/healthz")).await,
        Ok("ok".into())
    );
}

#[tokio::test]
async fn a_request_trickled_byte_by_byte_is_closed_after_the_header_timeout() {
    let addr = endpoint(HttpLimits {
        header_read: Duration::from_secs(1),
        connection: Duration::from_secs(60),
        max_connections: 8,
        per_client: 8,
    })
    .await;
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    let start = Instant::now();
    // A header that never ends, one byte every 100 ms: each byte is progress, but the
    // whole header must arrive within the timeout.
    let mut header = b"GET /status HTTP/1.1\r\nX-Slow: ".to_vec();
    header.extend(std::iter::repeat_n(b'a', 200));
    let mut closed_after = None;
    for b in header {
        if s.write_all(&[b]).await.is_err() {
            closed_after = Some(start.elapsed());
            break;
        }
        let mut probe = [0u8; 512];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(100), s.read(&mut probe)).await
        {
            closed_after = Some(start.elapsed());
            break;
        }
    }
    let closed = closed_after.expect("the server closes a trickling client");
    println!("a trickling client closed after {closed:?}");
    assert!(
        closed < Duration::from_secs(5),
        "closed after {closed:?}; the header timeout is 1s"
    );
}

#[tokio::test]
async fn a_kept_alive_connection_ends_after_the_connection_lifetime() {
    let addr = endpoint(HttpLimits {
        header_read: Duration::from_secs(30),
        connection: Duration::from_secs(1),
        max_connections: 8,
        per_client: 8,
    })
    .await;
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let (answer, closed) = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let closed = closed.expect("the server closes a kept-alive connection");
    println!("a kept-alive connection closed after {closed:?}");
    assert!(
        closed >= Duration::from_millis(800) && closed < Duration::from_secs(5),
        "closed after {closed:?}; the lifetime is 1s (the header timeout 30s)"
    );
}

#[tokio::test]
async fn at_the_connection_limit_new_clients_wait_for_a_slot() {
    let addr = endpoint(HttpLimits {
        header_read: Duration::from_secs(2),
        connection: Duration::from_secs(60),
        max_connections: 2,
        per_client: 2,
    })
    .await;
    let mut holders = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(&addr).await.expect("connect");
        s.write_all(HALF_REQUEST).await.expect("write");
        holders.push(s);
    }
    // Time for the server to accept the two holders before the third client connects:
    // nothing a client can wait on tells that a connection was accepted and counted.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let start = Instant::now();
    let answer = http_get(&format!("http://{addr}/healthz")).await;
    let waited = start.elapsed();
    println!("a client at the limit waited {waited:?} for a slot");
    assert_eq!(answer, Ok("ok".into()), "served once a slot frees");
    assert!(
        waited >= Duration::from_millis(1200) && waited < Duration::from_secs(8),
        "waited {waited:?}: both slots were held until the 2s header timeout freed them"
    );
}

/// One client address may hold only its share of the connections: the rest of the slots
/// stay for others, such as the kubelet's probes. (Loopback answers on all of 127/8, so
/// the two clients here are 127.0.0.2 and 127.0.0.1.)
#[tokio::test]
async fn one_client_cannot_hold_every_slot() {
    let addr = endpoint(HttpLimits {
        header_read: Duration::from_secs(30),
        connection: Duration::from_secs(60),
        max_connections: 4,
        per_client: 2,
    })
    .await;
    let from = |ip: &str| {
        let ip: std::net::IpAddr = ip.parse().expect("ip");
        let addr = addr.clone();
        async move {
            let socket = tokio::net::TcpSocket::new_v4().expect("socket");
            socket
                .bind(std::net::SocketAddr::new(ip, 0))
                .expect("bind a loopback address");
            socket
                .connect(addr.parse().expect("addr"))
                .await
                .expect("connect")
        }
    };
    // The hog: its share, then six more that each get closed at once.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = from("127.0.0.2").await;
        s.write_all(HALF_REQUEST).await.expect("write");
        held.push(s);
    }
    for i in 0..6 {
        let mut s = from("127.0.0.2").await;
        let _ = s.write_all(HALF_REQUEST).await;
        let (_, closed) = read_until_closed(&mut s, Duration::from_secs(5)).await;
        assert!(
            closed.is_some(),
            "connection {} of one client was kept (its share is 2)",
            i + 3
        );
    }
    // Another client is served at once, though the hog keeps its two.
    let start = Instant::now();
    let answer = http_get(&format!("http://{addr}/healthz")).await;
    assert_eq!(answer, Ok("ok".into()));
    println!("another client served after {:?}", start.elapsed());
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "another client waited {:?} (the hog's connections end after 30 s)",
        start.elapsed()
    );
    // The hog's held connections are still open: closed only past their limits.
    let (_, closed) = read_until_closed(&mut held[0], Duration::from_millis(300)).await;
    assert!(closed.is_none(), "a connection within the share was closed");
}

#[test]
fn the_production_limits_are_bounded() {
    let d = HttpLimits::default();
    assert!(d.header_read <= Duration::from_secs(10), "{d:?}");
    assert!(d.connection <= Duration::from_secs(120), "{d:?}");
    assert!((1..=256).contains(&d.max_connections), "{d:?}");
    assert!(
        (1..=d.max_connections / 4).contains(&d.per_client),
        "one client holds at most a quarter: {d:?}"
    );
}

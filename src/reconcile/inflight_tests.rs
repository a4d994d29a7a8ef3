//! Unit tests of `inflight.rs`: the budget of reconcile inputs in flight.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use super::*;

const KIB: usize = 1 << 10;

/// 1 MiB: a reserve of 256 KiB for small requests, big ones 768 KiB at most, small ones
/// 16 KiB at most.
fn budget() -> Arc<InputBudget> {
    InputBudget::new(1 << 20, InputMetrics::default())
}

type Waiting<'a> = Pin<Box<dyn Future<Output = Result<InputPermit, OverBudget>> + Send + 'a>>;

fn request(b: &Arc<InputBudget>, bytes: usize) -> Waiting<'_> {
    Box::pin(b.acquire(bytes))
}

async fn granted(f: &mut Waiting<'_>) -> InputPermit {
    tokio::time::timeout(Duration::from_secs(5), f)
        .await
        .expect("granted once there is room")
        .expect("within the budget")
}

async fn pending(f: &mut Waiting<'_>) -> bool {
    futures::poll!(f).is_pending()
}

#[test]
fn the_bounds_follow_the_total() {
    let b = budget();
    assert_eq!(b.total(), 1 << 20);
    assert_eq!(b.big_max(), 768 * KIB);
    assert_eq!(b.small_max(), 16 * KIB);
}

#[tokio::test]
async fn what_is_acquired_is_counted_until_the_permit_goes() {
    let metrics = InputMetrics::default();
    let b = InputBudget::new(1 << 20, metrics.clone());
    let p = b.acquire(100 * KIB).await.expect("fits");
    let q = b.acquire(KIB).await.expect("fits");
    assert_eq!(p.bytes(), 100 * KIB);
    assert_eq!(b.in_flight(), 101 * KIB);
    assert_eq!(metrics.in_flight.get(), 101 * 1024);
    drop(p);
    assert_eq!(b.in_flight(), KIB);
    drop(q);
    assert_eq!(b.in_flight(), 0);
    assert_eq!(metrics.in_flight.get(), 0);
    assert_eq!(metrics.waits.get(), 0);
}

#[tokio::test]
async fn a_request_no_permit_could_hold_is_refused_at_once() {
    let metrics = InputMetrics::default();
    let b = InputBudget::new(1 << 20, metrics.clone());
    let _held = b.acquire(500 * KIB).await.expect("fits");
    let e = b
        .acquire(768 * KIB + 1)
        .await
        .err()
        .expect("more than a request may hold");
    assert_eq!(
        (e.need, e.most, e.total),
        (768 * KIB + 1, 768 * KIB, 1 << 20)
    );
    let text = e.to_string();
    assert!(
        text.contains("more than the 768 KiB one reconcile may hold"),
        "{text}"
    );
    assert_eq!(metrics.refused.get(), 1);
    assert!(b.try_acquire(usize::MAX).is_err());
    // The most a request may hold waits for room, and gets it.
    let mut most = request(&b, 768 * KIB);
    assert!(pending(&mut most).await);
    drop(_held);
    assert_eq!(granted(&mut most).await.bytes(), 768 * KIB);
}

#[tokio::test]
async fn a_small_request_does_not_wait_behind_a_big_one() {
    let metrics = InputMetrics::default();
    let b = InputBudget::new(1 << 20, metrics.clone());
    let first = b.acquire(400 * KIB).await.expect("fits");
    let _second = b.acquire(368 * KIB).await.expect("fits");
    // Big ones hold all they may: the next waits.
    let mut big = request(&b, 200 * KIB);
    assert!(pending(&mut big).await);
    assert_eq!(metrics.waits.get(), 1);
    // Small ones go ahead of it, from the reserve, at once.
    let small: Vec<InputPermit> = (0..10)
        .map(|_| b.try_acquire(16 * KIB).expect("small").expect("at once"))
        .collect();
    assert_eq!(b.in_flight(), 768 * KIB + 160 * KIB);
    assert!(pending(&mut big).await);
    drop(first);
    assert_eq!(granted(&mut big).await.bytes(), 200 * KIB);
    drop(small);
}

#[tokio::test]
async fn big_requests_are_served_in_order() {
    let b = budget();
    let held = b.acquire(700 * KIB).await.expect("fits");
    let mut first = request(&b, 300 * KIB);
    assert!(pending(&mut first).await);
    // 100 KiB would fit beside what is held, but a big request waits its turn.
    let mut second = request(&b, 100 * KIB);
    assert!(pending(&mut second).await);
    assert!(b.try_acquire(100 * KIB).expect("big").is_none());
    drop(held);
    // `second` is polled first: still not before `first`.
    assert!(pending(&mut second).await);
    let a = granted(&mut first).await;
    let c = granted(&mut second).await;
    assert_eq!(b.in_flight(), a.bytes() + c.bytes());
}

#[tokio::test]
async fn while_a_big_one_waits_small_ones_keep_to_the_reserve() {
    let b = budget();
    // With no big one waiting, small ones may use the whole budget.
    let mut small: Vec<InputPermit> = (0..50)
        .map(|_| b.try_acquire(16 * KIB).expect("small").expect("at once"))
        .collect();
    assert_eq!(b.in_flight(), 800 * KIB);
    let mut big = request(&b, 300 * KIB);
    assert!(pending(&mut big).await);
    // Small ones hold more than the reserve: the next small one waits too, so a stream
    // of small ones cannot keep the big one waiting for ever.
    let mut late = request(&b, 16 * KIB);
    assert!(pending(&mut late).await);
    small.truncate(10);
    let big = granted(&mut big).await;
    let late = granted(&mut late).await;
    assert_eq!(b.in_flight(), 300 * KIB + 11 * 16 * KIB);
    drop((big, late, small));
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test]
async fn a_big_request_given_up_leaves_the_line() {
    let b = budget();
    let held = b.acquire(700 * KIB).await.expect("fits");
    let mut first = request(&b, 300 * KIB);
    assert!(pending(&mut first).await);
    let mut second = request(&b, 60 * KIB);
    assert!(pending(&mut second).await);
    // The first is cancelled (its reconcile stopped): the second, which fits beside what
    // is held, goes at once.
    drop(first);
    assert_eq!(granted(&mut second).await.bytes(), 60 * KIB);
    drop(held);
}

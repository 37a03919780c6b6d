//! The relay's LISTEN connection is bounded like every connect of the
//! runtime: a PostgreSQL address that accepts and never answers (a hung
//! server, a proxy with nothing behind it) gives up within the connect
//! timeout, and the relay polls, instead of holding its start (and its
//! shutdown) for ever. The store's own pool is the real PostgreSQL.

use std::time::Instant;

use inbox_runtime::OutboxWakeups;
use inbox_runtime::amqp::CONNECT_TIMEOUT;
use inbox_runtime::sqlx_store::SqlxStore;

#[tokio::test]
async fn a_silent_listen_address_gives_up_within_the_connect_timeout() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a silent listener");
    let port = listener.local_addr().expect("its address").port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::PgPool::connect(&database_url)
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)");
    let store = SqlxStore::new(pool, "wakeups_test")
        .expect("store")
        .with_listen_url(&format!("postgres://postgres@127.0.0.1:{port}/test"));

    let started = Instant::now();
    let wakeups = tokio::time::timeout(CONNECT_TIMEOUT * 4, store.wakeups())
        .await
        .expect("LISTEN gave up on its own, within the connect timeout");
    assert!(wakeups.is_none(), "no wake-ups: the relay polls");
    let took = started.elapsed();
    assert!(
        took >= CONNECT_TIMEOUT && took < CONNECT_TIMEOUT * 3,
        "gave up after the timeout, not before nor much later: {took:?}"
    );
}

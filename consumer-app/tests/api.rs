//! `POST /parcels` over a real listening server (127.0.0.1, a free port),
//! on every compiled store: PostgreSQL (`DATABASE_URL`, default
//! postgres://postgres@127.0.0.1:5432/test) for sqlx and diesel, each test
//! in a schema of its own; the in-process store for memory. No broker: what
//! is checked is what the request committed (the `parcels` row and its
//! outbox row) or did not. An unreachable PostgreSQL fails the test.

use std::net::SocketAddr;

use consumer_app::parcel::api::ParcelApi;
use consumer_app::parcel::events::{EVENT_TYPE, ParcelCreatedEvent, ROUTING_KEY};
use consumer_app::parcel::store::ParcelStore;
use consumer_app::parcel::topology::Topology;
use consumer_app::tools::http::{Answer, post_json, request, request_with};
use inbox_api::MessageId;
use serde_json::json;

const EXCHANGE_PREFIX: &str = "test-api.";

/// The server on `store`, and its address.
async fn serve<S: ParcelStore>(store: &S) -> (consumer_app::parcel::api::ApiServer, SocketAddr) {
    let router = ParcelApi::new(store.clone(), &Topology::new(EXCHANGE_PREFIX)).router();
    let server = consumer_app::parcel::api::ApiServer::start(([127, 0, 0, 1], 0).into(), router)
        .await
        .expect("bind 127.0.0.1:0");
    let addr = server.local_addr();
    (server, addr)
}

/// Parcels and pending outbox rows, as the store counts them.
async fn counts<S: ParcelStore>(store: &S) -> (u64, u64) {
    (
        store.parcel_count().await.expect("parcel count"),
        store.pending_count().await.expect("pending count"),
    )
}

async fn post(addr: SocketAddr, body: serde_json::Value) -> Answer {
    post_json(addr, "/parcels", &body)
        .await
        .expect("POST /parcels")
}

/// 201 with the id, its event's id and a Location; the parcel row and the
/// outbox row exist, the row says where and what to publish, and its body is
/// the event the consumers decode. A server-picked id works the same.
async fn a_creation_commits_the_parcel_and_its_event<S: ParcelStore>(store: S) {
    let (server, addr) = serve(&store).await;
    let answer = post(
        addr,
        json!({"parcel_id": "P 1/é", "tracking_number": "TN1", "destination": "Lyon"}),
    )
    .await;
    assert_eq!(answer.status, 201, "{answer:?}");
    assert_eq!(answer.content_type, "application/json");
    assert_eq!(answer.location, "/parcels/P%201%2F%C3%A9");
    let receipt = answer.json();
    assert_eq!(receipt["parcel_id"], "P 1/é");
    let id: MessageId = receipt["message_id"]
        .as_str()
        .expect("message_id")
        .parse()
        .expect("a UUID");
    let row = store
        .lookup_outgoing(&id)
        .await
        .expect("lookup")
        .expect("the outbox row committed with the parcel");
    assert_eq!(row.published_at, None);
    assert_eq!(
        row.message.exchange(),
        format!("{EXCHANGE_PREFIX}parcel.events")
    );
    assert_eq!(row.message.routing_key(), ROUTING_KEY);
    assert_eq!(row.message.message_type(), EVENT_TYPE);
    let event: ParcelCreatedEvent = serde_json::from_slice(row.message.body()).expect("JSON");
    assert_eq!(
        event,
        ParcelCreatedEvent {
            parcel_id: "P 1/é".into(),
            tracking_number: "TN1".into(),
            destination: "Lyon".into(),
        }
    );
    assert_eq!(counts(&store).await, (1, 1));

    let shown = request(addr, "GET", &answer.location, None, "")
        .await
        .expect("GET");
    assert_eq!(shown.status, 200, "{shown:?}");
    assert_eq!(shown.json()["destination"], "Lyon");
    assert_eq!(shown.json()["message_id"], receipt["message_id"]);
    let missing = request(addr, "GET", "/parcels/nope", None, "")
        .await
        .expect("GET");
    assert_eq!(missing.status, 404, "{missing:?}");

    let picked = post(
        addr,
        json!({"tracking_number": "TN2", "destination": "Oslo"}),
    )
    .await;
    assert_eq!(picked.status, 201, "{picked:?}");
    let picked_id = picked.json()["parcel_id"].as_str().expect("id").to_owned();
    assert!(uuid::Uuid::parse_str(&picked_id).is_ok(), "{picked_id}");
    assert_eq!(counts(&store).await, (2, 2));
    server.stop().await;
    store.drop_schema().await.expect("drop schema");
}

/// The same request again is answered 200 with the same receipt and writes
/// nothing; the same id with other fields is 409 and writes nothing;
/// concurrent creations of one id create it once.
async fn a_retried_creation_writes_nothing_more<S: ParcelStore>(store: S) {
    let (server, addr) = serve(&store).await;
    let body = json!({"parcel_id": "P-9", "tracking_number": "TN9", "destination": "Gdańsk"});
    let first = post(addr, body.clone()).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = post(addr, body.clone()).await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.json(), first.json());
    assert_eq!(again.location, first.location);
    let other = post(
        addr,
        json!({"parcel_id": "P-9", "tracking_number": "TN9", "destination": "Kraków"}),
    )
    .await;
    assert_eq!(other.status, 409, "{other:?}");
    assert!(
        other.json()["error"]
            .as_str()
            .is_some_and(|e| e.contains("P-9"))
    );
    assert_eq!(counts(&store).await, (1, 1));

    let body = json!({"parcel_id": "P-10", "tracking_number": "TN10", "destination": "Rome"});
    let answers = futures::future::join_all((0..8).map(|_| post(addr, body.clone()))).await;
    let mut statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 200, 200, 200, 201],
        "{answers:?}"
    );
    assert_eq!(counts(&store).await, (2, 2));
    server.stop().await;
    store.drop_schema().await.expect("drop schema");
}

/// Each bad request gets its 4xx with a JSON reason, and writes nothing.
async fn bad_requests_write_nothing<S: ParcelStore>(store: S) {
    let (server, addr) = serve(&store).await;
    let long = "x".repeat(ParcelCreatedEvent::MAX_FIELD_LEN + 1);
    let json_type = Some("application/json");
    let cases: Vec<(&str, Option<&str>, String, u16, &str)> = vec![
        (
            "not JSON",
            json_type,
            "{nope".into(),
            400,
            "invalid request body",
        ),
        (
            "empty body",
            json_type,
            String::new(),
            400,
            "invalid request body",
        ),
        (
            "missing field",
            json_type,
            json!({"tracking_number": "T"}).to_string(),
            422,
            "destination",
        ),
        (
            "wrong type",
            json_type,
            json!({"tracking_number": 7, "destination": "D"}).to_string(),
            422,
            "invalid request body",
        ),
        (
            "blank field",
            json_type,
            json!({"tracking_number": "  ", "destination": "D"}).to_string(),
            422,
            "tracking_number is empty",
        ),
        (
            "blank parcel id",
            json_type,
            json!({"parcel_id": "", "tracking_number": "T", "destination": "D"}).to_string(),
            422,
            "parcel_id is empty",
        ),
        (
            "control character",
            json_type,
            json!({"tracking_number": "T", "destination": "Ly\non"}).to_string(),
            422,
            "U+000A",
        ),
        (
            "NUL",
            json_type,
            json!({"tracking_number": "T\u{0}", "destination": "D"}).to_string(),
            422,
            "U+0000",
        ),
        (
            "too long",
            json_type,
            json!({"tracking_number": "T", "destination": long}).to_string(),
            422,
            "longer than",
        ),
        (
            "not declared JSON",
            Some("text/plain"),
            json!({"tracking_number": "T", "destination": "D"}).to_string(),
            415,
            "Content-Type",
        ),
        (
            "no content type",
            None,
            json!({"tracking_number": "T", "destination": "D"}).to_string(),
            415,
            "Content-Type",
        ),
        (
            "too large",
            json_type,
            format!(
                r#"{{"tracking_number":"T","destination":"D","pad":"{}"}}"#,
                "x".repeat(20_000)
            ),
            413,
            "",
        ),
    ];
    for (case, content_type, body, status, reason) in cases {
        let answer = request(addr, "POST", "/parcels", content_type, body)
            .await
            .expect(case);
        assert_eq!(answer.status, status, "{case}: {answer:?}");
        assert_eq!(
            answer.content_type, "application/json",
            "{case}: {answer:?}"
        );
        let error = answer.json()["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            !error.is_empty() && error.contains(reason),
            "{case}: {answer:?}"
        );
    }
    assert_eq!(counts(&store).await, (0, 0));
    server.stop().await;
    store.drop_schema().await.expect("drop schema");
}

/// `POST /parcels` with `Idempotency-Key: key`.
async fn post_keyed(addr: SocketAddr, key: &str, body: &serde_json::Value) -> Answer {
    request_with(
        addr,
        "POST",
        "/parcels",
        Some("application/json"),
        &[("idempotency-key", key)],
        body.to_string(),
    )
    .await
    .expect("POST /parcels")
}

/// An `Idempotency-Key` makes a creation with a server-picked id safe to
/// retry: the retry gets the first response (the same parcel id) and
/// writes nothing; another body under the key is 422; a bad key is 400;
/// a request refused before its work does not use the key up. Eight
/// concurrent requests with one key, on one server and on two servers of
/// one store, write once: the others are answered the first response
/// (after waiting for it) or 409.
async fn an_idempotency_key_answers_retries_with_the_first_response<S: ParcelStore>(store: S) {
    let (server, addr) = serve(&store).await;
    let body = json!({"tracking_number": "TN-K", "destination": "Porto"});
    let first = post_keyed(addr, "order-1", &body).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed, "{first:?}");
    let again = post_keyed(addr, "order-1", &body).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert!(again.replayed, "a retry must say it is replayed: {again:?}");
    assert_eq!(again.json(), first.json(), "the retry's answer");
    assert_eq!(again.location, first.location);
    assert_eq!(counts(&store).await, (1, 1));

    let other = post_keyed(
        addr,
        "order-1",
        &json!({"tracking_number": "TN-K", "destination": "Faro"}),
    )
    .await;
    assert_eq!(other.status, 422, "{other:?}");
    assert!(other.body.contains("Idempotency-Key"), "{other:?}");
    let bad_key = post_keyed(addr, "two words", &body).await;
    assert_eq!(bad_key.status, 400, "{bad_key:?}");
    let refused = request_with(
        addr,
        "POST",
        "/parcels",
        Some("application/json"),
        &[("idempotency-key", "order-2")],
        "{not json",
    )
    .await
    .expect("POST");
    assert_eq!(refused.status, 400, "{refused:?}");
    assert_eq!(counts(&store).await, (1, 1));
    let after_refusal = post_keyed(addr, "order-2", &body).await;
    assert_eq!(
        after_refusal.status, 201,
        "a key whose request was refused before its work is still free: {after_refusal:?}"
    );
    assert_eq!(counts(&store).await, (2, 2));

    // One server, then two servers on the same store (in-flight keys are
    // per process; the claim is what makes the second server wait).
    let (second, addr2) = serve(&store).await;
    for (round, addrs) in [("order-3", [addr, addr]), ("order-4", [addr, addr2])] {
        let answers =
            futures::future::join_all((0..8).map(|i| post_keyed(addrs[i % 2], round, &body))).await;
        let processed: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status == 201 && !a.replayed)
            .collect();
        assert_eq!(
            processed.len(),
            1,
            "{round}: one request does the work: {answers:?}"
        );
        for answer in &answers {
            match answer.status {
                201 => assert_eq!(answer.json(), processed[0].json(), "{round}: {answer:?}"),
                409 => assert_eq!(answer.retry_after, "1", "{round}: {answer:?}"),
                _ => panic!("{round}: unexpected answer {answer:?}"),
            }
        }
    }
    assert_eq!(counts(&store).await, (4, 4), "one parcel per key");
    second.stop().await;
    server.stop().await;
    store.drop_schema().await.expect("drop schema");
}

macro_rules! api_tests {
    ($store:path, $kind:literal) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_idempotency_key_answers_retries_with_the_first_response() {
            super::an_idempotency_key_answers_retries_with_the_first_response(
                $store(concat!("idem_", $kind)).await,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_creation_commits_the_parcel_and_its_event() {
            super::a_creation_commits_the_parcel_and_its_event(
                $store(concat!("create_", $kind)).await,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_retried_creation_writes_nothing_more() {
            super::a_retried_creation_writes_nothing_more($store(concat!("retry_", $kind)).await)
                .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn bad_requests_write_nothing() {
            super::bad_requests_write_nothing($store(concat!("bad_", $kind)).await).await;
        }
    };
}

#[cfg(any(feature = "sqlx", feature = "diesel"))]
mod postgres {
    pub(crate) fn database_url() -> String {
        std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
    }

    pub(crate) fn schema(test: &str) -> String {
        format!(
            "api_{test}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )
    }

    pub(crate) fn unreachable(error: &inbox_api::InboxError) -> ! {
        panic!(
            "PostgreSQL is not reachable ({}); start it with `bash .ci/services.sh`",
            inbox_runtime::error::chain(error)
        )
    }
}

#[cfg(feature = "sqlx")]
mod sqlx_store {
    use super::postgres::{database_url, schema, unreachable};
    use consumer_app::parcel::store::ParcelStore;
    use inbox_backend_sqlx::SqlxStore;

    async fn store(test: &str) -> SqlxStore {
        let store = SqlxStore::connect(&database_url(), &schema(test))
            .await
            .unwrap_or_else(|e| unreachable(&e));
        store.migrate_all().await.expect("migrate");
        store
    }

    api_tests!(store, "sqlx");

    /// A request whose transaction fails after the enqueue (a constraint
    /// this test adds refuses the parcel row) gets 500 and leaves no
    /// outbox row; a store that cannot be reached gets 503 with
    /// `Retry-After`, and nothing either.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_creation_enqueues_nothing() {
        let failing = store("failed").await;
        sqlx::query(
            "ALTER TABLE parcels ADD CONSTRAINT no_atlantis CHECK (destination <> 'Atlantis')",
        )
        .execute(failing.pool())
        .await
        .expect("constraint");
        let (server, addr) = super::serve(&failing).await;
        let refused = super::post(
            addr,
            serde_json::json!({"tracking_number": "T", "destination": "Atlantis"}),
        )
        .await;
        assert_eq!(refused.status, 500, "{refused:?}");
        assert!(
            refused.json()["error"]
                .as_str()
                .is_some_and(|e| e.contains("nothing was written"))
        );
        assert_eq!(super::counts(&failing).await, (0, 0));
        server.stop().await;

        failing.drop_schema().await.expect("drop schema");

        // A store whose pool is closed: every begin fails, retryably.
        let closed = store("closed").await;
        closed.drop_schema().await.expect("drop schema");
        closed.pool().close().await;
        let (server, addr) = super::serve(&closed).await;
        let unavailable = super::post(
            addr,
            serde_json::json!({"tracking_number": "T", "destination": "Lyon"}),
        )
        .await;
        assert_eq!(unavailable.status, 503, "{unavailable:?}");
        assert_eq!(unavailable.retry_after, "1");
        server.stop().await;
    }
}

#[cfg(feature = "diesel")]
mod diesel_store {
    use super::postgres::{database_url, schema, unreachable};
    use consumer_app::parcel::store::ParcelStore;
    use inbox_backend_diesel::DieselStore;

    async fn store(test: &str) -> DieselStore {
        let store = DieselStore::connect(&database_url(), &schema(test), 8)
            .await
            .unwrap_or_else(|e| unreachable(&e));
        store.migrate_all().await.expect("migrate");
        store
    }

    api_tests!(store, "diesel");
}

#[cfg(feature = "memory")]
mod memory_store {
    use inbox_backend_memory::MemoryStore;

    async fn store(_test: &str) -> MemoryStore {
        MemoryStore::new()
    }

    api_tests!(store, "memory");
}

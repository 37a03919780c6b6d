//! The partitioned inbox layout's commands against the real PostgreSQL,
//! each in a schema of its own: `partitions` creates the days ahead and
//! lists every partition with its bounds and estimated rows, and refuses
//! the table layout (`bash .ci/services.sh`).

use std::process::Command;

use consumer_app::parcel::store::ParcelStore;
use inbox_api::{ConsumerName, Handled, Inbox, InboxError, InboxKey, MessageId};
use inbox_backend_sqlx::SqlxStore;
use inbox_postgres::Layout;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A schema of the test's own, migrated with `layout`.
async fn migrated(layout: Layout) -> SqlxStore {
    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let store = SqlxStore::connect(&database_url(), &format!("app_parts_{id}"))
        .await
        .expect("PostgreSQL reachable (bash .ci/services.sh)")
        .with_layout(layout);
    store.migrate_all().await.expect("migrate");
    store
}

/// Claims and processes `ids` (once each).
async fn processed(store: &SqlxStore, ids: impl IntoIterator<Item = MessageId>) {
    let inbox = Inbox::new(store.clone());
    let consumer = ConsumerName::new("partitions-test").expect("valid name");
    for id in ids {
        let key = InboxKey::new(id, consumer.clone());
        let handled = inbox.handle(&key, async |_| Ok::<_, InboxError>(())).await;
        assert!(matches!(handled, Ok(Handled::Processed(()))), "{handled:?}");
    }
}

/// A v7 id of `days` days before now.
fn v7_days_ago(days: u64) -> MessageId {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
        - days * 86_400;
    MessageId::from_uuid(uuid::Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        secs,
        0,
    )))
}

/// Runs `parcel-inbox` on `store`'s schema with the global flags `global`,
/// then `args`; returns its exit code and everything it printed.
fn parcel_inbox(store: &SqlxStore, global: &[&str], args: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_parcel-inbox"))
        .args([
            "--database-url",
            &database_url(),
            "--schema",
            store.schema(),
        ])
        .args(global)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run parcel-inbox");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code(), text)
}

/// The line of `listing` that starts with `name`.
fn line_of<'a>(listing: &'a str, name: &str) -> &'a str {
    listing
        .lines()
        .find(|line| line.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in:\n{listing}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_creates_the_days_ahead_and_lists_them_with_their_rows() {
    let store = migrated(Layout::Partitioned).await;
    // Today's day and the untimed partition take rows; analyzed, so that
    // the planner has estimates to show.
    processed(&store, (0..30).map(|_| v7_days_ago(0))).await;
    processed(
        &store,
        (0..20).map(|_| MessageId::from_uuid(uuid::Uuid::new_v4())),
    )
    .await;
    sqlx::query("ANALYZE inbox_messages")
        .execute(store.pool())
        .await
        .expect("analyze");
    let day = |ahead: i64| {
        (chrono::Utc::now().date_naive() + chrono::Duration::days(ahead))
            .format("inbox_messages_p%Y%m%d")
            .to_string()
    };
    let mut stores = vec!["--store=sqlx"];
    if cfg!(feature = "diesel") {
        stores.push("--store=diesel");
    }
    // The migration made yesterday to three days ahead: five more days
    // ahead are two new ones, then none on the next run.
    for (store_flag, created) in stores.into_iter().zip([2, 0]) {
        let (code, text) = parcel_inbox(
            &store,
            &[store_flag, "--layout=partitioned"],
            &["partitions", "--ahead=5"],
        );
        assert_eq!(code, Some(0), "{store_flag}:\n{text}");
        assert!(
            text.contains(&format!("created {created} day partition(s)")),
            "{store_flag}:\n{text}"
        );
        for ahead in -1..=5 {
            line_of(&text, &day(ahead));
        }
        assert!(!text.contains(&day(6)), "{text}");
        let today = line_of(&text, &day(0));
        assert!(
            today.contains(" 30  FOR VALUES FROM (true, '"),
            "today's 30 rows and bounds:\n{text}"
        );
        let untimed = line_of(&text, "inbox_messages_untimed");
        assert!(
            untimed.contains(" 20  FOR VALUES FROM (false, MINVALUE) TO (true, MINVALUE)"),
            "the untimed partition's 20 rows and bounds:\n{text}"
        );
        assert!(text.contains("8 partition(s)"), "{text}");
    }
    // The default creates as far ahead as the migration does.
    let (code, text) = parcel_inbox(&store, &["--layout=partitioned"], &["partitions"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("created 0 day partition(s)"), "{text}");
    assert!(
        text.contains(&format!("to {} day(s) ahead", inbox_postgres::DAYS_AHEAD)),
        "{text}"
    );
    store.drop_schema().await.expect("drop schema");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_refuses_the_table_layout() {
    let store = migrated(Layout::Table).await;
    // Not told the layout: refused before connecting.
    let (code, text) = parcel_inbox(&store, &[], &["partitions"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("`partitions` needs the partitioned inbox layout"),
        "{text}"
    );
    // Told the wrong one: the schema's own layout refuses it, and nothing
    // was created.
    let (code, text) = parcel_inbox(&store, &["--layout=partitioned"], &["partitions"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("the schema's inbox table has the table layout"),
        "{text}"
    );
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class WHERE relnamespace = $1::regnamespace \
         AND relname ~ '^inbox_messages_(p[0-9]{8}|untimed)$'",
    )
    .bind(store.schema())
    .fetch_one(store.pool())
    .await
    .expect("count tables");
    assert_eq!(tables, 0);
    store.drop_schema().await.expect("drop schema");
}

/// `cleanup` on the partitioned layout reports the day partitions it
/// dropped, with their rows, apart from the rows it deleted one by one
/// (the untimed partition's); on the table layout only the latter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_reports_dropped_days_apart_from_deleted_rows() {
    let store = migrated(Layout::Partitioned).await;
    processed(&store, (0..7).map(|_| v7_days_ago(1))).await;
    processed(&store, (0..3).map(|_| v7_days_ago(0))).await;
    processed(
        &store,
        (0..5).map(|_| MessageId::from_uuid(uuid::Uuid::new_v4())),
    )
    .await;
    // A retention of 0: every processed untimed row, and yesterday (ended
    // at midnight), are past it; today is not over.
    let (code, text) = parcel_inbox(
        &store,
        &["--layout=partitioned"],
        &["cleanup", "--retention-days=0"],
    );
    assert_eq!(code, Some(0), "{text}");
    let yesterday = (chrono::Utc::now().date_naive() - chrono::Duration::days(1)).to_string();
    assert!(
        text.contains(&format!(
            "dropped 1 day partition(s) older than 0.0 days ({yesterday}) holding 7 inbox rows"
        )),
        "{text}"
    );
    assert!(
        text.contains("deleted 5 processed inbox rows older than 0.0 days"),
        "{text}"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_messages")
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!(left, 3, "today's rows stay");
    store.drop_schema().await.expect("drop schema");

    let store = migrated(Layout::Table).await;
    processed(&store, (0..4).map(|_| v7_days_ago(1))).await;
    let (code, text) = parcel_inbox(&store, &[], &["cleanup", "--retention-days=0"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("day partition"), "{text}");
    assert!(
        text.contains("deleted 4 processed inbox rows older than 0.0 days"),
        "{text}"
    );
    store.drop_schema().await.expect("drop schema");
}

-- The Parcel Tracking service's own tables: the business effects of its two
-- consumers. Applied after the inbox's migrations, in the same schema (the
-- store's search_path), by `parcel-inbox migrate`, through sqlx or diesel.
--
-- Deliberately NO unique constraint on message_id: the inbox is what makes
-- each effect happen once, and a double effect must stay visible and
-- countable (`parcel-inbox stats`, the demo) instead of being hidden by a
-- constraint that would turn it into an error.
-- Idempotent (IF NOT EXISTS): safe to run on every start and from several
-- instances.

CREATE TABLE IF NOT EXISTS notifications (
    id              BIGSERIAL    PRIMARY KEY,
    message_id      UUID         NOT NULL,
    parcel_id       TEXT         NOT NULL,
    tracking_number TEXT         NOT NULL,
    destination     TEXT         NOT NULL,
    body            TEXT         NOT NULL,
    created_at      TIMESTAMPTZ  NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS notifications_message_id_idx ON notifications (message_id);

CREATE TABLE IF NOT EXISTS carrier_assignments (
    id              BIGSERIAL    PRIMARY KEY,
    message_id      UUID         NOT NULL,
    parcel_id       TEXT         NOT NULL,
    carrier         TEXT         NOT NULL,
    slot            TEXT         NOT NULL,
    created_at      TIMESTAMPTZ  NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS carrier_assignments_message_id_idx ON carrier_assignments (message_id);

-- After-commit dispatch (see src/dispatch.rs): an intent row is dispatched
-- once its downstream call succeeded. A reconciler re-sends committed rows
-- still undispatched after a grace period (the process died between COMMIT
-- and the call); the downstream dedupes by idempotency key (the message id).
ALTER TABLE notifications ADD COLUMN IF NOT EXISTS dispatched_at TIMESTAMPTZ;
ALTER TABLE carrier_assignments ADD COLUMN IF NOT EXISTS dispatched_at TIMESTAMPTZ;
CREATE INDEX IF NOT EXISTS notifications_undispatched_idx
    ON notifications (created_at) WHERE dispatched_at IS NULL;
CREATE INDEX IF NOT EXISTS carrier_assignments_undispatched_idx
    ON carrier_assignments (created_at) WHERE dispatched_at IS NULL;

-- The stub downstreams' durable ledger: what a carrier's booking API or a
-- notification provider with an Idempotency-Key keeps on its side. Written
-- outside the inbox transaction (after commit), one row per (downstream,
-- idempotency key), `calls` counting repeats. Shared by every process, and
-- it survives kill -9, so a chaos run can count bookings.
CREATE TABLE IF NOT EXISTS stub_ledger (
    downstream      TEXT         NOT NULL,
    idempotency_key TEXT         NOT NULL,
    parcel_id       TEXT         NOT NULL,
    calls           BIGINT       NOT NULL DEFAULT 1,
    first_call_at   TIMESTAMPTZ  NOT NULL DEFAULT now(),
    last_call_at    TIMESTAMPTZ  NOT NULL DEFAULT now(),
    PRIMARY KEY (downstream, idempotency_key)
);

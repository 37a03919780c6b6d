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

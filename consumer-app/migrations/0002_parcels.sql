-- The producer side's table: the parcels `POST /parcels` creates. Each row
-- is written in the same transaction as its `parcel.created` outbox row (the
-- inbox crates' outbox table, in the same schema), so a parcel exists iff
-- its event will be published.
--
-- The primary key is the parcel id a client may choose: a retried creation
-- meets the first row (ON CONFLICT DO NOTHING) instead of creating a second
-- parcel and a second event. Idempotent (IF NOT EXISTS), as 0001.

CREATE TABLE IF NOT EXISTS parcels (
    parcel_id       TEXT         PRIMARY KEY,
    tracking_number TEXT         NOT NULL,
    destination     TEXT         NOT NULL,
    created_at      TIMESTAMPTZ  NOT NULL DEFAULT now()
);

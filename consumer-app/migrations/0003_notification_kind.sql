-- Two kinds of notification: "your parcel is on its way" (`parcel.created`)
-- and "a carrier has your parcel" (`parcel.carrier-assigned`, the second hop
-- of the loop). One table, one sender and one reconciler for both; the kind
-- says which text was sent. Rows from before are of the first kind.
-- Idempotent, as 0001.

ALTER TABLE notifications ADD COLUMN IF NOT EXISTS kind TEXT NOT NULL DEFAULT 'parcel_created';

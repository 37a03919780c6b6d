-- The bare transaction: BEGIN, the business write, COMMIT (3 round trips).
\set r random(1, 4000000000000000000)
BEGIN;
INSERT INTO bench_events (message_id, payload) VALUES ((lpad(to_hex((extract(epoch from clock_timestamp())*1000000)::bigint), 16, '0') || lpad(to_hex(:r::bigint), 16, '0'))::uuid, 'parcel P-1 scanned at depot 7');
COMMIT;

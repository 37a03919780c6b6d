-- The inbox per message: BEGIN, the claim, the business write, COMMIT (4 round trips).
\set r random(1, 4000000000000000000)
BEGIN;
INSERT INTO inbox_messages (id, consumer_type, processed_at) VALUES ((lpad(to_hex((extract(epoch from clock_timestamp())*1000000)::bigint), 16, '0') || lpad(to_hex(:r::bigint), 16, '0'))::uuid, 'bench', now()) ON CONFLICT DO NOTHING;
INSERT INTO bench_events (message_id, payload) VALUES ((lpad(to_hex((extract(epoch from clock_timestamp())*1000000)::bigint), 16, '0') || lpad(to_hex(:r::bigint), 16, '0'))::uuid, 'parcel P-1 scanned at depot 7');
COMMIT;

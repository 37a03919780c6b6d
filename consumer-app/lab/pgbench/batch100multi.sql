-- Batched, K = 100, with the 100 business rows in one INSERT … SELECT: one claim, one write, COMMIT.
\set r random(1, 4000000000000000000)
BEGIN;
INSERT INTO inbox_messages (id, consumer_type, processed_at) SELECT id, 'bench', now() FROM (SELECT (lpad(to_hex((extract(epoch from clock_timestamp())*1000000)::bigint), 16, '0') || lpad(to_hex(:r::bigint + g), 16, '0'))::uuid AS id FROM generate_series(1, 100) AS g) AS k ORDER BY id ON CONFLICT DO NOTHING RETURNING id, consumer_type::text;
INSERT INTO bench_events (message_id, payload) SELECT (lpad(to_hex((extract(epoch from clock_timestamp())*1000000)::bigint), 16, '0') || lpad(to_hex(:r::bigint + g), 16, '0'))::uuid, 'parcel P-1 scanned at depot 7' FROM generate_series(1, 100) AS g;
COMMIT;

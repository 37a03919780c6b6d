-- pipelined.sql as the diesel store sends it: BEGIN with the transaction-local mark, and the claim that inserts only under it.
\set r random(1, 4000000000000000000)
\startpipeline
BEGIN;
SET LOCAL inbox.pipelined_claim = 'on';
INSERT INTO inbox_messages (id, consumer_type, processed_at) SELECT (lpad(to_hex((extract(epoch from clock_timestamp())*1000000)::bigint), 16, '0') || lpad(to_hex(:r::bigint), 16, '0'))::uuid, 'bench', now() WHERE current_setting('inbox.pipelined_claim', true) = 'on' ON CONFLICT DO NOTHING;
\endpipeline
INSERT INTO bench_events (message_id, payload) VALUES ((lpad(to_hex((extract(epoch from clock_timestamp())*1000000)::bigint), 16, '0') || lpad(to_hex(:r::bigint), 16, '0'))::uuid, 'parcel P-1 scanned at depot 7');
COMMIT;
